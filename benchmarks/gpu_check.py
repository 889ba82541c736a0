"""Every figure of issue 61 in one call with a time budget: a profile of the one-GPU preset's
step, its learner's MFU, the sampler against its bandwidth roofline, the step's seconds and
its compiles, each against the issue's target.

    python benchmarks/gpu_check.py                # the preset, on whatever backend JAX finds
    python benchmarks/gpu_check.py --smoke        # a tiny Qwen3 on the CPU (a test runs it)

The preset (`qwen3_0_6b_gsm8k_1gpu`, or `--preset`) is built as `real_shapes.py` builds it
(random weights written as a Hugging Face checkpoint, GSM8K-shaped data, a compilation cache
of its own, empty), then, in this order, each part printed as it ends and the figures
rewritten to ``--out`` ``.json`` and ``.md`` after each (a call cut off keeps them):

  first step   `build_run` and `Run.step(0)` as `train` does: every program compiled, each
               one's seconds (tracing, lowering, XLA) and whether the cache served it,
               from `jax.monitoring`'s compile events;
  profile      step 1 under `jax.profiler.trace`, read back from its `.xplane.pb`
               (`trace_profile.read_device_ops`: JAX's own `ProfileData`) and summarised
               per program (the sampler's, the learner's) into matmuls, attention,
               elementwise/fusions, copies/transposes and collectives, with the gaps
               between device ops and the host's time between programs;
  steps        `--steps` more steps timed: the step (sampling + learner), the learner's
               seconds, tokens/s and MFU (PaLM's accounting, `learner.flops_per_token`, remat
               not counted) over the device's data-sheet peak (`accelerator.PEAKS`);
  sampler      `accelerator.bench_sampler` at batch 256 (prompts of 256, 128 new tokens)
               against its bandwidth roofline, and its compile;
  plan         `plan` of the same config after `jax.clear_caches()`: whether the persistent
               cache serves the run's learner step and sampler (it must: issue 61).

Each part checks the clock first and is skipped, saying so, when its estimate (from the
figures already measured) does not fit in what is left of `--budget`; a part that fails
prints its traceback and the others go on (the exit status is then 1). The last table
holds the issue's targets (MFU >= 40%, sampler >= 60% of its roofline, step <= 7 s, first
step's compiles <= 45 s, plan served by the cache) and each figure's pass or fail. On the
CPU (`--smoke`) the targets are an accelerator's; the smoke checks that every part runs.

Writes to ``$OUT/gpu_check`` where the device machine sets ``OUT``, else
``benchmarks/results/gpu_check``. The command for a lent GPU: `benchmarks/ACCELERATOR.md`,
"Prepared for the next lent GPU (issue 61)".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import real_shapes
import trace_profile
from accelerator import _commit, bench_sampler, decode_roofline, device_peaks, write_result

from gac_jax.train import get_preset
from gac_jax.train.run import build_run

TARGETS = dict(mfu=0.40, roofline=0.60, step_s=7.0, compile_s=45.0)
SAMPLER = dict(batches=(256,), prompt=256, new=128)
SMOKE_SAMPLER = dict(batches=(8,), prompt=16, new=8)
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}


class CompileLog:
    """This process's compiles, by section and program, from `jax.monitoring`'s events:
    seconds of tracing, lowering and XLA compile, and whether the persistent cache served
    the compile (its hit event comes inside the compile's duration)."""

    def __init__(self):
        self.section, self.records, self._hit = None, [], False
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_) -> None:
        self._hit |= event == "/jax/compilation_cache/cache_hits"

    def _duration(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        kind = _EVENTS.get(event)
        if kind is None or self.section is None:
            return
        name = fun_name.removeprefix("jit(").removesuffix(")")
        record = {"section": self.section, "program": name, "kind": kind, "s": seconds}
        if kind == "compile_s":
            record["cache"], self._hit = ("hit" if self._hit else "compiled"), False
        self.records.append(record)

    @contextlib.contextmanager
    def during(self, section: str):
        self.section = section
        try:
            yield
        finally:
            self.section = None

    def programs(self, section: str) -> list[dict]:
        """Per program of `section`: seconds of each kind, the cache's answer; the
        longest XLA compile first."""
        by_name: dict[str, dict] = {}
        for r in self.records:
            if r["section"] == section:
                p = by_name.setdefault(r["program"], dict.fromkeys(_EVENTS.values(), 0.0))
                p[r["kind"]] += r["s"]
                if "cache" in r:
                    p["cache"] = r["cache"]
        rows = [{"program": name, **p} for name, p in by_name.items()]
        return sorted(rows, key=lambda p: -p["compile_s"])


class Clock:
    """The call's time budget; `fits` says whether a part's estimate fits in what is left,
    and records and prints the skip when not."""

    def __init__(self, seconds: float, skipped: dict):
        self.end, self.skipped = time.monotonic() + seconds, skipped

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, part: str, needs: float) -> bool:
        if needs <= self.left():
            return True
        self.skipped[part] = f"needs about {needs:.0f} s, {max(self.left(), 0):.0f} s left"
        print(f"{part}: skipped, {self.skipped[part]}", flush=True)
        return False


