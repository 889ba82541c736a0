"""Cost of GAC + ESS scaling relative to optax.adamw's update, on a >= 50M-float tree.

Each variant runs as the optimizer half of a train step (update, apply_updates, with params
and optimizer state donated).

    python benchmarks/transforms.py [--floats 50e6] [--repeats 15] [--reference-dtype bfloat16]

Measures, in one run with interleaved repetitions (so machine noise hits every variant):
  adamw       optax.adamw(...).update                       (the yardstick)
  gac+ess     chain(gradient_alignment_control, scale_by_ess).update
  full chain  chain(gradient_alignment_control, adamw, scale_by_ess).update
  full, ref donated   the same with GAC's reference donated too
  clip+adamw  optax.chain(clip_by_global_norm, adamw).update    (the learner's bare optimizer)
  learner, monitors   the learner's chain, `make_optimizer()`: clip, then adamw under
              `alignment_controlled` with both alignment monitors (its default, gac=None)
  learner, GAC+ESS    `make_optimizer(gac=GACConfig(), ess=ESSConfig())`: GAC's true skip
and prints medians, the ratios gac+ess / adamw, (full chain - adamw) / adamw and the
learner's chains over clip+adamw, and each
variant's passes over memory: XLA's count of bytes accessed divided by the tree's bytes
(adamw makes 10: read g, mu, nu, p; write mu, nu, p; mu and nu re-read by the last loop).
Every step is jitted with params and optimizer state donated as `GRPOLearner` does
(everything but GAC's reference), with the learner's XLA:CPU options on a CPU backend
(`CPU_STEP_COMPILER_OPTIONS`); compile time is excluded (one warm-up call each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gac_jax
from gac_jax.learner.learner import CPU_STEP_COMPILER_OPTIONS
from gac_jax.learner.optimizer import OptimizerConfig, make_optimizer
from gac_jax.transforms import ESSConfig, GACConfig


def transformer_like_tree(total_floats: float, width: int = 1024) -> dict[str, jax.Array]:
    """Leaves shaped like a decoder's (attention, MLP, norms), totalling >= total_floats."""
    per_layer = 4 * width * width + 3 * width * (3 * width) + 2 * width
    layers = int(np.ceil(total_floats / per_layer))
    tree, key = {}, jax.random.key(0)
    for i in range(layers):
        for name, shape in (
            ("q", (width, width)),
            ("k", (width, width)),
            ("v", (width, width)),
            ("o", (width, width)),
            ("gate", (width, 3 * width)),
            ("up", (width, 3 * width)),
            ("down", (3 * width, width)),
            ("norm1", (width,)),
            ("norm2", (width,)),
        ):
            key, sub = jax.random.split(key)
            tree[f"layer{i}/{name}"] = 0.02 * jax.random.normal(sub, shape, jnp.float32)
    return tree


