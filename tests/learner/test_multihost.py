"""Multi-process learning under `jax.distributed`: two local CPU processes, one global batch.

Each process runs `multihost_worker.py`, feeds its own rollout groups to
`GRPOLearner.step`, and saves the param shards it holds. The test checks that every
element held by both processes is bitwise identical, that the metrics agree, and that the
result equals one process (same mesh, same device count) training on the concatenation of
both processes' rows.
"""

from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")
LOCAL_DEVICES = 2
TIMEOUT_S = 150  # Whole run; the workers' own distributed timeouts are shorter.


def _load(path: Path):
    """(metric names, metrics [steps, M], {leaf: [(index slices, data)]}, {leaf: shape})."""
    with np.load(path) as f:
        data = dict(f)
    shapes = {k[: -len("/shape")]: tuple(v) for k, v in data.items() if k.endswith("/shape")}
    shards = {name: [] for name in shapes}
    for name in shapes:
        i = 0
        while f"{name}/{i}/index" in data:
            index = tuple(slice(a, b) for a, b in data[f"{name}/{i}/index"])
            shards[name].append((index, data[f"{name}/{i}/data"]))
            i += 1
    return list(data["metric_names"]), data["metrics"], shards, shapes


def _assemble(shards, shape):
    """A process's view of one leaf: values where it holds a shard (NaN elsewhere), and a mask."""
    value = np.full(shape, np.nan, np.float64)
    held = np.zeros(shape, bool)
    for index, data in shards:
        value[index] = data
        held[index] = True
    return value, held


@pytest.mark.slow
def test_two_processes_train_one_global_batch(tmp_path, run_processes, free_port):
    port = free_port
    # 4 global devices: "data" splits the batch across the processes (a pod's data
    # parallelism), "tensor" shards the params within each process.
    common = ["--local-devices", str(LOCAL_DEVICES), "--mesh", "2,1,2", "--steps", "3"]
    distributed = ["--num-processes", "2", "--port", str(port), "--timeout", "60"]
    worker = str(WORKER)
    run_processes(
        {
            "process0": [worker, "--out", "p0.npz", "--process-id", "0", *distributed, *common],
            "process1": [worker, "--out", "p1.npz", "--process-id", "1", *distributed, *common],
            # One process with all the devices, feeding the rows of both.
            "reference": [
                worker,
                "--out",
                "ref.npz",
                "--local-devices",
                str(2 * LOCAL_DEVICES),
                "--feeds",
                "2",
                *common[2:],
            ],
        },
        TIMEOUT_S,
    )
    names0, metrics0, shards0, shapes = _load(tmp_path / "p0.npz")
    names1, metrics1, shards1, shapes1 = _load(tmp_path / "p1.npz")
    names_ref, metrics_ref, shards_ref, shapes_ref = _load(tmp_path / "ref.npz")
    assert shapes == shapes1 == shapes_ref and len(shapes) > 10
    assert names0 == names1 == names_ref

    # Metrics are global: both processes report the same numbers, equal to the reference's.
    np.testing.assert_array_equal(metrics0, metrics1)
    np.testing.assert_allclose(metrics0, metrics_ref, rtol=1e-5, atol=1e-6)
    gap = names0.index("version_gap_mean")
    np.testing.assert_array_equal(metrics0[:, gap], [0.0, 1.0, 1.0])

    for name, shape in shapes.items():
        value0, held0 = _assemble(shards0[name], shape)
        value1, held1 = _assemble(shards1[name], shape)
        reference, held_ref = _assemble(shards_ref[name], shape)
        assert held_ref.all()
        # Data parallel across the processes: each holds a full replica of every param...
        assert held0.all() and held1.all(), name
        # ...and the replicas are identical, not merely close.
        np.testing.assert_array_equal(value0, value1, err_msg=name)
        np.testing.assert_allclose(value0, reference, rtol=1e-5, atol=1e-6, err_msg=name)
    # Every step moved the params: the comparisons are not between initial values.
    assert np.all(metrics0[:, names0.index("update_norm")] > 1e-3)