def first_step(ctx) -> dict:
    """The preset's files written, its run built as `train` builds it, and its step 0,
    every compile recorded."""
    started = time.perf_counter()
    ctx.config, ctx.model_config = real_shapes.prepare(
        ctx.args.preset, ctx.args.steps + 1, ctx.args.smoke, ctx.work
    )
    prepared = time.perf_counter() - started
    started = time.perf_counter()
    ctx.run = build_run(ctx.config)
    ctx.run.start()
    built = time.perf_counter() - started
    with ctx.compiles.during("first step"):
        started = time.perf_counter()
        ctx.run.step(0)
        seconds = time.perf_counter() - started
    ctx.next_step = 1
    programs = ctx.compiles.programs("first step")
    longest = programs[0]["compile_s"] if programs else 0.0
    compiled = sum(p["compile_s"] for p in programs)
    traced = sum(p["trace_s"] + p["lower_s"] for p in programs)
    return {
        "prepare_s": prepared,
        "build_s": built,
        "step_s": seconds,
        "compile_s": compiled,
        "trace_lower_s": traced,
        "work_s": max(seconds - compiled - traced, 0.1 * seconds),  # A step without them.
        "programs": [p for p in programs if p["compile_s"] >= 0.05 * longest],
    }


def profile(ctx) -> dict:
    """Step 1 traced, its device ops by program and category."""
    with tempfile.TemporaryDirectory(dir=ctx.work) as trace_dir, ctx.compiles.during("steps"):
        with jax.profiler.trace(trace_dir):
            started = time.perf_counter()
            ctx.run.step(ctx.next_step)
            wall = time.perf_counter() - started
        started = time.perf_counter()
        ops, where = trace_profile.read_device_ops(trace_dir)
    ctx.next_step += 1
    summary = trace_profile.summarise_ops(ops, wall)
    summary["read_from"] = where
    summary["read_s"] = time.perf_counter() - started
    print(trace_profile.format_ops(summary), flush=True)
    return summary


def timed_steps(ctx, count: int) -> dict:
    """`count` more steps: `real_shapes.summarize`'s figures, with tokens/s and memory."""
    records, first = [], ctx.next_step
    with ctx.compiles.during("steps"):
        for step in range(first, first + count):
            records.append(ctx.run.step(step)[0])
            print(f"step {step}: {json.dumps(_step_figures(records[-1]))}", flush=True)
    result = real_shapes.summarize(ctx.config, ctx.model_config, float("nan"), records)
    rows, width = result["batch"]
    result["learner_tokens_per_s"] = rows * width / result["learner_seconds"]
    result["micro_batches"] = records[-1].get("micro_batches")
    result["measured_peak_gib"] = real_shapes.peak_bytes_in_use()
    # The preset's own sampling against its roofline: its slots decoding at once, with the
    # params as the sampler holds them.
    g, store = ctx.config.generation, ctx.run.store
    params = store.get(store.latest_version)
    slots = min(g.slots or ctx.config.batch_size, ctx.config.batch_size)
    context = g.prompt_length + g.max_new_tokens / 2
    roofline = decode_roofline(ctx.model_config, params, slots, context, ctx.bandwidth)
    result["sampling_fraction_of_roofline"] = result["generate_tokens_per_s"] / roofline
    result["sampling_weights_gib"] = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30
    result["recompiles"] = [p["program"] for p in ctx.compiles.programs("steps")]
    return result


