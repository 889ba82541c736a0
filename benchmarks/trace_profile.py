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

On any backend, `read_device_ops` reads a trace's `.xplane.pb` with what JAX ships
(`jax.profiler.ProfileData`, no TensorBoard plugin) into the device's ops (a GPU's kernels
and copies on its streams, a TPU's "XLA Ops", XLA:CPU's thunks), each with its HLO op and
program, and `summarise_ops` splits their time into `CATEGORIES` by program, with the host's
gaps (`gpu_check.py`'s profile).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import re
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


# A device op's category, by substrings of its kernel and HLO op names (lower case), the
# first that matches; everything else is "elementwise/fusions". Attention counts softmax
# (the vocabulary head's log-softmax too, where XLA names it so); "ynn" is XLA:CPU's
# YNNPACK fusions, its dots.
CATEGORIES = (
    ("collectives", ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather",
                     "all_gather", "reduce-scatter", "reduce_scatter", "collective",
                     "all-to-all", "alltoall")),
    ("attention", ("fmha", "sdpa", "flash", "attention", "softmax")),
    ("matmuls", ("gemm", "cublas", "nvjet", "xmma", "cutlass", "dot", "matmul",
                 "convolution", "ynn")),
    ("copies/transposes", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice",
                           "dynamic_update_slice", "dynamic-slice", "dynamic_slice",
                           "concatenate", "gather", "scatter")),
)  # fmt: skip
OTHER = "elementwise/fusions"
CATEGORY_NAMES = (*(name for name, _ in CATEGORIES), OTHER)


def categorise(*names: str) -> str:
    text = " ".join(names).lower()
    for category, keys in CATEGORIES:
        if any(key in text for key in keys):
            return category
    return OTHER


@dataclasses.dataclass(frozen=True)
class DeviceOp:
    name: str  # The kernel's (GPU), else the HLO op's.
    hlo_op: str
    program: str  # The HLO module, "unknown" where the trace does not say.
    start_ns: float
    duration_ns: float


def _annotated(stats: dict, field: str) -> str:
    """`field` of an event's stats, or of its XLA annotation ("...#hlo_op=x,hlo_module=y#")."""
    if stats.get(field):
        return str(stats[field])
    found = re.search(rf"{field}=([^,#]+)", str(stats.get("annotation", "")))
    return found.group(1) if found else ""


def _op_lines(plane):
    """A device plane's lines of ops: a GPU's streams (kernels, copies), else a TPU's
    "XLA Ops"; the host's XLA threads on XLA:CPU."""
    lines = list(plane.lines)
    if plane.name.startswith("/device:"):
        return [x for x in lines if x.name.startswith("Stream")] or [
            x for x in lines if x.name == "XLA Ops"
        ]
    return [x for x in lines if x.name.startswith(XLA_THREAD_PREFIX)]


def read_device_ops(trace_dir: str) -> tuple[list[DeviceOp], str]:
    """The device ops of the `.xplane.pb` under `trace_dir`, and where they were read: the
    device planes' where there are any (a GPU's host threads launch, they do not compute),
    else XLA:CPU's thunks (the events with an HLO op: runtime wrappers have none)."""
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    by_kind: dict[bool, list[DeviceOp]] = {True: [], False: []}
    planes: dict[bool, set[str]] = {True: set(), False: set()}
    for plane in data.planes:
        device = plane.name.startswith("/device:")
        if not device and plane.name != "/host:CPU":
            continue
        for line in _op_lines(plane):
            ops = _leaf_ops(line, device)
            by_kind[device] += ops
            where = f" {line.name.split('(')[0]}" if device else " XLA threads"
            planes[device].update([plane.name + where] if ops else [])
    device = bool(by_kind[True])
    return by_kind[device], ", ".join(sorted(planes[device])) or "no device op in the trace"


def _leaf_ops(line, device: bool) -> list[DeviceOp]:
    """A line's ops; on the host, less those that hold the next one (XLA:CPU's `while`
    around its body's ops: their time is their ops'). A GPU stream's kernels may overlap a
    little (programmatic dependent launch), and none holds another."""
    ops = []
    for e in line.events:
        stats = dict(e.stats)
        hlo_op = _annotated(stats, "hlo_op")
        if device or hlo_op:
            program = _annotated(stats, "hlo_module") or "unknown"
            ops.append(DeviceOp(e.name, hlo_op or e.name, program, e.start_ns, e.duration_ns))
    if device or not ops:
        return ops
    ops.sort(key=lambda o: o.start_ns)
    starts = [o.start_ns for o in ops[1:]] + [float("inf")]
    return [o for o, start in zip(ops, starts, strict=True) if start >= o.start_ns + o.duration_ns]


