"""Where a call's time goes, from a `jax.profiler` trace: the compiled programs' ops and the
host's time between them (issue #44).

    from trace_profile import profile
    report = profile(lambda: step(), calls=3)   # after the call has compiled
    print(format_profile("gac_jax train", report))

The call runs `calls` times under `jax.profiler.trace(create_perfetto_trace=True)`; the
Chrome-format trace it writes is read back here. On XLA:CPU the compiled programs run on
threads named ``tf_XLA...`` (the client's and the intra-op pool's): their events are the
program's ops (fusions, dots, copies). Per call:

  wall      the call's wall time, as the caller sees it;
  device    the time at least one XLA thread was busy (the union of their events'
            intervals, so intra-op threads working at once count once);
  host      wall - device: Python, dispatch, argument handling, transfers and waits
            between the programs (a program's launch overhead included);
  launches  executables launched (`PjRtLoadedExecutable` executions);
  ops       the XLA threads' events by name, summed (overlapping intra-op events each
            count, so these may add up to more than `device`); runtime wrappers (names
            with ``::``) left out.

Nothing here is specific to a library: `vs_tunix.py --profile` runs it on both.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import tempfile
import time
from collections.abc import Callable

import jax

XLA_THREAD_PREFIX = "tf_XLA"
LAUNCH_EVENT = "ExecuteHelper"


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-call figures (seconds) and the ops' time per call, largest first."""

    calls: int
    wall: float
    device: float
    host: float
    launches: float
    ops: list[tuple[str, float]]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def read_trace(trace_dir: str) -> tuple[list[dict], dict]:
    """The trace's complete events and its thread names by (pid, tid)."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    return [e for e in events if e.get("ph") == "X"], threads


def summarise_trace(events: list[dict], threads: dict, calls: int, wall: float) -> Profile:
    """`events` (microseconds) of `calls` calls that took `wall` seconds in all."""
    busy, ops, launches = [], collections.Counter(), 0
    for e in events:
        thread = threads.get((e["pid"], e["tid"]), "")
        if thread.startswith(XLA_THREAD_PREFIX):
            busy.append((e["ts"], e["ts"] + e["dur"]))
            if "::" not in e["name"] and not e["name"].startswith("end: "):
                ops[e["name"]] += e["dur"]
        elif LAUNCH_EVENT in e["name"]:
            launches += 1
    device = _union_length(busy) * 1e-6 / calls
    return Profile(
        calls=calls,
        wall=wall / calls,
        device=device,
        host=wall / calls - device,
        launches=launches / calls,
        ops=[(name, us * 1e-6 / calls) for name, us in ops.most_common()],
    )


def profile(fn: Callable[[], object], calls: int = 3) -> Profile:
    """`fn` (already compiled; it must block until its results are ready) profiled over
    `calls` calls."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            wall = time.perf_counter() - start
        events, threads = read_trace(trace_dir)
    return summarise_trace(events, threads, calls, wall)


def format_profile(label: str, p: Profile, top: int = 5) -> str:
    ops = ", ".join(f"{name} {1e3 * s:.1f}" for name, s in p.ops[:top])
    return (
        f"| {label} | {1e3 * p.wall:.1f} | {1e3 * p.device:.1f} | {1e3 * p.host:.1f} "
        f"({100 * p.host / p.wall:.0f}%) | {p.launches:.1f} | {ops} |"
    )


TABLE_HEAD = (
    "| call | wall ms | device ms | host ms | launches | top ops (ms a call) |\n"
    "|---|---|---|---|---|---|"
)