def _step_figures(metrics: dict) -> dict:
    keys = ("wait_seconds", "train_seconds", "generated_tokens", "generate_tokens_per_s")
    return {k: metrics[k] for k in keys}


def sampler(ctx, scan_layers: bool = True) -> dict:
    """`accelerator.bench_sampler` at the issue's batch, with its compile recorded; with
    `scan_layers=False`, the unrolled layout (one KV cache a layer, the weights cut once
    before the decode loop instead of at every step: 1.2x faster on CPU), to choose the
    accelerator's decode layout by measurement."""
    shape = {"model": "tiny" if ctx.args.smoke else ctx.model_name, "remat": "full"}
    part = "sampler" if scan_layers else "sampler_unrolled"
    with ctx.compiles.during(part):
        (row,) = bench_sampler(
            ctx.decode, shape | {"scan_layers": scan_layers}, ctx.args.rounds, ctx.bandwidth
        )
    row["programs"] = ctx.compiles.programs(part)[:2]
    return row


def plan_cache(ctx) -> dict:
    """`plan` after the run, in-memory caches cleared: whether the persistent cache serves
    the run's learner step and sampler (step 0's two longest compiles), by name, and
    plan's own longest compiles besides."""
    jax.clear_caches()
    with ctx.compiles.during("plan"):
        figures = real_shapes.plan_figures(ctx.config)
    planned = {p["program"]: p for p in ctx.compiles.programs("plan")}
    names = [p["program"] for p in ctx.compiles.programs("first step")[:2]]
    absent = dict.fromkeys(_EVENTS.values(), 0.0) | {"cache": "not compiled by plan"}
    figures["programs"] = [planned.get(n, {"program": n, **absent}) for n in names]
    figures["others"] = [p for n, p in planned.items() if n not in names][:2]
    return figures


def estimates(result: dict, ctx) -> dict[str, float]:
    """Seconds each later part needs, from what step 0 measured: a step its work, a compile
    what step 0's longest cost (plan: one program recompiled at most, as on the H100)."""
    first = result["first_step"]
    compiles = [p["compile_s"] for p in first["programs"]] or [0.0]
    step = first["work_s"]
    sampled = step * ctx.decode["new"] / ctx.config.generation.max_new_tokens
    return {
        "profile": 2.5 * step + 10,
        "step": 1.2 * step,
        "sampler": max(compiles) + (ctx.args.rounds + 1) * sampled + 10,
        "plan": max(compiles) + first["build_s"] + 10,  # One program recompiled at most.
        # Unrolled, the sampler's compile grows with depth: twice the scan's, estimated.
        "sampler_unrolled": 2 * max(compiles) + (ctx.args.rounds + 1) * sampled + 10,
    }