def make_step(tx: optax.GradientTransformationExtraArgs, state, *, donate_reference: bool):
    """The optimizer half of a train step: update and apply, params and state donated.

    As in `GRPOLearner`, GAC's reference is not donated unless `donate_reference`: the
    step replaces it while still reading the old one, so a donated reference makes XLA
    copy it out of the way first. Returns `(step, split, merge)`: `step(params, donated,
    kept, grads, log_w)` on the state split by `split`, reassembled by `merge`.

    Returning params and state in the order they came in lets every donated buffer be
    reused by its own successor. (Returning the updates first would hand the first donated
    state buffer to the updates and shift every alias by one, which forces XLA to add
    copies.)
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    is_ref = [
        not donate_reference and any(getattr(k, "name", None) == "gac_reference" for k in path)
        for path, _ in paths
    ]

    def split(tree):
        leaves = treedef.flatten_up_to(tree)
        return (
            [x for x, r in zip(leaves, is_ref, strict=True) if not r],
            [x for x, r in zip(leaves, is_ref, strict=True) if r],
        )

    def merge(donated, kept):
        donated, kept = iter(donated), iter(kept)
        return treedef.unflatten([next(kept) if r else next(donated) for r in is_ref])

    def step(params, donated, kept, grads, log_w):
        updates, state = tx.update(
            grads, merge(donated, kept), params, log_importance_weights=log_w
        )
        return (optax.apply_updates(params, updates), *split(state))

    options = CPU_STEP_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(step, donate_argnums=(0, 1), compiler_options=options), split, merge


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--floats", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reference-dtype", default=None)
    parser.add_argument("--scope", default="global", choices=["global", "per_leaf"])
    parser.add_argument("--smoke", action="store_true", help="every path once, 1e5 floats")
    args = parser.parse_args()
    if args.smoke:
        args.floats, args.repeats = 1e5, 2

    params = transformer_like_tree(args.floats)
    n = sum(x.size for x in jax.tree.leaves(params))
    grads = jax.tree.map(lambda p: 0.5 * p + 1e-3, params)
    log_w = jnp.linspace(-2.0, 2.0, 64)
    gac = gac_jax.gradient_alignment_control(
        0.2, 0.8, reference_dtype=args.reference_dtype, scope=args.scope
    )
    ess = gac_jax.scale_by_ess(rho_base=1.0)
    adamw = optax.adamw(1e-3)
    variants = {  # name: (chain, donate GAC's reference)
        "adamw": (adamw, False),
        "gac+ess": (optax.chain(gac, ess), False),
        "full chain": (optax.chain(gac, adamw, ess), False),
        "full, ref donated": (optax.chain(gac, adamw, ess), True),
        "clip+adamw": (optax.chain(optax.clip_by_global_norm(1.0), adamw), False),
        "learner, monitors": (make_optimizer(OptimizerConfig(learning_rate=1e-3)), False),
        "learner, GAC+ESS": (
            make_optimizer(OptimizerConfig(learning_rate=1e-3), GACConfig(), ESSConfig()),
            False,
        ),
    }
    steps, splits, merges, states = {}, {}, {}, {}
    for name, (tx, donate_reference) in variants.items():
        # Fresh buffers per leaf: init may hand out one cached zeros buffer to several
        # leaves, and a buffer cannot be donated twice.
        state = jax.tree.map(jnp.copy, tx.init(params))
        steps[name], splits[name], merges[name] = make_step(
            tx, state, donate_reference=donate_reference
        )
        states[name] = splits[name](state)
    weights = {name: jax.tree.map(jnp.copy, params) for name in variants}
    # Two gradients at cosine about 0.5 alternate, so GAC projects on every step (its
    # costliest regime) rather than passing or skipping.
    noise = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), params)
    grad_pair = (grads, jax.tree.map(lambda g, n: g + 0.02 * n, grads, noise))
    times = {name: [] for name in variants}

    def run(name, i):
        weights[name], *states[name] = steps[name](
            weights[name], *states[name], grad_pair[i % 2], log_w
        )

    for name in variants:  # Warm-up: compile, and real steps so the reference is nonzero.
        for i in range(2):
            run(name, i)
        jax.block_until_ready(weights[name])
    for i in range(args.repeats):
        for name in variants:
            start = time.perf_counter()
            run(name, i)
            jax.block_until_ready((weights[name], states[name]))
            times[name].append(time.perf_counter() - start)

    passes = {}
    for name in variants:
        compiled = steps[name].lower(weights[name], *states[name], grad_pair[0], log_w).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        passes[name] = cost["bytes accessed"] / (4 * n)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"tree: {len(params)} leaves, {n / 1e6:.1f}M floats; backend {jax.default_backend()}")
    print(f"GAC scope={args.scope}, reference dtype={args.reference_dtype or 'float32'}")
    for name, median in medians.items():
        spread = (min(times[name]), max(times[name]))
        print(
            f"  {name:<18} median {1e3 * median:8.1f} ms   "
            f"(min {1e3 * spread[0]:.1f}, max {1e3 * spread[1]:.1f})   "
            f"{passes[name]:5.1f} passes"
        )
    gac_state = merges["gac+ess"](*states["gac+ess"])[0]
    print(
        "  GAC regimes over the run (pass/project/skip): "
        f"{int(gac_state.gac_pass_count)}/{int(gac_state.gac_project_count)}/"
        f"{int(gac_state.gac_skip_count)}"
    )
    standalone = medians["gac+ess"] / medians["adamw"]
    incremental = (medians["full chain"] - medians["adamw"]) / medians["adamw"]
    donated = (medians["full, ref donated"] - medians["adamw"]) / medians["adamw"]
    print(f"ratio gac+ess / adamw:                 {standalone:.3f}")
    print(f"ratio (full chain - adamw) / adamw:    {incremental:.3f}")
    print(f"  the same with the reference donated: {donated:.3f}")
    for name in ("learner, monitors", "learner, GAC+ESS"):
        ratio = medians[name] / medians["clip+adamw"]
        print(f"ratio {name} / clip+adamw:".ljust(39) + f"{ratio:.3f}")


if __name__ == "__main__":
    main()
