"""Compile time against depth: the one-GPU preset's learner step and sampler at the model's
own depth and at 2 layers (issue 61: at most twice as long).

    python benchmarks/compile_depth.py [--preset qwen3_0_6b_gsm8k_1gpu] [--layers 2]

Each program is built as `plan` builds it (`build_run(config, abstract=True, num_layers=n)`:
abstract arrays, no weights, the preset's checkpoint not needed), then lowered and compiled
(`plan_learner`, `plan_sampler`), with no persistent compilation cache; the full depth is
compiled first, so the process's first-trace costs count against it. Printed: seconds of
lower + compile per program and depth (wall clock, and this process's CPU time, which a
busy shared machine disturbs less), and the ratios full / small of their sums.
"""

from __future__ import annotations

import argparse
import time

import jax

from gac_jax.train import apply_overrides, get_preset
from gac_jax.train.build import model_config
from gac_jax.train.plan import plan_learner, plan_sampler
from gac_jax.train.run import build_run


def compile_seconds(config, layers: int) -> dict[str, float]:
    """Wall and CPU seconds to lower and compile the learner step and the sampler at
    `layers` layers."""
    run = build_run(config, abstract=True, num_layers=layers)
    out, clocks = {}, (time.perf_counter, time.process_time)
    for name, compile_ in (("learner", plan_learner), ("sampler", plan_sampler)):
        start = [clock() for clock in clocks]
        compile_(config, run.learner if name == "learner" else run)
        out[name], out[f"{name}_cpu"] = (c() - s for c, s in zip(clocks, start, strict=True))
    for clock in ("", "_cpu"):
        out[f"total{clock}"] = out[f"learner{clock}"] + out[f"sampler{clock}"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3_0_6b_gsm8k_1gpu")
    parser.add_argument("--layers", type=int, default=2, help="the shallow model's layers")
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # Every compile is XLA's own.
    config = apply_overrides(get_preset(args.preset), ["compilation_cache=null"])
    full = model_config(config).num_layers
    print(f"{args.preset}, backend {jax.default_backend()}")
    names = ("learner", "sampler", "total")
    print(f"{'layers':>6}" + "".join(f" {n + ' s':>10} {n + ' cpu':>11}" for n in names))
    rows = {}
    for layers in (full, args.layers):
        rows[layers] = s = compile_seconds(config, layers)
        print(f"{layers:>6}" + "".join(f" {s[n]:>10.1f} {s[n + '_cpu']:>11.1f}" for n in names))
    deep, shallow = rows[full], rows[args.layers]
    print(
        f"ratio {full} / {args.layers} layers: {deep['total'] / shallow['total']:.2f} wall, "
        f"{deep['total_cpu'] / shallow['total_cpu']:.2f} cpu"
    )


if __name__ == "__main__":
    main()
