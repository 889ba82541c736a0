"""The real training loop over two `jax.distributed` processes, started by `gac-jax train`.

Each process samples its own share of every batch (on its own devices), the learner is one
SPMD program over both, and process 0 alone writes the run's files. Lagged and async mode,
with the Qwen3 presets' layout (`mesh.fsdp=-1`), which used to abort async runs with gloo's
"collective mismatch".
"""

from pathlib import Path

import numpy as np
import pytest

from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides, to_yaml
from gac_jax.train.metrics import read_metrics

WORKER = Path(__file__).with_name("multihost_train_worker.py")
STEPS = 3
GROUPS = 4  # Global groups per step: 2 from each process.


def _config(tmp_path, mode: str) -> Path:
    config = TrainConfig(task="arithmetic/add2", data_dir=str(tmp_path / "tfds"), init="random")
    config = apply_overrides(
        config,
        [
            f"steps={STEPS}",
            "eval_every=0",
            f"checkpoint_every={STEPS}",
            f"rollout.mode={mode}",
            "rollout.lag=1",
            f"rollout.groups_per_batch={GROUPS}",
            "buffer.max_staleness=1",
            "generation.group_size=2",
            "generation.prompt_length=12",
            "generation.max_new_tokens=4",
            "mesh.data=1",
            "mesh.fsdp=-1",
        ],
    )
    path = tmp_path / f"{mode}.yaml"
    path.write_text(to_yaml(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lagged", "async"])
def test_two_learner_processes_share_the_work(tmp_path, run_processes, free_port, mode):
    config, out, port = _config(tmp_path, mode), tmp_path / "run", free_port
    command = ["train", "--config", str(config), "--out", str(out)]
    distributed = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    run_processes(
        {
            f"process{i}": [
                str(WORKER),
                f"p{i}.npz",
                "--",
                *command,
                *distributed,
                "--process-id",
                str(i),
            ]
            for i in range(2)
        },
        timeout=240,
        local_devices=2,
    )
    p0, p1 = (np.load(tmp_path / f"p{i}.npz") for i in range(2))
    consumed0, consumed1 = p0["consumed"], p1["consumed"]
    # Each process trained on its own half of every batch: distinct groups, ids from its
    # own residue class (async) or its own half of each step's ids (lagged).
    assert len(consumed0) == len(consumed1) == STEPS * GROUPS // 2
    ids0, ids1 = set(consumed0[:, 0]), set(consumed1[:, 0])
    assert len(ids0) == len(consumed0) and not ids0 & ids1
    if mode == "async":
        assert {g % 2 for g in ids0} == {0} and {g % 2 for g in ids1} == {1}
    else:
        assert ids0 | ids1 == set(range(STEPS * GROUPS))
    # Prompts follow the group ids' shared order, so they differ too (within an epoch).
    assert not set(consumed0[:, 1]) & set(consumed1[:, 1])
    # Version tags mean the same on both: the step's gap is within the bound everywhere.
    for consumed in (consumed0, consumed1):
        steps = np.repeat(np.arange(STEPS), GROUPS // 2)
        assert np.all(steps - consumed[:, 2] <= 1) and np.all(consumed[:, 2] <= steps)
    # One metrics.jsonl (process 0's), one record per step, and a checkpoint of the run.
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(STEPS))
    assert (out / "config.json").is_file() and (out / "plot.png").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [str(STEPS)]
    # Identical params on both processes, and training moved them.
    leaves = [k for k in p0.files if k.startswith("param_")]
    assert len(leaves) > 10
    for name in leaves:
        np.testing.assert_array_equal(p0[name], p1[name], err_msg=name)
    records = read_metrics(out / "metrics.jsonl")
    assert any(r["update_norm"] > 0 for r in records)
