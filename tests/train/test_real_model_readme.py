"""The README's "Train a real model" section followed step by step, the download aside, on
a tiny Qwen3 that transformers saves where the preset reads its weights (with a tokenizer
and a chat template of Qwen3's shape) and GSM8K release files of a few problems: every
`gac-jax` command of the section runs as written, with `--set` shrinking the run
(`model=tiny`: the checkpoint's own architecture, since the preset names Qwen3-0.6B's).
`--fake-devices 8` is dropped: this process already has the 8 fake CPU devices it asks for.
"""

import json
import re
import shlex

import pytest

from gac_jax.train.cli import main
from gac_jax.train.config import GSM8K_SYSTEM_PROMPT
from gac_jax.train.metrics import read_metrics
from tests.tasks.test_chat import THINKING_TEMPLATE
from tests.train.test_gsm8k_offline import TEST, TRAIN, _write_release_files

README = __import__("pathlib").Path(__file__).resolve().parents[2] / "README.md"

SMALL = [
    "model=tiny",
    "steps=2",
    "eval_every=2",
    "eval_size=2",
    "eval_samples=2",
    "checkpoint_every=2",
    "samples_every=1",
    "rollout.groups_per_batch=8",  # 16 rows: the 8-device preset makes 16 micro-batches.
    "generation.group_size=2",
    "generation.prompt_length=384",
    "generation.max_new_tokens=6",
]


def _section_commands() -> list[list[str]]:
    text = README.read_text()
    section = text.split("## Train a real model", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "gac-jax":
                commands.append(words[1:])
    return commands


def _tiny_qwen3(path):
    """A Qwen3 directory as `hf download` leaves one: weights, config, tokenizer, template."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tests.models.test_hf_checkpoint import COMMON, FAMILIES

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    frame = f"system user assistant {GSM8K_SYSTEM_PROMPT} <think>\n\n</think>\n\n Question: Answer:"
    text = [r["question"] + r["answer"] for r in TRAIN + TEST] + [frame]
    tok.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=special))
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": THINKING_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    _, _, qwen3 = FAMILIES["qwen3"]
    hf_config = transformers.Qwen3Config(
        **{**COMMON, **qwen3, "max_position_embeddings": 512},
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    transformers.Qwen3ForCausalLM(hf_config).save_pretrained(path)


@pytest.mark.slow
def test_the_real_model_section_runs_step_by_step(tmp_path, monkeypatch, capsys):
    commands = _section_commands()
    assert [c[0] for c in commands] == ["plan", "plan", "train", "train", "eval", "export-hf"]
    monkeypatch.chdir(tmp_path)
    _tiny_qwen3(tmp_path / "checkpoints" / "Qwen3-0.6B")  # Step 2, where the preset reads.
    # Step 3, in the run's data_dir (tfds reads $TFDS_DATA_DIR once, at import).
    _write_release_files(tmp_path / "tfds" / "downloads" / "manual")
    for argv in commands:
        if "--fake-devices" in argv:
            at = argv.index("--fake-devices")
            argv = argv[:at] + argv[at + 2 :]
        if argv[0] == "eval":
            argv[argv.index("--step") + 1] = "2"  # The shrunk run's last checkpoint.
        extra = [] if argv[0] == "export-hf" else ["--set", *SMALL, f"data_dir={tmp_path / 'tfds'}"]
        capsys.readouterr()
        assert main([*argv, *extra]) == 0, argv
        if argv[0] == "eval":
            evaluated = json.loads(capsys.readouterr().out)
    run = tmp_path / "runs" / "q06"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and "eval/pass@1" in records[-1]
    assert "eval_start/pass@1" in records[0]
    # The standalone evaluation of the step-2 checkpoint draws what the run's own did.
    for name in ("pass@1", "pass@2", "greedy_accuracy"):
        assert evaluated[f"eval/{name}"] == records[-1][f"eval/{name}"], name
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<think>\n\n</think>" in s["prompt"] for s in samples)
    assert (tmp_path / "exported" / "q06" / "config.json").is_file()
    # The stale-rollout preset ran too: lagged k=8 with VCPO's ESS scaling.
    stale = read_metrics(tmp_path / "runs" / "q06_vcpo" / "metrics.jsonl")
    assert [r["step"] for r in stale] == [0, 1] and "ess_scale" in json.dumps(stale[-1])
