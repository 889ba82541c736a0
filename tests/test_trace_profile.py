"""`benchmarks/trace_profile.py`: a call's time split into its compiled ops and the host's
time between them, read from a real `jax.profiler` trace and from synthetic events."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_profile  # noqa: E402

sys.path.pop(0)  # The benchmarks' other names (learner, sampler) stay off the path.

THREADS = {(1, 1): "tf_XLAPjRtCpuClient/7", (1, 2): "tf_XLAEigen/3", (1, 9): "python"}


def _event(tid, name, ts, dur):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_overlapping_xla_threads_count_once_and_the_rest_is_host_time():
    events = [
        _event(9, "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice", 0, 5),
        _event(1, "fusion.1", 10, 100),  # [10, 110)
        _event(2, "dot.2", 50, 100),  # [50, 150): overlaps, counted once
        _event(1, "ThunkExecutor::Execute", 10, 140),  # a wrapper: busy, not an op
        _event(9, "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice", 300, 5),
        _event(1, "fusion.1", 400, 60),  # [400, 460)
        _event(1, "end: fusion.1", 460, 1),
    ]
    # Two calls, 1 ms of wall time in all.
    p = trace_profile.summarise_trace(events, THREADS, calls=2, wall=1e-3)
    assert p.device == pytest.approx((140 + 61) * 1e-6 / 2)
    assert p.host == pytest.approx(0.5e-3 - p.device)
    assert p.launches == 1.0
    assert p.ops == [("fusion.1", pytest.approx(80e-6)), ("dot.2", pytest.approx(50e-6))]


def test_a_traced_call_is_one_launch_with_its_ops_inside_its_wall_time():
    @jax.jit
    def f(x):
        return jnp.tanh(x @ x.T).sum()

    x = jnp.ones((128, 128))
    f(x).block_until_ready()
    p = trace_profile.profile(lambda: f(x).block_until_ready(), calls=3)
    assert p.calls == 3 and p.launches == 1.0
    assert 0 < p.device <= p.wall and p.host == pytest.approx(p.wall - p.device)
    assert p.ops and all(s > 0 for _, s in p.ops)
    row = trace_profile.format_profile("f", p)
    assert row.startswith("| f | ") and row.count("|") == 7