def verdicts(result: dict) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, pass / FAIL / n/a) for each of the issue's targets."""
    steps, first = result.get("steps") or {}, result.get("first_step") or {}
    sampler = result.get("sampler") or {}
    roofline = sampler.get("fraction_of_roofline")
    served = (result.get("plan") or {}).get("programs")
    t = TARGETS

    def percent(v):
        return f"{100 * v:.1f}%"

    return [
        _verdict("learner MFU at the preset's shapes", steps.get("learner_mfu"), percent,
                 f">= {100 * t['mfu']:.0f}%", lambda v: v >= t["mfu"]),
        _verdict(f"{sampler.get('what', 'sampler')}: of its bandwidth roofline", roofline, percent,
                 f">= {100 * t['roofline']:.0f}%", lambda v: v >= t["roofline"]),
        _verdict("preset step (sampling + learner)", steps.get("step_seconds"),
                 lambda v: f"{v:.2f} s", f"<= {t['step_s']:.0f} s", lambda v: v <= t["step_s"]),
        _verdict("first step's XLA compiles, all programs", first.get("compile_s"),
                 lambda v: f"{v:.1f} s", f"<= {t['compile_s']:.0f} s",
                 lambda v: v <= t["compile_s"]),
        _verdict("plan served by the persistent cache", served,
                 lambda v: "; ".join(f"{p['program']} {p['cache']}" for p in v),
                 "both programs hit", lambda v: all(p["cache"] == "hit" for p in v)),
    ]  # fmt: skip


def _verdict(name: str, value, show, wanted: str, ok) -> tuple[str, str, str, str]:
    if value is None:
        return name, "not measured", wanted, "n/a"
    return name, show(value), wanted, "pass" if ok(value) else "FAIL"


def markdown(result: dict) -> str:
    lines = [
        f"Issue 61's figures on {result['device']} ({result['backend']}), peaks "
        f"{result['peak_source']}: {result['peak_flops'] / 1e12:.3g} TFLOP/s, "
        f"{result['bandwidth'] / 1e9:.3g} GB/s; commit {result['commit']}, "
        f"`{result['command']}`, {result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s "
        "budget.\n",
        "| figure | measured | target | verdict |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in verdicts(result)),
    ]
    first = result.get("first_step")
    if first:
        head = (
            f"First step: {first['step_s']:.1f} s (the run built in {first['build_s']:.1f} s "
            f"before it), XLA compiles {first['compile_s']:.1f} s, tracing and lowering "
            f"{first['trace_lower_s']:.1f} s; its programs:"
        )
        lines += ["", head, "", _programs(first["programs"])]
    if result.get("profile"):
        profiled = result["profile"]
        head = f"Profile of step 1 (ms; ops read from {profiled['read_from']}):"
        lines += ["", head, "", trace_profile.format_ops(profiled)]
    if result.get("steps"):
        lines += ["", _steps(result["steps"])]
    plan = result.get("plan")
    if plan:
        head = f"plan after the run: {plan['plan_seconds']:.1f} s; the run's programs, then plan's"
        lines += ["", head + " longest others:", "", _programs(plan["programs"] + plan["others"])]
    for part in ("sampler", "sampler_unrolled"):
        row = result.get(part)
        if row:
            lines.append(
                f"- {part}: {row['what']}: {row['tokens_per_s']:.0f} tokens/s, "
                f"{100 * row['fraction_of_roofline']:.1f}% of its roofline, first call's "
                f"compile {row['compile_s']:.1f} s"
            )
    for kind in ("skipped", "errors"):
        lines += [f"- {kind}: {part}: {why}" for part, why in result[kind].items()]
    return "\n".join(lines) + "\n"


def _steps(s: dict) -> str:
    rows, width = s["batch"]
    memory = s["measured_peak_gib"]
    return (
        f"| steps timed: {s['timed_steps']}, {rows} rows x {width} tokens | figure |\n|---|---|\n"
        f"| step (sampling + learner) | {s['step_seconds']:.2f} s |\n"
        f"| sampling | {s['generate_tokens_per_s']:.0f} generated tokens/s "
        f"({s['generated_tokens']:.0f} a step), {100 * s['sampling_fraction_of_roofline']:.1f}% "
        f"of its roofline ({s['sampling_weights_gib']:.3g} GiB of weights read a decode step) |\n"
        f"| learner | {s['learner_seconds']:.2f} s, {s['learner_tokens_per_s']:.0f} tokens/s, "
        f"MFU {100 * s['learner_mfu']:.1f}%, {s['micro_batches']:.0f} micro-batches |\n"
        f"| peak memory | {'not reported' if memory is None else f'{memory:.1f} GiB'} |\n"
        f"| recompiles in these steps | {', '.join(s['recompiles']) or 'none'} |"
    )