def _busy_ms(ops: list[DeviceOp]) -> float:
    return _union_length([(o.start_ns, o.start_ns + o.duration_ns) for o in ops]) * 1e-6


def summarise_ops(ops: list[DeviceOp], wall_s: float, top: int = 12) -> dict:
    """`ops` of a traced call that took `wall_s` seconds: per program its device time (the
    union of its ops), its span (first op to last), the gaps inside it (span - device: on a
    GPU, launches and host syncs between kernels) and its ops' ms by category; over all,
    device ms, the host's gaps (wall - device), category shares of the ops' time, and the
    ops that take most time (by HLO op, summed over a loop's iterations)."""
    programs = {}
    for program in sorted({o.program for o in ops}):
        mine = [o for o in ops if o.program == program]
        span = 1e-6 * (
            max(o.start_ns + o.duration_ns for o in mine) - min(o.start_ns for o in mine)
        )
        busy = _busy_ms(mine)
        programs[program] = {
            "ops": len(mine),
            "device_ms": busy,
            "span_ms": span,
            "gaps_inside_ms": span - busy,
            "categories_ms": _by_category(mine),
        }
    device = _busy_ms(ops)
    per_op, example = collections.Counter(), {}
    for o in ops:
        per_op[o.hlo_op] += o.duration_ns * 1e-6
        example.setdefault(o.hlo_op, o.name)
    categories = _by_category(ops)
    total = sum(categories.values()) or 1.0
    return {
        "wall_ms": 1e3 * wall_s,
        "device_ms": device,
        "host_gaps_ms": 1e3 * wall_s - device,
        "categories_ms": categories,
        "categories_share": {k: v / total for k, v in categories.items()},
        "programs": programs,
        "top_ops": [
            {"hlo_op": op, "kernel": example[op], "ms": ms, "category": categorise(example[op], op)}
            for op, ms in per_op.most_common(top)
        ],
    }


def _by_category(ops: list[DeviceOp]) -> dict[str, float]:
    ms = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for o in ops:
        ms[categorise(o.name, o.hlo_op)] += o.duration_ns * 1e-6
    return ms


def format_ops(summary: dict) -> str:
    """`summarise_ops`' figures as Markdown: a row per program, the whole, the top ops."""
    head = "| program | ops | device ms | span ms | gaps inside ms | " + " | ".join(CATEGORY_NAMES)
    lines = [head + " |", "|---" * (5 + len(CATEGORY_NAMES)) + "|"]
    for name, p in summary["programs"].items():
        cells = [f"{p['categories_ms'][c]:.1f}" for c in CATEGORY_NAMES]
        lines.append(
            f"| {name} | {p['ops']} | {p['device_ms']:.1f} | {p['span_ms']:.1f} | "
            f"{p['gaps_inside_ms']:.1f} | " + " | ".join(cells) + " |"
        )
    shares = summary["categories_share"]
    cells = [f"{summary['categories_ms'][c]:.1f} ({100 * shares[c]:.0f}%)" for c in CATEGORY_NAMES]
    lines.append(
        f"| all (wall {summary['wall_ms']:.1f} ms; host gaps {summary['host_gaps_ms']:.1f} ms, "
        f"{100 * summary['host_gaps_ms'] / max(summary['wall_ms'], 1e-9):.0f}% of wall) | "
        f"{sum(p['ops'] for p in summary['programs'].values())} | {summary['device_ms']:.1f} "
        "| | | " + " | ".join(cells) + " |"
    )
    tops = "; ".join(
        f"{t['hlo_op']} {t['ms']:.1f} ms ({t['category']}"
        + (f", {t['kernel'][:48]})" if t["kernel"] != t["hlo_op"] else ")")
        for t in summary["top_ops"]
    )
    return "\n".join(lines) + f"\n\nTop ops: {tops}.\n"
