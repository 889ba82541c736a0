"""When a checkpoint or the disk goes wrong (issue #33), with real damage to real orbax
checkpoints of a real run: `--resume` continues from the newest intact step with one line
naming the damaged one, and continues exactly as the undamaged run did (lagged mode is
deterministic); `eval --step` of a damaged step exits 2 with one line; a deletion killed
midway leaves no half-deleted step; a full disk is one line, exit 74, and the previous
checkpoint resumes; a refused run leaves nothing behind."""

import dataclasses
import errno
import glob
import json
import os
import shutil

import jax.numpy as jnp
import pytest

from gac_jax.tasks import get_task
from gac_jax.train import build, checkpoint_faults
from gac_jax.train import checkpoint as checkpoint_lib
from gac_jax.train.checkpoint import CheckpointManager, DamagedCheckpointError
from gac_jax.train.cli import DISK_EXIT, main
from gac_jax.train.metrics import read_metrics

# Orbax reads a checkpoint's arrays as concurrent coroutines; when one read meets the
# damage, the others are dropped unfinished and Python reports each as an unraisable
# exception (166 warnings in one run), and a callback of theirs may land on the closed event
# loop ("Exception ignored in: None ... Event loop is closed"). The restore's failure itself
# is what the tests check.
pytestmark = [
    pytest.mark.filterwarnings(
        f"ignore:Exception ignored in. {what}:pytest.PytestUnraisableExceptionWarning"
    )
    for what in ("<coroutine object _read_array_index_and_device_put", "None")
]

TIMING = ("per_s", "seconds", "wait")
STEPS = 4
SMALL = [
    "task=arithmetic/add2",
    "init=random",
    f"steps={STEPS}",
    "eval_every=0",
    "checkpoint_every=1",
    f"keep_checkpoints={STEPS}",
    "rollout.mode=lagged",
    "rollout.lag=1",
    "rollout.groups_per_batch=2",
    "generation.group_size=2",
    "generation.prompt_length=12",
    "generation.max_new_tokens=5",
    "mesh.data=1",
]


def _comparable(records):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


def _err_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run with a checkpoint after every step (1..STEPS)."""
    out = tmp_path_factory.mktemp("damage") / "straight"
    with pytest.MonkeyPatch.context() as patch:
        _digit_rewards(patch)
        main(["train", "--set", *SMALL, "--out", str(out)])
    return out


def _digit_share(completion: str, example) -> float:
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def _digit_rewards(patch):
    """arithmetic/add2 rewarded by the share of digits (a random policy earns some, so the
    runs have gradients), as conftest's `digit_task`, for a module-scoped fixture."""
    fake = dataclasses.replace(get_task("arithmetic/add2"), reward=_digit_share)
    patch.setattr(build, "get_task", lambda name: fake)


def _truncate_data(step_dir):
    data = max(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)


def _delete_metadata(step_dir):
    shutil.rmtree(step_dir / "metadata")


def _delete_manifests(step_dir):
    for path in glob.glob(f"{step_dir}/state/**/manifest.ocdbt", recursive=True):
        os.remove(path)


def _garbage_json(step_dir):
    (step_dir / "metadata" / "metadata").write_text('{"next_step": 3, oops}')


def _half_deleted(step_dir):
    # What orbax's own deletion leaves when killed midway: metadata gone, the commit
    # marker kept, so the step is still listed.
    shutil.rmtree(step_dir / "metadata")
    shutil.rmtree(step_dir / "state" / "d", ignore_errors=True)


DAMAGES = [_truncate_data, _delete_metadata, _delete_manifests, _garbage_json, _half_deleted]


