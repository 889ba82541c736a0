"""Rollout pipeline: buffer overhead per group, and async vs sync throughput (simulated).

    python benchmarks/pipeline.py [--quick]

(a) Overhead. Moves many groups through a real `RolloutBuffer` (reserve + put + take),
    in one thread and with a producer thread, and times sampling one
    group (G=8 completions, 16 new tokens, 16-token prompts) with the tiny model's
    `Sampler`; prints the overhead per group relative to sampling one group.
(b) Throughput. Measures, with the tiny model, the generation cost per token and per group
    (at the simulation's max_new_tokens) and one `GRPOLearner` step on B groups of that
    length, then feeds them to `simulation.py` with a heavy-tailed (clipped
    log-normal) response length, and prints async / sync throughput for staleness bounds
    1, 2, 4, 8 and 1, 2, 4, 8 workers: with the real buffer's block policy, with dropped
    groups' slots returned (a possible fix, see the simulation's docstring), and with the
    drop policy.

Timings are medians after warm-up; compile time is excluded. The simulation assumes each
worker and the learner have their own device, which this host's shared cores do not
provide: the measured costs are the tiny model's, the table is the pipeline's behaviour
at those costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

import jax
import numpy as np
from flax import nnx
from simulation import (
    LengthDistribution,
    SimulationConfig,
    compare_async_to_sync,
    format_comparison,
    format_utilisation,
)

from gac_jax import models
from gac_jax.learner import GRPOLearner, OptimizerConfig, TrainBatch, make_optimizer
from gac_jax.rollout import Rollout, RolloutBuffer, collate

GROUP_SIZE, PROMPT_LENGTH = 8, 16
BOUNDS, WORKERS = (1, 2, 4, 8), (1, 2, 4, 8)


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fake_rollout(version: int, completion_length: int, group_id: int = 0) -> Rollout:
    rng = np.random.default_rng(group_id)
    shape = (GROUP_SIZE, completion_length)
    return Rollout(
        prompt_id=group_id,
        group_id=group_id,
        prompt_tokens=rng.integers(3, 128, PROMPT_LENGTH).astype(np.int32),
        completion_tokens=rng.integers(3, 128, shape).astype(np.int32),
        completion_mask=np.ones(shape, bool),
        behaviour_logp=-rng.random(shape).astype(np.float32),
        rewards=rng.random(GROUP_SIZE).astype(np.float32),
        policy_version=version,
    )


# ----------------------------------------------------------------------------- (a)


def buffer_seconds_per_group(groups: int, batch: int, threaded: bool) -> float:
    """Wall time per group of reserve + put + take through a `RolloutBuffer`.

    One thread: block policy with alpha=1, B reserve+put then one take per step. With a
    producer thread: drop policy with a bound never reached (so `take` still scans for
    stale groups), because a block-policy producer must re-poll the version with a timeout
    as `RolloutWorker` does, and the poll interval would be timed instead of the buffer.
    """
    steps = groups // batch
    templates = [fake_rollout(v, 16) for v in range(steps + 2)]  # One record per version.
    if threaded:
        buffer = RolloutBuffer(2 * batch, batch, max_staleness=steps, stale_policy="drop")
    else:
        buffer = RolloutBuffer(2 * batch, batch, max_staleness=1, stale_policy="block")
    version = [0]

    def produce(count):
        for _ in range(count):
            v = version[0]
            buffer.reserve(v)
            buffer.put(templates[v])

    start = time.perf_counter()
    if threaded:
        producer = threading.Thread(target=produce, args=(steps * batch,))
        producer.start()
        for t in range(steps):
            buffer.take(t)
            version[0] = t + 1
        producer.join()
    else:
        for t in range(steps):
            produce(batch)
            buffer.take(t)
            version[0] = t + 1
    seconds = time.perf_counter() - start
    assert buffer.stats().consumed == steps * batch
    return seconds / (steps * batch)


def prompts(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return models.left_pad(rng.integers(3, 128, (rows, PROMPT_LENGTH)).tolist(), 0)


def sample_seconds(model, max_new_tokens: int, repeats: int, eos_ids=None) -> tuple[float, int]:
    """Median time to sample one group (as `TaskGroupGenerator` does: call + device_get),
    and the number of decode steps it ran (the group's longest completion)."""
    config = model.config
    sampler = models.Sampler(
        config,
        max_new_tokens=max_new_tokens,
        eos_ids=config.eos_token_ids if eos_ids is None else eos_ids,
        pad_id=config.pad_token_id,
    )
    graphdef, state = nnx.split(model)
    tokens, mask = prompts(GROUP_SIZE)
    key = jax.random.key(0)  # Fixed: every repeat runs the same number of decode steps.

    def run():
        return jax.device_get(sampler(graphdef, state, tokens, mask, key))

    seconds = median_seconds(run, repeats)
    return seconds, int(np.max(run().lengths))


# ----------------------------------------------------------------------------- (b)


def learner_step_seconds(batch_groups: int, completion_length: int, repeats: int) -> float:
    """Median time of one `GRPOLearner.step` (PPO loss, the default optimizer chain)."""
    model = models.create_model(models.get_config("tiny"), seed=0)  # Its params get donated.
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6))
    learner = GRPOLearner(model, tx, models.make_mesh())
    rollouts = [fake_rollout(0, completion_length, g) for g in range(batch_groups)]
    batch = learner.place_batch(TrainBatch(**collate(rollouts, PROMPT_LENGTH)))
    return median_seconds(lambda: learner.step(batch, 0), repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups, repeats, steps")
    parser.add_argument("--groups-per-batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="for (b)")
    parser.add_argument("--length-median", type=float, default=None, help="max_new / 8")
    parser.add_argument("--length-sigma", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=None, help="simulated learner steps")
    parser.add_argument(
        "--smoke", action="store_true", help="every path once: --quick at 16 new tokens"
    )
    args = parser.parse_args()
    quick = args.quick or args.smoke
    if args.smoke:
        args.max_new_tokens, args.steps = 16, args.steps or 50
    started = time.perf_counter()
    b, n = args.groups_per_batch, args.max_new_tokens
    repeats = 5 if quick else 21
    model = models.create_model(models.get_config("tiny"), seed=0)
    print(f"backend {jax.default_backend()}, model tiny, G={GROUP_SIZE}, B={b} groups/step")

    # (a) -------------------------------------------------------------------------------
    groups = 4_000 if quick else 40_000
    single = statistics.median(
        buffer_seconds_per_group(groups, b, threaded=False) for _ in range(3 if quick else 5)
    )
    threaded = statistics.median(
        buffer_seconds_per_group(groups, b, threaded=True) for _ in range(3 if quick else 5)
    )
    sample, steps16 = sample_seconds(model, 16, repeats)
    print(f"\n(a) buffer overhead vs sampling one group ({groups} groups through the buffer)")
    print(f"  sample one group (16 new tokens, ran {steps16}): {1e3 * sample:9.3f} ms")
    for name, seconds in (("single thread", single), ("producer thread", threaded)):
        print(
            f"  reserve+put+take per group, {name + ':':<16} {1e6 * seconds:8.2f} us"
            f"   overhead / sampling = {seconds / sample:.2e}"
        )

    # (b) -------------------------------------------------------------------------------
    full, decode_steps = sample_seconds(model, n, repeats)
    vocab = model.config.vocab_size
    one, _ = sample_seconds(model, n, repeats, eos_ids=tuple(range(vocab)))  # Stops at once.
    token_seconds = max(full - one, 0.0) / max(decode_steps - 1, 1)
    if full <= one:  # Short samples on a loaded machine: the difference is in the noise.
        print(f"  ({n} new tokens sampled no slower than 1: a token's cost taken as 0)")
    overhead = max(one - token_seconds, 0.0)
    train = learner_step_seconds(b, n, 3 if quick else 7)
    lengths = LengthDistribution(
        "lognormal", scale=args.length_median or n / 8, shape=args.length_sigma, max_tokens=n
    )
    steps = args.steps or (300 if quick else 2_000)
    base = SimulationConfig(
        groups_per_batch=b,
        group_size=GROUP_SIZE,
        token_seconds=token_seconds,
        group_overhead_seconds=overhead,
        train_seconds=train,
        lengths=lengths,
        num_steps=steps,
    )
    longest = lengths.sample(np.random.default_rng(0), (10_000, GROUP_SIZE)).max(axis=1)
    group = overhead + token_seconds * longest
    print(f"\n(b) measured at max_new_tokens={n} ({decode_steps} decode steps timed)")
    print(f"  generation: {1e3 * token_seconds:.3f} ms/token per group + {1e3 * overhead:.2f} ms")
    shape = f"{b} groups x {GROUP_SIZE} x ({PROMPT_LENGTH}+{n}) tokens"
    print(f"  learner step (GRPOLearner.step) on {shape}: {1e3 * train:.1f} ms")
    print(f"  lengths: {lengths.describe()}")
    print(
        f"  group time: mean {1e3 * group.mean():.1f} ms, p50 {1e3 * np.median(group):.1f},"
        f" p99 {1e3 * np.quantile(group, 0.99):.1f}; B x mean / train step = "
        f"{b * group.mean() / train:.2f}"
    )
    print(
        f"  simulated {steps} learner steps, buffer capacity {base.buffer_capacity} groups;"
        " cell = async/sync steps/s (mean staleness of trained groups)"
    )
    scenarios = [("measured costs", 1.0)]
    if not quick:
        scenarios.append(("what if the learner step took 1/4 of the measured time", 0.25))
    for scenario, scale in scenarios:
        config = dataclasses.replace(base, train_seconds=scale * train)
        print(f"\n=== {scenario}: learner step {1e3 * config.train_seconds:.1f} ms ===")
        for title, overrides in (
            ("block policy, the real RolloutBuffer", {}),
            ("drop policy", dict(stale_policy="drop")),
        ):
            table = compare_async_to_sync(config, BOUNDS, WORKERS, **overrides)
            print()
            print(format_comparison(table, title))
            if not overrides:
                print(format_utilisation(table, 2))
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
