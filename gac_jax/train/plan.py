"""`gac-jax plan`: will a run fit? Compile its learner step and sampler ahead of time.

The run is the one `train` would build (`build_run(config, abstract=True)`: LoRA, split
devices and all), with abstract arrays (`nnx.eval_shape`: no weight is created or loaded,
so a 1.7B-parameter layout is checked on a laptop, on fake CPU devices); the learner step
is lowered on the learner's mesh and the sampler on the sampler's devices, and compiled;
XLA's memory and cost analyses then give, per device, the bytes of the arguments (params,
optimizer state, batch), the outputs, the temporaries and what donation aliases, and the
FLOPs. Peak = arguments + outputs - aliased + temporaries.

XLA's cost analysis counts a loop's body once: the learner's FLOPs are that count times
the micro-batches (the step's loop), per device; the sampler's are its prefill and one
decode step (`tflops_loop_bodies_once`), not a whole generation.

`extrapolate=True` compiles the learner step at 2, 3 and 4 decoder layers instead of the
model's own count and extends the line through them: with every layer alike, its memory
and FLOPs are affine in the layers. It checks the line on the third point and refuses when
it does not hold. The sampler is compiled whole: XLA:CPU's buffer assignment for its decode
loop is not affine in the layers. The learner step is most of a plan's compile time
(measurements of both: README, "Will it fit?").

The figures are those of the backend that compiled them: on fake CPU devices, XLA's CPU
buffer assignment, which schedules for speed rather than memory and so over-states what
a GPU or TPU compile needs (it is an upper bound to check a layout against, not a
measurement of the accelerator).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gac_jax.learner import GRPOLearner, TrainBatch
from gac_jax.train.build import model_config
from gac_jax.train.config import TrainConfig
from gac_jax.train.run import Run, build_run

GIB = 2**30
# `plan` compiles and never runs: on XLA:CPU, LLVM's optimisations only cost time. Without
# them the figures are the same (buffer assignment and the cost analysis come before code
# generation; every field of a calculator plan compared equal) and a compile takes about
# 0.6 of the time (37 -> 23 s of CPU for that plan).
CHEAP_CPU_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)


def with_cheap_cpu_compiles(xla_flags: str) -> str:
    """`xla_flags` (an `XLA_FLAGS` value) with `CHEAP_CPU_COMPILE_FLAGS` added, except any
    the caller already set (to any value). Takes effect only before JAX's CPU backend starts."""
    flags = xla_flags.split()
    named = {flag.split("=", 1)[0] for flag in flags}
    flags += [f for f in CHEAP_CPU_COMPILE_FLAGS if f.split("=", 1)[0] not in named]
    return " ".join(flags)


Progress = Callable[[str], None]  # Says what `plan` does as it goes (one line each).


def _quiet(text: str) -> None:
    del text


@contextlib.contextmanager
def _said(progress: Progress, what: str, detail: str = ""):
    """Says `what` starts (with `detail`), and its time once done."""
    progress(f"{what}{detail}...")
    started = time.monotonic()
    yield
    progress(f"{what}: done in {time.monotonic() - started:.1f} s")


def _memory(compiled) -> dict[str, Any]:
    """Per-device memory of `compiled`, and XLA's FLOP count (loop bodies counted once)."""
    m = compiled.memory_analysis()
    parts = ("argument", "output", "alias", "temp")
    sizes = {f"{part}_gib": getattr(m, f"{part}_size_in_bytes") / GIB for part in parts}
    peak = sizes["argument_gib"] + sizes["output_gib"] - sizes["alias_gib"] + sizes["temp_gib"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", float("nan"))) / 1e12
    return {"peak_gib": peak, **sizes, "tflops_loop_bodies_once": flops}


def _bytes_per_device(tree) -> float:
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize
    return total / GIB


def _abstract_batch(learner: GRPOLearner, rows: int, width: int) -> TrainBatch:
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=learner.batch_sharding)
    per_token = [spec((rows, width), t) for t in (jnp.int32, bool, bool, jnp.float32)]
    return TrainBatch(*per_token, *(spec((rows,), t) for t in (jnp.float32, jnp.int32, jnp.int32)))


def plan_learner(
    config: TrainConfig, learner: GRPOLearner, progress: Progress = _quiet, name: str = ""
) -> dict[str, Any]:
    """The learner step at the run's batch and full width (the widest batch it can get);
    `name` tells `progress` which model it is."""
    rows = config.batch_size
    width = config.generation.prompt_length + config.generation.max_new_tokens
    micro_batches = learner.micro_batching.count(rows, width)
    batch = _abstract_batch(learner, rows, width)
    step = learner.step_for(micro_batches)
    detail = f" ({rows} x {width} tokens in {micro_batches} micro-batch(es))"
    with _said(progress, f"compiling the learner step{name}", detail):
        lowered = learner.lower(batch, np.int32(0), learner.reference, step=step)
        memory = _memory(lowered.compile())
    # One micro-batch's FLOPs (the loop's body) times the micro-batches and the optimizer
    # steps per batch: the whole step (the batch's reference and proximal passes aside).
    updates = learner.config.updates_per_batch
    per_step = memory.pop("tflops_loop_bodies_once") * micro_batches * updates
    return {
        "batch": [rows, width],
        "micro_batches": micro_batches,
        **memory,
        "tflops_per_step": per_step,
        "params_gib": _bytes_per_device(learner.params),
        "optimizer_gib": _bytes_per_device(learner.opt_state),
    }


