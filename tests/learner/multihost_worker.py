"""One process of a multi-process learner run, launched by `test_multihost.py`.

    python tests/learner/multihost_worker.py --out P.npz --process-id I --num-processes 2 \
        --port PORT --local-devices 2 --mesh 2,1,2 --steps 3

Under `jax.distributed` (coordinator on 127.0.0.1, gloo collectives on the CPU), every
process builds the same tiny model (same seed) and a `GRPOLearner` on a mesh over all
global devices, then feeds ITS OWN rollout groups (seeded by process id and step) to
`learner.step` for a few steps. With `--num-processes 1 --feeds 2` it is the single-process
reference instead: one process with as many devices trains on the concatenation of the rows
that processes 0 and 1 would feed.

It writes `--out` (npz): for every param leaf, the shards this process holds (`leaf/i/data`
and their global `leaf/i/index` as [start, stop) pairs per dimension), so the test can check
that every replica of every element agrees across processes; and each step's metrics.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

G, L, PROMPT = 4, 6, 8  # Group size, completion length, prompt length.
GROUPS_PER_FEED = 2  # Rollout groups each process contributes per step.
LAG = 1  # Rollouts of step t come from policy version max(0, t - LAG).


def fake_rollouts(feed: int, step: int):
    """The groups process `feed` contributes at `step` (differs per process and step)."""
    from gac_jax.rollout import Rollout

    rng = np.random.default_rng([feed, step])
    out = []
    for i in range(GROUPS_PER_FEED):
        mask = np.ones((G, L), bool)
        mask[i % G, 2 + i :] = False  # A completion that ended early.
        out.append(
            Rollout(
                prompt_id=i,
                group_id=1000 * feed + i,
                prompt_tokens=rng.integers(3, 60, 3 + (feed + i) % 4).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-3.0 * rng.random((G, L))).astype(np.float32),
                rewards=rng.integers(0, 2, G).astype(np.float32),
                policy_version=max(0, step - LAG),
            )
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="coordinator port (distributed)")
    parser.add_argument("--local-devices", type=int, default=2)
    parser.add_argument("--mesh", default="2,1,2", help="data,fsdp,tensor over all devices")
    parser.add_argument("--feeds", type=int, default=1, help="row sets this process feeds")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=60, help="distributed init, seconds")
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
            heartbeat_timeout_seconds=args.timeout,
            shutdown_timeout_seconds=args.timeout,
        )
    assert jax.process_count() == args.num_processes
    assert jax.local_device_count() == args.local_devices

    from gac_jax import models
    from gac_jax.learner import GRPOLearner, OptimizerConfig, TrainBatch, make_optimizer
    from gac_jax.rollout import collate
    from gac_jax.transforms import ESSConfig, GACConfig

    mesh = models.make_mesh(*map(int, args.mesh.split(",")))
    tx = make_optimizer(
        OptimizerConfig(learning_rate=1e-2),
        gac=GACConfig(tau_low=0.1, tau_high=0.9),
        ess=ESSConfig(),
    )
    learner = GRPOLearner(models.create_model(models.get_config("tiny"), seed=0), tx, mesh)

    first_feed = args.process_id * args.feeds
    feeds = range(first_feed, first_feed + args.feeds)
    metrics = []
    for step in range(args.steps):
        rollouts = [r for feed in feeds for r in fake_rollouts(feed, step)]
        metrics.append(learner.step(TrainBatch(**collate(rollouts, PROMPT)), step))

    out = {}
    names = sorted(metrics[0])
    out["metric_names"] = np.array(names)
    out["metrics"] = np.array([[m[k] for k in names] for m in metrics], np.float64)
    for path, leaf in jax.tree_util.tree_leaves_with_path(learner.params):
        name = jax.tree_util.keystr(path)
        out[f"{name}/shape"] = np.array(leaf.shape)
        seen = set()
        for shard in leaf.addressable_shards:
            index = tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape, strict=True))
            if index not in seen:
                out[f"{name}/{len(seen)}/index"] = np.array(index, np.int64).reshape(-1, 2)
                out[f"{name}/{len(seen)}/data"] = np.asarray(shard.data)
                seen.add(index)
    np.savez(args.out, **out)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
