"""Multi-turn episodes through the whole loop: the calculator task trains in sync, lagged and
async modes and with in-flight updates, and a tool that hangs, raises or floods its output
never stops a run.

Random init keeps these fast: the character model still writes the calculator's turn end
(``>``) now and then, so episodes have turns, observations and tool calls; the warm start
and the learning itself are measured by the calculator preset's experiment, not here.
"""

import json
import textwrap
import time

import numpy as np
import pytest

from gac_jax.train import loop
from gac_jax.train.config import get_preset
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.metrics import read_metrics
from tests.conftest import process_env

FAST = [
    "init=random",
    "steps=4",
    "eval_every=0",
    "checkpoint_every=0",
    "samples_every=2",
    "generation.group_size=4",
    "generation.max_new_tokens=32",
    "rollout.groups_per_batch=4",
    "episode.max_observation_tokens=6",
    "mesh.data=1",
]
# The calculator's turn ends with ">"; a random model at temperature 2 writes it often
# enough for a few turns a batch.
HOT = ["generation.temperature=2.0"]


def _config(tmp_path, *overrides):
    config = apply_overrides(get_preset("calculator"), [f"data_dir={tmp_path / 'tfds'}", *FAST])
    return apply_overrides(config, [*HOT, *overrides])


MODES = {
    "sync": ["rollout.mode=sync"],
    "lagged": ["rollout.mode=lagged", "rollout.lag=2"],
    "async": ["rollout.mode=async", "buffer.max_staleness=1"],
    "async in-flight": [
        "rollout.mode=async",
        "buffer.max_staleness=1",
        "rollout.inflight_updates=true",
        "rollout.inflight_chunk_steps=2",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_calculator_trains_in_every_mode(tmp_path, consumed, mode):
    out = loop.train(_config(tmp_path, *MODES[mode]), tmp_path / "run")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in records)
    groups = [r for batch in consumed for r in batch]
    assert all(r.observation_mask is not None for r in groups)
    observed = sum(int(r.observation_mask.sum()) for r in groups)
    assert observed > 0 and sum(r["tools/calls"] for r in records) > 0
    assert sum(r["episode/observation_tokens"] for r in records) == observed
    for r in groups:
        assert not (r.observation_mask & r.completion_mask).any()
        if r.token_versions is not None:  # In-flight: versions across turns never go back.
            for mask, versions in zip(r.completion_mask, r.token_versions, strict=True):
                assert np.all(np.diff(versions[mask]) >= 0)
    # Samples hold the whole transcript, turn by turn.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    with_turns = [s for s in samples if any(t["role"] == "environment" for t in s["turns"])]
    assert with_turns
    s = with_turns[0]
    assert "".join(t["text"] for t in s["turns"]) == s["completion"]


MISBEHAVING = textwrap.dedent(
    '''
    import time
    from gac_jax.tasks.calculator import Calculator

    class Misbehaving(Calculator):
        """The calculator, but its first step of every episode hangs, raises or floods."""

        calls = 0

        def step(self, state, turn):
            type(self).calls += 1
            kind = type(self).calls % 3
            if kind == 0:
                time.sleep(60)
            if kind == 1:
                raise RuntimeError("the tool crashed")
            return "9" * 10_000
    '''
)


@pytest.mark.slow
def test_a_misbehaving_tool_never_stops_the_run(tmp_path, monkeypatch):
    (tmp_path / "flaky_tools.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _config(
        tmp_path, "env=flaky_tools:Misbehaving", "episode.tool_timeout=0.5", "rollout.mode=sync"
    )
    started = time.monotonic()
    out = loop.train(config, tmp_path / "run")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    calls = sum(r["tools/calls"] for r in records)
    assert calls >= 3
    assert sum(r["tools/timeouts"] for r in records) >= 1
    assert sum(r["tools/errors"] for r in records) >= 1
    # Each hanging call cost at most its timeout, and they overlapped with decoding: far
    # less than the 60 s a single hang would take.
    assert time.monotonic() - started < 120
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    said = [t["text"] for s in samples for t in s["turns"] if t["role"] == "environment"]
    assert said and all(len(text) <= 6 for text in said)  # Floods cut to 6 tokens.


@pytest.mark.slow
def test_the_readmes_multiturn_commands_run(tmp_path):
    """Every command of the README's "Multi-turn and tools" block, shortened to two steps
    from random weights, with the repository's examples/ (`my_tools.Echo`) beside them."""
    import re
    import shlex
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("### Multi-turn and tools") :]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    shutil.copytree(repo / "examples", tmp_path / "examples")  # PYTHONPATH=examples
    commands = [
        c for c in bash.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")
    ]
    assert len(commands) == 3
    short = [
        "init=random",
        "steps=2",
        "eval_every=0",
        "checkpoint_every=0",
        "samples_every=0",
        "generation.group_size=2",
        "rollout.groups_per_batch=2",
        "mesh.data=1",
        f"data_dir={tmp_path / 'tfds'}",
    ]
    gac_jax_cli = str(Path(sys.executable).parent / "gac-jax")
    for command in commands:
        words = shlex.split(command.split("#")[0])
        env = process_env(8)
        while "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        words[0] = gac_jax_cli
        if "--set" in words:
            at = words.index("--set") + 1
            words[at:at] = short
        else:
            words += ["--set", *short]
        out = words.index("--out") + 1
        words[out] = str(tmp_path / Path(words[out]).name)
        done = subprocess.run(
            words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
        records = read_metrics(Path(words[out]) / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1] and "tools/calls" in records[0]


def test_a_run_reward_on_a_multiturn_task_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="does not apply to a multi-turn task") as error:
        apply_overrides(get_preset("calculator"), ["reward=boxed"]).validate()
    assert "\n" not in str(error.value)


