"""Compile time of the optimizer chain against optax.adamw's, as the parameter tree grows.

    python benchmarks/optimizer_compile.py [--leaves 24 96 310] [--smoke]

The optimizer half of a train step (update and apply, jitted) is compiled for trees of
`--leaves` leaves (vectors of 256 floats: compile time depends on the leaves' number, not
their size; 24 is the tiny test model, 310 Qwen3-0.6B) and three chains:

  adamw      optax.adamw(1e-4)                                   (the yardstick)
  default    make_optimizer(OptimizerConfig(clip_norm=1.0))      (clip, GAC's monitors, AdamW)
  gac+ess    make_optimizer(..., gac=GACConfig(), ess=ESSConfig())

Printed per tree: each chain's compile seconds (the best of `--rounds` compiles of the
lowered program, so a slow round of this shared machine does not count), the adds in its
optimised HLO (a measure of the program's size), and the ratio of each chain's compile time
to adamw's. The chain's sums over the leaves (GAC's inner products, the finiteness test)
are read by every leaf's update; `numerics.computed_once` keeps XLA:CPU from copying them
into each leaf's fusion, which made the program quadratic in the leaves (at dc43713, before
it, this script printed 220.05 s and 400,817 adds for the default chain at 310 leaves;
benchmarks/README.md has both tables).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

from gac_jax.learner import OptimizerConfig, make_optimizer
from gac_jax.transforms import ESSConfig, GACConfig

LEAF_FLOATS = 256


def chains() -> dict[str, optax.GradientTransformationExtraArgs]:
    config = OptimizerConfig(clip_norm=1.0)
    return {
        "adamw": optax.adamw(1e-4),
        "default": make_optimizer(config),
        "gac+ess": make_optimizer(config, gac=GACConfig(), ess=ESSConfig()),
    }


def lowered_step(tx, num_leaves: int) -> jax.stages.Lowered:
    """The chain's update and apply for a tree of `num_leaves` leaves, lowered."""
    params = {f"w{i:03d}": jnp.full((LEAF_FLOATS,), 0.01, jnp.float32) for i in range(num_leaves)}
    log_w = jnp.zeros((8,), jnp.float32)

    def step(params, state, grads, log_w):
        extra = {"log_importance_weights": log_w}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    return jax.jit(step).lower(params, tx.init(params), params, log_w)


def compile_seconds(tx, num_leaves: int, rounds: int) -> tuple[float, int]:
    """The best of `rounds` compiles and the HLO's adds. Each round lowers a new jitted
    function: JAX keeps a lowering's compiled program, so compiling it again costs nothing."""
    times, text = [], ""
    for _ in range(rounds):
        lowered = lowered_step(tx, num_leaves)
        start = time.perf_counter()
        compiled = lowered.compile()
        times.append(time.perf_counter() - start)
        text = text or compiled.as_text()
    return min(times), text.count(" add(")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[24, 96, 310])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="trees of 8 and 16 leaves, 1 round")
    args = parser.parse_args()
    leaves, rounds = ([8, 16], 1) if args.smoke else (args.leaves, args.rounds)
    jax.config.update("jax_enable_compilation_cache", False)  # Every compile is XLA's own.
    print(f"backend {jax.default_backend()}, best of {rounds} compiles, leaves of {LEAF_FLOATS}")
    print(f"{'leaves':>6} {'chain':>8} {'compile s':>10} {'HLO adds':>9} {'/ adamw':>8}")
    for n in leaves:
        base = None
        for name, tx in chains().items():
            seconds, adds = compile_seconds(tx, n, rounds)
            base = base or seconds
            print(f"{n:>6} {name:>8} {seconds:>10.2f} {adds:>9} {seconds / base:>8.2f}")


if __name__ == "__main__":
    main()