def _programs(programs: list[dict]) -> str:
    rows = ["| program | XLA compile s | trace s | lower s | cache |", "|---|---|---|---|---|"]
    for p in programs:
        rows.append(
            f"| {p['program']} | {p['compile_s']:.1f} | {p['trace_s']:.1f} | "
            f"{p['lower_s']:.1f} | {p.get('cache', '-')} |"
        )
    return "\n".join(rows)


class Context:
    """What the parts share: the arguments, the config, the run, the compile log."""

    def __init__(self, args, work: Path, bandwidth: float):
        self.args, self.work, self.bandwidth = args, work, bandwidth
        self.decode = SMOKE_SAMPLER if args.smoke else SAMPLER
        self.compiles = CompileLog()
        self.model_name = get_preset(args.preset, validate=False).model
        self.run = self.config = self.model_config = None
        self.next_step = 0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3_0_6b_gsm8k_1gpu", help="a one-GPU preset")
    parser.add_argument("--smoke", action="store_true", help="a tiny Qwen3, small shapes")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all parts")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the profile")
    parser.add_argument("--rounds", type=int, default=3, help="timed sampler calls")
    default_out = Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_check"
    parser.add_argument("--out", default=str(default_out), help="path stem")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps={args.steps}, --rounds={args.rounds}: expected at least 1 each")
    started = time.monotonic()
    result = {"skipped": {}, "errors": {}, "budget_s": args.budget}
    clock = Clock(args.budget, result["skipped"])
    if args.smoke:  # Its programs compile in under JAX's 1 s: cache them all the same.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    kind, peak, bandwidth, source = device_peaks()
    print(f"device {kind}: peak {peak / 1e12:.3g} TFLOP/s, {bandwidth / 1e9:.3g} GB/s ({source})")
    command = "python benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:])
    result.update(device=kind, backend=jax.default_backend(), peak_flops=peak)
    result.update(bandwidth=bandwidth, peak_source=source, commit=_commit(), command=command)

    def attempt(part: str, fn) -> None:
        try:
            result[part] = fn()
        except Exception as error:  # One part's failure leaves the others' figures.
            traceback.print_exc()
            result["errors"][part] = f"{type(error).__name__}: {error}".splitlines()[0]
        result["elapsed_s"] = time.monotonic() - started
        if part in result:
            print(f"{part}: {json.dumps(result[part], default=str)}", flush=True)
        write_result(Path(args.out), result, markdown(result), show=False)

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        ctx = Context(args, Path(work), bandwidth)
        attempt("first_step", lambda: first_step(ctx))
        needs = estimates(result, ctx) if "first_step" in result else {}
        if needs and clock.fits("profile", needs["profile"]):
            attempt("profile", lambda: profile(ctx))
        if needs:  # As many as fit before the sampler's part, at least one.
            spare = clock.left() - needs["sampler"]
            count = max(1, min(args.steps, int(spare // needs["step"])))
            if clock.fits("steps", needs["step"] * count):
                attempt("steps", lambda: timed_steps(ctx, count))
        if ctx.run is not None:  # Its memory freed for the sampler's.
            ctx.run.close()
            ctx.run = None
            gc.collect()
        if clock.fits("sampler", needs.get("sampler", 0.0)):
            attempt("sampler", lambda: sampler(ctx))
        if needs and clock.fits("plan", needs["plan"]):
            attempt("plan", lambda: plan_cache(ctx))
        if needs and clock.fits("sampler_unrolled", needs["sampler_unrolled"]):  # If it fits.
            attempt("sampler_unrolled", lambda: sampler(ctx, scan_layers=False))
    result["elapsed_s"] = time.monotonic() - started
    write_result(Path(args.out), result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)  # The figures of the other parts are written.
