"""Chat templates: rendering equals transformers' `apply_chat_template` (a template with a
system prompt and BOS, and a Qwen3-style one with the thinking switch); tasks and run
configs render their prompts through the init directory's template."""

import json

import pytest

from gac_jax.tasks import get_task
from gac_jax.tasks.chat import ChatTemplate, compile_template, with_chat_template
from gac_jax.train.build import build_task
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides

# Llama-3 style: BOS text, a system block (a default one when the messages bring none).
SYSTEM_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = 'You are helpful.' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system | trim }}<|eot_id|>"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Qwen3 style: ChatML, and an empty think block when enable_thinking is false.
THINKING_TEMPLATE = """{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [
        {"role": "system", "content": "Answer with a number.  "},
        {"role": "user", "content": "What is 2+3?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": 'Say "ok" <b>'},
    ],
]


def _hf_tokenizer(template, special):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(special.values())}}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), unk_token="[UNK]", **special
    )
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    ("template", "special", "kwargs"),
    [
        (SYSTEM_TEMPLATE, SPECIAL, {}),
        (THINKING_TEMPLATE, {"eos_token": "<|im_end|>"}, {}),
        (THINKING_TEMPLATE, {"eos_token": "<|im_end|>"}, {"enable_thinking": False}),
        (THINKING_TEMPLATE, {"eos_token": "<|im_end|>"}, {"enable_thinking": True}),
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(template, special, kwargs, add_generation_prompt):
    reference = _hf_tokenizer(template, special)
    ours = ChatTemplate(template, {**special, "unk_token": "[UNK]"})
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        got = ours.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        assert got == expected
    # The switch is really rendered (the comparison could not pass by ignoring it).
    thinking_off = "<think>\n\n</think>" in ours.render(CONVERSATIONS[0], **kwargs)
    assert thinking_off == (
        template is THINKING_TEMPLATE and kwargs.get("enable_thinking") is False
    )


def _model_dir(path, template=SYSTEM_TEMPLATE, **extra):
    path.mkdir()
    config = {"chat_template": template, **SPECIAL, **extra}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_from_directory_reads_the_config_the_named_list_and_the_jinja_file(tmp_path):
    template = ChatTemplate.from_directory(_model_dir(tmp_path / "a"))
    assert template.source == SYSTEM_TEMPLATE
    assert template.special_tokens["bos_token"] == "<|begin_of_text|>"
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    assert ChatTemplate.from_directory(_model_dir(tmp_path / "b", named)).source == "y"
    jinja = _model_dir(tmp_path / "c")
    (jinja / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    assert ChatTemplate.from_directory(jinja).source == THINKING_TEMPLATE
    (tmp_path / "d").mkdir()
    assert ChatTemplate.from_directory(tmp_path / "d") is None


def test_a_jsonl_task_renders_its_system_and_the_default_one(tmp_path):
    rows = [
        {"prompt": "2+3?", "answer": "5", "system": "Be brief."},
        {"prompt": "1+1?", "answer": 2},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task(f"jsonl:{data}")
    template = ChatTemplate(THINKING_TEMPLATE)
    chat = with_chat_template(task, template, system="Default.", enable_thinking=False)
    own, other = task.data_source("train")[0], task.data_source("test")[0]
    assert chat.prompt(own) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert chat.prompt(other).startswith("<|im_start|>system\nDefault.<|im_end|>\n")
    assert chat.reward("5", own) == 1.0  # only the prompt changes


def _config(tmp_path, *overrides):
    return apply_overrides(TrainConfig(), ["task=arithmetic/add2", *overrides])


def test_the_run_renders_prompts_with_the_init_directory_template(tmp_path):
    model = _model_dir(tmp_path / "model")
    (model / "config.json").write_text("{}")
    example = {"a": 12, "op": "+", "b": 30, "answer": 42, "scratchpad": ""}
    raw = get_task("arithmetic/add2").prompt(example)
    task = build_task(_config(tmp_path, f"init={model}", "system_prompt=Add."))
    # strip_bos: the generator adds the BOS id; the template's BOS text is not repeated.
    assert task.prompt(example) == (
        "<|start_header_id|>system<|end_header_id|>\n\nAdd.<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{raw.strip()}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert (
        build_task(_config(tmp_path, f"init={model}", "chat_template=none")).prompt(example) == raw
    )
    plain = build_task(_config(tmp_path, "init=random", "system_prompt=Add."))
    assert plain.prompt(example) == f"Add.\n\n{raw}"


def test_a_template_is_compiled_once_however_often_the_run_reads_it(tmp_path):
    model = _model_dir(tmp_path / "model")
    (model / "config.json").write_text("{}")
    compile_template.cache_clear()
    config = _config(tmp_path, f"init={model}", "system_prompt=Add.")
    config.validate()  # Validation, the task and (multi-turn) the episodes each read it.
    build_task(config)
    build_task(config)
    info = compile_template.cache_info()
    assert info.misses == 1 and info.hits >= 2  # Compiled by the first read only.


def test_chat_settings_fail_with_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"enable_thinking=False needs a chat template"):
        _config(tmp_path, "init=random", "enable_thinking=false").validate()
    with pytest.raises(ValueError, match=r"chat_template='jinja' must be 'auto' or null"):
        _config(tmp_path, "chat_template=jinja").validate()
    broken = _model_dir(tmp_path / "broken", template="{% if %}")
    (broken / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"chat_template: the template of init=") as info:
        _config(tmp_path, f"init={broken}").validate()
    assert "\n" not in str(info.value)


def test_the_one_gpu_gsm8k_presets_prompt_and_score_as_qwen3_is_run(tmp_path):
    import dataclasses

    from gac_jax.train.config import GSM8K_SYSTEM_PROMPT, get_preset

    model = _model_dir(tmp_path / "model", THINKING_TEMPLATE)
    (model / "config.json").write_text("{}")
    example = {
        "question": b"Ann has 3 bags of 6 apples. How many apples?",
        "answer": b"3 * 6 = 18\n#### 18",
        "short_answer": b"18",
    }
    for name in ("qwen3_0_6b_gsm8k_1gpu", "qwen3_1_7b_gsm8k_1gpu_lora"):
        preset = get_preset(name)
        assert (preset.rollout.mode, preset.mesh.data, preset.enable_thinking) == ("sync", 1, False)
        g = preset.generation
        assert (g.temperature, g.max_new_tokens, g.group_size) == (1.0, 512, 8)
        task = build_task(dataclasses.replace(preset, init=str(model)))
        prompt = task.prompt(example)
        assert prompt.startswith(f"<|im_start|>system\n{GSM8K_SYSTEM_PROMPT}<|im_end|>\n")
        assert "<|im_start|>user\nQuestion: Ann has 3 bags of 6 apples." in prompt
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Thinking off.
        # The final-number reward: the boxed answer the system prompt asks for, or ####.
        assert task.reward("3 bags of 6 is \\boxed{18}.", example) == 1.0
        assert task.reward("#### 18", example) == 1.0
        assert task.reward("\\boxed{17}", example) == 0.0