@pytest.fixture
def stopped_at_3(straight, tmp_path):
    """The straight run as if it had stopped after step 3: its step-4 checkpoint and
    step-4 record removed."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoints" / str(STEPS))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[: STEPS - 1]))
    return run


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
def test_resume_skips_a_damaged_step_and_continues_exactly(
    damage, straight, stopped_at_3, digit_task, capsys
):
    damage(stopped_at_3 / "checkpoints" / "3")
    capsys.readouterr()
    main(["train", "--out", str(stopped_at_3), "--resume"])
    err = _err_lines(capsys)
    damaged = [line for line in err if "is damaged" in line]
    assert len(damaged) == 1 and "checkpoint step 3 in " in damaged[0], err
    assert damaged[0].startswith("resume: ") and "; moved to .damaged-3-" in damaged[0]
    assert any(line.startswith("resume: continuing from the checkpoint of step 2") for line in err)
    a = read_metrics(straight / "metrics.jsonl")
    b = read_metrics(stopped_at_3 / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(STEPS))
    assert _comparable(a) == _comparable(b)
    assert len(list((stopped_at_3 / "checkpoints").glob(".damaged-3-*"))) == 1


@pytest.mark.slow
def test_eval_of_a_damaged_step_is_one_line_and_exit_2(straight, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    _truncate_data(run / "checkpoints" / "2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--checkpoint", str(run), "--step", "2", "--set", "eval_size=2"])
    *progress, err = _err_lines(capsys)
    assert exit_info.value.code == 2
    assert progress == [
        "eval: building the run (model, tokenizer, data) and loading the checkpoint"
    ]
    assert err.startswith("gac-jax eval: error: checkpoint step 2 in ") and "is damaged" in err
    assert len(err) < 500  # No tensorstore spec dump.


def test_resume_without_a_checkpoint_says_so(digit_task, tmp_path, capsys):
    run = tmp_path / "run"
    main(["train", "--set", *SMALL, "steps=1", "checkpoint_every=0", "--out", str(run)])
    shutil.rmtree(run / "checkpoints")
    capsys.readouterr()
    main(["train", "--out", str(run), "--resume"])
    err = _err_lines(capsys)
    assert any(line.startswith("resume: no checkpoint in ") for line in err), err
    assert len(read_metrics(run / "metrics.jsonl")) == 1


def test_a_full_disk_is_one_line_exit_74_and_the_previous_step_resumes(
    digit_task, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    real = shutil.disk_usage
    saves = []

    def fills_after_the_first_save(path):
        usage = real(path)
        return usage._replace(free=usage.free if not saves else 1000)

    original_save = CheckpointManager.save

    def counting_save(self, step, state, metadata=None):
        original_save(self, step, state, metadata)
        saves.append(step)

    monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", fills_after_the_first_save)
    monkeypatch.setattr(CheckpointManager, "save", counting_save)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--set", *SMALL, "--out", str(run)])
    err = _err_lines(capsys)
    assert exit_info.value.code == DISK_EXIT
    assert err[-1].startswith("gac-jax train: error: cannot write ")
    assert "No space left on device" in err[-1] and str(run / "checkpoints") in err[-1]
    assert not any("Traceback" in line for line in err), err
    assert saves == [1]
    monkeypatch.undo()
    _digit_rewards(monkeypatch)
    main(["train", "--out", str(run), "--resume"])
    err = _err_lines(capsys)
    assert any(line.startswith("resume: continuing from the checkpoint of step 1") for line in err)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(STEPS))


def test_tensorstores_out_of_space_error_is_found_in_its_message():
    error = ValueError("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']")
    assert checkpoint_faults.disk_errno(error) == errno.ENOSPC
    assert checkpoint_faults.disk_errno(ValueError("NOT_FOUND: [os_error_code='2']")) is None
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert checkpoint_faults.disk_errno(wrapped) == errno.EROFS


def _tree(scale):
    return {"a": jnp.arange(64.0) * scale, "b": {"c": jnp.ones(3) * scale}}


def test_restore_newest_names_each_damaged_step_and_falls_back(tmp_path):
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as checkpoints:
        for step in (1, 2, 3):
            checkpoints.save(step, _tree(step), {"next_step": step})
    _garbage_json(directory / "3")
    _delete_manifests(directory / "2")
    with CheckpointManager(directory, read_only=True) as checkpoints:
        with pytest.raises(DamagedCheckpointError, match="checkpoint step 3 in .* is damaged"):
            checkpoints.read_metadata(3)
        restored, skipped = checkpoints.restore_newest(lambda metadata: _tree(0))
    assert restored.step == 1 and restored.metadata == {"next_step": 1}
    assert float(restored.state["a"][1]) == 1.0
    assert [e.step for e in skipped] == [3, 2]
    assert all("\n" not in str(e) and len(str(e)) < 500 for e in skipped)
    _truncate_data(directory / "1")
    with CheckpointManager(directory, read_only=True) as checkpoints:
        with pytest.raises(FileNotFoundError, match="no intact checkpoint .*step 3: .*step 1: "):
            checkpoints.restore_newest(lambda metadata: _tree(0))


def test_a_deletion_killed_midway_leaves_no_listed_step(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory, max_to_keep=2) as checkpoints:
        checkpoints.save(1, _tree(1))
        checkpoints.save(2, _tree(2))

        real_rmtree = shutil.rmtree

        def killed_midway(path, ignore_errors=False):
            real_rmtree(os.path.join(path, "metadata"))  # Some files gone, then death.
            raise KeyboardInterrupt

        monkeypatch.setattr(checkpoint_lib.shutil, "rmtree", killed_midway)
        with pytest.raises(KeyboardInterrupt):
            checkpoints.save(3, _tree(3))
        monkeypatch.undo()
    leftovers = list(directory.glob(checkpoint_lib.DELETING_PREFIX + "*"))
    assert len(leftovers) == 1 and not (directory / "1").exists()
    with CheckpointManager(directory, read_only=True) as checkpoints:
        assert checkpoints.steps() == (2, 3)
    with CheckpointManager(directory, max_to_keep=2) as checkpoints:  # A writer tidies up.
        assert checkpoints.steps() == (2, 3)
    assert not list(directory.glob(checkpoint_lib.DELETING_PREFIX + "*"))


def test_a_refused_run_leaves_nothing_behind(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{not json\n')
    out = tmp_path / "run"
    argv = ["train", "--set", f"task=jsonl:{data}", *SMALL[1:], "steps=1", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert len(_err_lines(capsys)) == 1
    assert not out.exists()
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(argv)  # The same command, once the file is fixed, is not refused.
    assert len(read_metrics(out / "metrics.jsonl")) == 1


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (a tmpfs mounted read-only), where this machine allows
    mounting; as root, a chmod'ed directory would still be writable."""
    import subprocess

    path = tmp_path / "ro"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield path
    subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_output_directory_is_one_line_and_exit_74(digit_task, read_only_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--set", *SMALL, "--out", str(read_only_dir / "run")])
    err = _err_lines(capsys)
    assert exit_info.value.code == DISK_EXIT
    assert err[-1].startswith("gac-jax train: error: cannot write ") and "Read-only" in err[-1]
    assert not any("Traceback" in line for line in err), err