CHAT_TOOL = textwrap.dedent(
    '''
    from gac_jax.tasks.calculator import CalculatorTool
    from gac_jax.tasks.environments import Observation

    class AlwaysCalls(CalculatorTool):
        """The chat calculator, answering a random policy's first two turns as calls."""

        def start(self, example):
            return {"turns": 0}

        def step(self, state, turn):
            state["turns"] += 1
            if state["turns"] > 2:
                return Observation(done=True)
            return Observation("10063", role="tool")
    '''
)


def _chat_model_dir(path):
    """A tiny Qwen3 saved by transformers, a BPE tokenizer, and a ChatML template with
    tool roles (tests/tasks/tool_templates.py) in its tokenizer_config.json."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

    from gac_jax.tasks import calculator
    from gac_jax.tasks.chat import ChatTemplate
    from tests.models.test_hf_checkpoint import COMMON, FAMILIES
    from tests.tasks.tool_templates import CHATML_SPECIAL, CHATML_TOOLS

    template = ChatTemplate(CHATML_TOOLS, CHATML_SPECIAL)
    system = template.render(
        [{"role": "user", "content": "1*2+3?"}], tools=calculator.CalculatorTool().tools
    )
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=special)
    tok.train_from_iterator([system + "0123456789+-*=?"] * 20, trainer)
    tags = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    tok.add_tokens([AddedToken(t, special=False) for t in tags])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHATML_TOOLS, **CHATML_SPECIAL, "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    _, _, qwen3 = FAMILIES["qwen3"]  # The equivalence tests' tiny Qwen3, longer positions.
    hf_config = transformers.Qwen3Config(
        **{**COMMON, **qwen3, "max_position_embeddings": 1024},
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    model = transformers.Qwen3ForCausalLM(hf_config)
    with torch.no_grad():  # The end of turn sampled often: episodes of several turns.
        model.model.embed_tokens.weight[hf_config.eos_token_id] *= 20.0
    model.save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_chat_model_runs_tool_episodes_in_its_templates_roles(tmp_path, monkeypatch):
    """`init=` a chat model directory: the prompt lists the environment's tools, a turn
    ends on the template's <|im_end|> (its EOS too) without ending the episode, and each
    tool result enters the context as the template's tool message."""
    model = _chat_model_dir(tmp_path / "model")
    (tmp_path / "chat_tools.py").write_text(CHAT_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _config(
        tmp_path,
        f"init={model}",
        "env=chat_tools:AlwaysCalls",
        "generation.prompt_length=256",
        "generation.max_new_tokens=96",
        "episode.max_observation_tokens=32",
        "rollout.mode=sync",
        "steps=2",
    )
    out = loop.train(config, tmp_path / "run")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert sum(r["tools/calls"] for r in records) > 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all('"name": "calculator"' in s["prompt"] for s in samples)
    said = [t["text"] for s in samples for t in s["turns"] if t["role"] == "environment"]
    # <|im_start|> is a special token (samples skip it); the tool role's frame is there.
    assert said and all(
        "user\n<tool_response>\n10063\n</tool_response>\nassistant\n" in text for text in said
    )
    two_turns = [s for s in samples if sum(t["role"] == "environment" for t in s["turns"]) == 2]
    assert two_turns, "no episode went on after a turn ended on <|im_end|>"
