"""The README's command blocks that no other test follows, run as written with `--set`
shrinking each run: the quick tour's (presets, show-config, a run, the evaluation of its
checkpoint, its resume) and "Scaling out"'s first two layouts (one host, shared devices;
one host, split devices, on the 8 fake devices with a tiny Qwen3 where the README has
`/path/to/Qwen3-0.6B`). The third layout (Ray workers and several learner hosts) needs a
Ray cluster and a coordinator: its two halves run in tests/train/test_multihost_loop.py
and tests/train/test_async_backends.py. "Bring your own task", "Multi-turn and tools" and
"Train a real model" have their own tests (test_own_task.py, test_multiturn.py,
test_real_model_readme.py)."""

import json
import re
import shlex
from pathlib import Path

import pytest

from gac_jax.train.cli import main
from gac_jax.train.metrics import read_metrics
from tests.train.test_gsm8k_offline import _write_release_files
from tests.train.test_real_model_readme import _tiny_qwen3

README = Path(__file__).resolve().parents[2] / "README.md"

SHRINK = [
    "steps=2",
    "eval_every=2",
    "eval_size=2",
    "eval_samples=2",
    "checkpoint_every=2",
    "rollout.groups_per_batch=4",  # 8 rows: one a fake device.
    "rollout.groups_per_call=2",
    "generation.group_size=2",
    "generation.max_new_tokens=6",
]


def _commands(heading: str) -> list[list[str]]:
    """The `gac-jax` commands of the bash blocks under `heading` (up to the next heading
    of level 2 or more: a bash comment starts with one #), as argv, in order."""
    section = re.split(r"\n##+ ", README.read_text().split(heading, 1)[1], maxsplit=1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)  # RAY_ADDRESS=auto and the like.
            if words and words[0].endswith("gac-jax"):
                commands.append(words[1:])
    return commands


@pytest.mark.slow
def test_the_quick_tours_commands_run(tmp_path, monkeypatch, capsys):
    commands = _commands("### 4. Training runs")
    assert [c[0] for c in commands] == ["presets", "show-config", "train", "eval", "train"]
    monkeypatch.chdir(tmp_path)
    presets, show, train, evaluate, resume = commands
    assert main(presets) == 0 and "demo" in capsys.readouterr().out
    assert main(show) == 0 and "lag: 8" in capsys.readouterr().out
    assert main([*train, "--set", *SHRINK]) == 0
    run = tmp_path / train[train.index("--out") + 1]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert json.loads((run / "config.json").read_text())["loss"]["advantage"] == "vcpo"
    # Its last checkpoint is step 2 (the README's 200 is the full run's).
    evaluate[evaluate.index("--step") + 1] = "2"
    capsys.readouterr()
    assert main(evaluate) == 0
    assert json.loads(capsys.readouterr().out)["eval/pass@1"] == records[-1]["eval/pass@1"]
    # The resume with the README's own --set, its steps shrunk: two more steps.
    resume[resume.index("steps=600")] = "steps=4"
    assert main(resume) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow
def test_the_scaling_out_layouts_on_one_host_run(tmp_path, monkeypatch):
    commands = _commands("## Scaling out")
    assert [c[0] for c in commands] == ["train", "train", "train"], commands
    shared, split, _hosts = commands
    monkeypatch.chdir(tmp_path)
    assert main([*shared, "--set", *SHRINK]) == 0
    assert len(read_metrics(tmp_path / "runs" / "shared" / "metrics.jsonl")) == 2
    checkpoint = tmp_path / "Qwen3-0.6B"
    _tiny_qwen3(checkpoint)
    _write_release_files(tmp_path / "tfds" / "downloads" / "manual")
    split = [f"init={checkpoint}" if w == "init=/path/to/Qwen3-0.6B" else w for w in split]
    assert f"init={checkpoint}" in split
    # The learner's 6 devices (2 go to sampling) take 12 rows, in 2 micro-batches (the
    # preset's 16 are for its 256 rows); the tiny Qwen3's tokens are short pieces, so a
    # GSM8K prompt needs more than the preset's 256.
    small = [
        *SHRINK,
        "rollout.groups_per_batch=6",
        "learner.micro_batches=2",
        "generation.prompt_length=384",
    ]
    assert main([*split, "--set", *small, f"data_dir={tmp_path / 'tfds'}", "model=tiny"]) == 0
    records = read_metrics(tmp_path / "runs" / "split" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and "eval/pass@1" in records[-1]