def plan_sampler(config: TrainConfig, run: Run, progress: Progress = _quiet) -> dict[str, Any]:
    """One rollout call: `groups_per_call` groups of `group_size` rows (async mode), or a
    step's groups (sync and lagged), on the sampler's devices."""
    g, rollout = config.generation, config.rollout
    groups = rollout.groups_per_call if rollout.mode == "async" else rollout.groups_per_batch
    rows = groups * g.group_size
    params = run.placement.abstract_rollout(run.policy.like())
    # As `place_inputs` places them: None in the shared layout, where the run passes the
    # prompts uncommitted and the compiler places them with the params.
    spec = functools.partial(jax.ShapeDtypeStruct, sharding=run.placement.input_sharding(rows))
    key = jax.eval_shape(lambda: jax.random.key(0))
    detail = f" ({rows} rows of {g.prompt_length} + {g.max_new_tokens} tokens)"
    with _said(progress, "compiling the sampler", detail):
        prompts = [spec((rows, g.prompt_length), dtype) for dtype in (jnp.int32, bool)]
        lowered = run.sampler.lower(run.policy.graphdef, params, *prompts, key)
        memory = _memory(lowered.compile())
    return {"rows": rows, "slots": g.slots, **memory}


# The layer counts at which `extrapolate` compiles the learner step: the line through the
# last two, checked on the first (a figure may be off the line by 1% or 1 MiB).
PROBE_LAYERS = (2, 3, 4)
AFFINE_RELATIVE, AFFINE_ABSOLUTE = 0.01, 2**-10


def extrapolate_layers(probes: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    """`probes` (`plan_learner`'s reports at `PROBE_LAYERS`) extended to `layers` layers:
    each float on the line through the last two probes, after checking that the first
    lies on it; every other field equal in all probes. Raises ValueError otherwise."""
    (x0, x1, x2), (p0, p1, p2) = PROBE_LAYERS, probes
    out: dict[str, Any] = {}
    for name, value in p2.items():
        if not isinstance(value, float):
            if not p0[name] == p1[name] == value:
                raise ValueError(
                    f"plan --extrapolate: the learner's {name} changes with the layers "
                    f"({p0[name]}, {p1[name]}, {value} at {x0}, {x1}, {x2}); plan without it."
                )
            out[name] = value
            continue
        slope = (value - p1[name]) / (x2 - x1)
        off_line = abs(p1[name] - slope * (x1 - x0) - p0[name])
        if off_line > max(AFFINE_RELATIVE * abs(p0[name]), AFFINE_ABSOLUTE):
            raise ValueError(
                f"plan --extrapolate: the learner's {name} is not affine in the layers "
                f"({p0[name]:.4f}, {p1[name]:.4f}, {value:.4f} at {x0}, {x1}, {x2}); "
                "plan without it."
            )
        out[name] = value + slope * (layers - x2)
    return {**out, "extrapolated_from_layers": list(PROBE_LAYERS)}


def plan(
    config: TrainConfig,
    device_memory_gib: float = 80.0,
    extrapolate: bool = False,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Compiles the run's learner step and sampler from abstract arrays; returns their
    per-device memory and FLOPs and whether both fit in `device_memory_gib`.
    `extrapolate`: the learner step from compiles at 2, 3 and 4 layers (see above); a
    model of at most 4 layers is compiled whole. `progress` is told each part as it starts
    and its time when done."""
    with _said(progress, "building the run", " from abstract arrays (no weights)"):
        run = build_run(config, abstract=True)
    learner = run.learner
    mesh = learner.mesh
    layers = model_config(config).num_layers
    if extrapolate and layers > PROBE_LAYERS[-1]:
        probes = [
            plan_learner(config, build_run(config, abstract=True, num_layers=n).learner,
                         progress, f" of {n} layers")
            for n in PROBE_LAYERS
        ]  # fmt: skip
        learner_report = extrapolate_layers(probes, layers)
    else:
        learner_report = plan_learner(config, learner, progress)
    report = {
        "devices": int(mesh.devices.size),
        "rollout_devices": len(run.placement.devices) if not run.placement.shared else 0,
        "mesh": dict(mesh.shape),
        "platform": mesh.devices.flat[0].platform,
        "parameters": int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(learner.params))),
        "learner": learner_report,
        "sampler": plan_sampler(config, run, progress),
        "device_memory_gib": device_memory_gib,
    }
    peaks = {name: report[name]["peak_gib"] for name in ("learner", "sampler")}
    report["fits"] = all(p <= device_memory_gib for p in peaks.values())
    report["verdict"] = (
        f"{'fits' if report['fits'] else 'does NOT fit'}: peak per device learner "
        f"{peaks['learner']:.1f} GiB, sampler {peaks['sampler']:.1f} GiB, of "
        f"{device_memory_gib:g} GiB ({report['devices']} {report['platform']} devices)"
    )
    return report
