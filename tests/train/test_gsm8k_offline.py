"""GSM8K from the CLI offline: with the release files in the documented place (tfds's
manual directory of ``data_dir``) a run trains; without them the CLI fails at once with one
line naming that place, and never tries a download.

The files here are a few problems written in the release format (one JSON object a line,
``question`` and ``answer`` ending in ``#### N``), so the test needs no shared data.
"""

import json
import socket
import time
from pathlib import Path

import pytest
import tensorflow_datasets as tfds

from gac_jax.tasks.builders import Gsm8k
from gac_jax.tasks.gsm8k import gsm8k_manual_dir, require_gsm8k_offline
from gac_jax.train.cli import main
from gac_jax.train.metrics import read_metrics


def _problem(question: str, steps: str, answer: str) -> dict:
    return {"question": question, "answer": f"{steps}\n#### {answer}"}


TRAIN = [
    _problem(
        f"Tom has {a} apples and buys {b} more. How many apples?",
        f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}",
        str(a + b),
    )
    for a, b in [(3, 4), (5, 2), (7, 8), (1, 9), (6, 6), (2, 3)]
]
TEST = [
    _problem("Ann reads 12 pages a day for 3 days. How many pages?", "12*3=<<12*3=36>>36", "36"),
    _problem(
        "A box holds 1,200 nails; 200 are used. How many are left?",
        "1200-200=<<1200-200=1000>>1000",
        "1,000",
    ),
]

SMALL = [
    "task=gsm8k",
    "init=random",
    "steps=2",
    "eval_every=0",
    "checkpoint_every=0",
    "rollout.mode=sync",
    "rollout.groups_per_batch=2",
    "generation.group_size=2",
    "generation.prompt_length=80",
    "generation.max_new_tokens=4",
    "mesh.data=1",
]


def _write_release_files(directory):
    directory.mkdir(parents=True)
    for name, rows in (("train.jsonl", TRAIN), ("test.jsonl", TEST)):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _refuse(*args, **kwargs):
    raise OSError("network access is disabled in this test")


@pytest.fixture
def no_network(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", _refuse)
    monkeypatch.setattr(socket.socket, "connect", _refuse)


@pytest.fixture
def downloads(monkeypatch):
    """Records every download tfds attempts (and fails it at once)."""
    attempts = []

    def record(self, *args, **kwargs):
        attempts.append(args)
        raise OSError("no download in this test")

    monkeypatch.setattr(tfds.download.DownloadManager, "download_and_extract", record)
    monkeypatch.setattr(tfds.download.DownloadManager, "download", record)
    return attempts


def test_the_documented_place_is_tfds_manual_dir(tmp_path):
    assert gsm8k_manual_dir(tmp_path) == tmp_path / "downloads" / "manual"


def test_release_files_in_the_manual_dir_train_two_steps(tmp_path, no_network, downloads):
    data_dir = tmp_path / "tfds"
    _write_release_files(data_dir / "downloads" / "manual")
    out = tmp_path / "run"
    argv = ["train", "--config", "countdown_sync", "--out", str(out)]
    assert main([*argv, "--set", *SMALL, f"data_dir={data_dir}"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    assert downloads == []
    # Prepared from these very files: their split sizes and the first test problem.
    builder = Gsm8k(data_dir=data_dir)
    assert builder.info.splits["train"].num_examples == len(TRAIN)
    assert builder.info.splits["test"].num_examples == len(TEST)
    questions = {ex["question"].decode() for ex in builder.as_data_source(split="test")}
    assert questions == {p["question"] for p in TEST}
    # Once prepared, the release files are no longer needed.
    for name in ("train.jsonl", "test.jsonl"):
        (data_dir / "downloads" / "manual" / name).unlink()
    require_gsm8k_offline(data_dir)


@pytest.mark.parametrize("present", [(), ("train.jsonl",)])
def test_without_the_files_the_cli_fails_at_once_with_one_line(
    tmp_path, capsys, downloads, present
):
    data_dir = tmp_path / "tfds"
    manual = data_dir / "downloads" / "manual"
    manual.mkdir(parents=True)
    for name in present:
        (manual / name).write_text(json.dumps(TRAIN[0]) + "\n")
    argv = ["train", "--config", "countdown_sync", "--out", str(tmp_path / "run")]
    start = time.monotonic()
    status = main([*argv, "--set", *SMALL, f"data_dir={data_dir}"])
    elapsed = time.monotonic() - start
    assert status == 2  # A data error, as the README says.
    assert elapsed < 5.0
    assert downloads == []
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert err.startswith("gac-jax train: error: task=gsm8k: ")
    assert f"not in {manual}:" in err
    assert "test.jsonl is not in" in err if present else "train.jsonl and test.jsonl are" in err
    assert not (tmp_path / "run").exists()


def test_the_readme_names_that_place():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("**3. Data.**", 1)[1].split("\n\n", 1)[0]
    assert "`DATA_DIR/downloads/manual/`" in section
    assert "`~/tensorflow_datasets/downloads/manual/`" in section
