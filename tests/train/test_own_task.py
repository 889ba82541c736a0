"""A researcher's own task through the CLI: a JSONL file (or a Hugging Face dataset saved to
disk) and a reward module written here, trained 3 steps; the logged reward is the module's
reward of the completions the learner got. And the README's "Bring your own task" commands
run as written (small sizes added)."""

import json
import pathlib
import re
import shlex
import shutil
import sys

import numpy as np
import pytest

from gac_jax import models
from gac_jax.models.tokenizers import decode_completion
from gac_jax.tasks import get_task
from gac_jax.train import run as run_lib
from gac_jax.train.cli import main
from gac_jax.train.metrics import read_metrics

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

SMALL = [
    "init=random",
    "steps=3",
    "eval_every=0",
    "checkpoint_every=0",
    "rollout.mode=sync",
    "rollout.groups_per_batch=2",
    "generation.group_size=3",
    "generation.prompt_length=24",
    "generation.max_new_tokens=6",
    "mesh.data=1",
]

# A reward that depends on the completion's length and on a field only the JSONL carries:
# a run that scored with anything else (the task's default, a constant, the wrong example)
# would log another mean.
REWARD_MODULE = """
def by_length(completion, example):
    right = 1.0 if example["answer"] in completion else 0.0
    return len(completion) / 7 + example["bonus"] + right
"""


ROWS = [
    {"prompt": f"{i}+{i}=", "answer": str(2 * i), "bonus": 0.1 * (i % 3), "system": "Add."}
    for i in range(12)
]


@pytest.fixture
def own_task(tmp_path, monkeypatch):
    """The task name of a JSONL file, and a reward module on sys.path."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "own_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"jsonl:{data}"
    sys.modules.pop("own_rewards", None)


@pytest.fixture(params=["jsonl", "hf"])
def any_own_task(request, own_task, tmp_path):
    """The JSONL task, or the same rows as a Hugging Face dataset saved to disk."""
    if request.param == "jsonl":
        return own_task
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    return f"hf:{tmp_path / 'saved'}"


def test_own_task_and_reward_module_train_through_the_cli(any_own_task, tmp_path, monkeypatch):
    captured = []

    def recording_collate(rollouts, prompt_length, *overlong):
        captured.append(list(rollouts))
        return collate(rollouts, prompt_length, *overlong)

    collate = run_lib.collate
    monkeypatch.setattr(run_lib, "collate", recording_collate)
    out = tmp_path / "run"
    argv = ["train", "--config", "countdown_sync", "--set", f"task={any_own_task}"]
    argv += ["reward=own_rewards:by_length", *SMALL, "--out", str(out)]
    assert main(argv) == 0

    import own_rewards

    train = get_task(any_own_task).data_source("train")
    tokenizer = models.CharTokenizer()  # init=random's tokenizer
    records = read_metrics(out / "metrics.jsonl")
    assert len(records) == len(captured) == 3
    for record, rollouts in zip(records, captured, strict=True):
        expected = [
            own_rewards.by_length(decode_completion(tokenizer, row[mask]), train[r.prompt_id])
            for r in rollouts
            for row, mask in zip(r.completion_tokens, r.completion_mask, strict=True)
        ]
        assert len(expected) == 6
        np.testing.assert_allclose(record["reward"], np.mean(expected), rtol=1e-6)
        # The rollouts carry the same rewards (so nothing rescored them differently).
        np.testing.assert_allclose(np.concatenate([r.rewards for r in rollouts]), expected, 1e-6)
    config = json.loads((out / "config.json").read_text())
    assert config["reward"] == "own_rewards:by_length"
    assert config["task"] == any_own_task


def test_a_bad_reward_path_fails_before_anything_is_built(own_task, tmp_path, capsys):
    argv = ["train", "--set", f"task={own_task}", "reward=own_rewards:nope", *SMALL]
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip().splitlines()
    assert "reward='own_rewards:nope': module 'own_rewards' has no attribute 'nope'" in err[-1]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_a_run_refused_before_its_first_step_leaves_nothing(own_task, tmp_path, capsys):
    out = tmp_path / "mine"
    argv = ["train", "--set", f"task={own_task}", *SMALL, "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--set", "generation.prompt_length=4"])  # Every prompt is longer.
    assert e.value.code == 2
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert "generation.prompt_length=4" in err and err.startswith("gac-jax train: error:"), err
    assert progress == ["step 0: compiling the sampler and making the first rollouts"]
    assert not out.exists()
    assert main(argv) == 0  # The retry is not refused as "already holds a run".
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


def _readme_commands():
    """The ``gac-jax`` commands of the README's "Bring your own task" section, as argv."""
    text = README.read_text()
    section = re.split(r"\n##+ ", text.split("### Bring your own task", 1)[1], maxsplit=1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and "=" in words[0]:  # PYTHONPATH=. and the like: set by the test
            words.pop(0)
        if words and words[0].endswith("gac-jax"):
            commands.append(words[1:])
    return block, commands


def test_the_readme_commands_run(tmp_path, monkeypatch):
    block, commands = _readme_commands()
    assert len(commands) == 2, block
    monkeypatch.chdir(tmp_path)
    # The repository's examples/ (its JSONL files and my_rewards.py), as the commands name them.
    shutil.copytree(README.parent / "examples", tmp_path / "examples")
    monkeypatch.syspath_prepend(str(tmp_path / "examples"))  # PYTHONPATH=examples
    # The README's own prompt length stands (SMALL's would override it).
    small = [x for x in SMALL if not x.startswith("generation.prompt_length=")]
    small += ["eval_every=3", "eval_size=2", "eval_samples=2"]
    try:
        for argv in commands:
            assert main([*argv, "--set", *small]) == 0
            out = tmp_path / argv[argv.index("--out") + 1]
            records = read_metrics(out / "metrics.jsonl")
            assert [r["step"] for r in records] == [0, 1, 2]
            assert "eval/greedy_accuracy" in records[-1]
    finally:
        sys.modules.pop("my_rewards", None)
