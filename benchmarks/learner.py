"""Learner throughput: trained tokens/s and model FLOP utilisation, GAC + ESS on versus off.

    python benchmarks/learner.py [--quick]

Part 2 (`OPTIONS`): on the ~10M config, with the plain chain ("off" below), the cost of the
learner's options as step-time ratios to the plain step, measured interleaved in one run:
a KL penalty to the frozen reference model (one extra forward pass per batch), the same
with the reference offloaded to host memory, and LoRA (rank 8 on q, k, v, o) instead of
full fine-tuning.

For the "tiny" preset and a ~10M-parameter config (6 layers, width 384, SwiGLU 1024,
6 query heads of 64, 2 KV heads, vocabulary 512, tied embeddings, fp32), one
`GRPOLearner.step` (PPO-clip loss, GRPO advantages, host batch in, metrics out) runs on
batches of 64 sequences x 64 tokens (prompt 16 + completion 48; 8 groups of 8) with two
optimizer chains:

  off   make_optimizer(): clip -> alignment monitor -> AdamW (the cosine is still recorded)
  on    make_optimizer(gac=..., ess=...): clip -> GAC -> AdamW -> ESS step scaling

Trained tokens are all 64 x 64 positions the forward and backward passes run over. Model
FLOPs per trained token (PaLM's accounting, no causal discount, no rematerialisation):

  6 * N_matmul + 12 * layers * heads * head_dim * seq_len
  N_matmul = layers * (D*N*H + 2*D*K*H + N*H*D + 3*D*F) + V*D   (the output projection)

MFU = achieved model FLOP/s / peak, where the peak is a jitted 2048 x 2048 fp32 matmul
(2 * 2048^3 FLOPs) timed in the same loop. Variants and the peak are interleaved within
each round, so machine noise hits all of them; medians are over rounds after two warm-up
steps per variant (compile excluded).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax import models
from gac_jax.learner import (
    GRPOLearner,
    LearnerConfig,
    LossConfig,
    OptimizerConfig,
    TrainBatch,
    make_optimizer,
)
from gac_jax.rollout import Rollout, collate
from gac_jax.transforms import ESSConfig, GACConfig

CONFIGS = {
    "tiny": models.get_config("tiny"),
    "10M": models.get_config(
        "tiny",
        vocab_size=512,
        embed_dim=384,
        num_layers=6,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        mlp_dim=1024,
    ),
}
GROUPS, GROUP_SIZE, PROMPT, COMPLETION = 8, 8, 16, 48
PEAK_N = 2048
NUM_BATCHES = 4  # Distinct batches cycled through, so GAC sees changing gradients.


def variants() -> dict[str, dict]:
    """The keyword arguments of `make_optimizer` of each variant."""
    config = OptimizerConfig(learning_rate=1e-4)
    return {
        "off": dict(config=config),
        "on": dict(config=config, gac=GACConfig(tau_low=0.2, tau_high=0.8), ess=ESSConfig()),
    }


def matmul_params(config: models.ModelConfig) -> int:
    """Parameters that enter a matmul once per token (the embedding lookup does not)."""
    d, n, k, h, f = (
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.mlp_dim,
    )
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    return config.num_layers * per_layer + config.vocab_size * config.embed_dim


def flops_per_token(config: models.ModelConfig, seq_len: int) -> float:
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq_len
    return 6.0 * matmul_params(config) + attention


def fake_batch(config: models.ModelConfig, seed: int, version: int):
    """64 sequences of full-length prompts and completions with random tokens."""
    rng = np.random.default_rng(seed)
    rollouts = [
        Rollout(
            prompt_id=i,
            group_id=i,
            prompt_tokens=rng.integers(3, config.vocab_size, PROMPT).astype(np.int32),
            completion_tokens=rng.integers(3, config.vocab_size, (GROUP_SIZE, COMPLETION)).astype(
                np.int32
            ),
            completion_mask=np.ones((GROUP_SIZE, COMPLETION), bool),
            behaviour_logp=(np.log(1.0 / config.vocab_size) - 0.1 * rng.random((GROUP_SIZE, 1)))
            .repeat(COMPLETION, axis=1)
            .astype(np.float32),
            rewards=rng.integers(0, 2, GROUP_SIZE).astype(np.float32),
            policy_version=version,
        )
        for i in range(GROUPS)
    ]
    return TrainBatch(**collate(rollouts, PROMPT))


def make_peak():
    """A timer of one jitted PEAK_N^2 fp32 matmul (returns seconds)."""
    a = jax.random.normal(jax.random.key(0), (PEAK_N, PEAK_N), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (PEAK_N, PEAK_N), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()

    def timed() -> float:
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        return time.perf_counter() - start

    return timed


def bench_config(config, rounds, peak_timer, peak_times):
    """Step times {variant: [seconds]} and GAC's regime on each timed step of "on"."""
    mesh = models.make_mesh()  # One CPU device: XLA's intra-op threads use every core.
    learners = {
        v: GRPOLearner(models.create_model(config, seed=0), make_optimizer(**kw), mesh)
        for v, kw in variants().items()
    }
    batches = [fake_batch(config, seed=s, version=0) for s in range(NUM_BATCHES)]
    for learner in learners.values():  # Warm-up: compile, then one compiled step.
        for step in range(2):
            learner.step(batches[step], step)
    times = {v: [] for v in learners}
    regimes = []
    for r in range(rounds):
        peak_times.append(peak_timer())
        batch = batches[r % NUM_BATCHES]
        for v, learner in learners.items():
            start = time.perf_counter()
            metrics = learner.step(batch, 2 + r)
            times[v].append(time.perf_counter() - start)
            if v == "on":
                regimes.append(int(metrics["gac_regime"]))
    return times, regimes


def report(name, config, times, regimes, peak):
    n_params = sum(
        x.size for x in jax.tree.leaves(nnx.state(models.create_model(config), nnx.Param))
    )
    tokens = GROUPS * GROUP_SIZE * (PROMPT + COMPLETION)
    flops = flops_per_token(config, PROMPT + COMPLETION) * tokens
    print(
        f"\n{name}: {n_params / 1e6:.2f}M params (V={config.vocab_size} D={config.embed_dim} "
        f"L={config.num_layers} N={config.num_heads}x{config.head_dim} K={config.num_kv_heads} "
        f"F={config.mlp_dim}, {config.dtype}); {flops / tokens / 1e6:.2f} MFLOP/token; "
        f"batch {GROUPS * GROUP_SIZE} x {PROMPT + COMPLETION} = {tokens} tokens"
    )
    medians = {v: statistics.median(t) for v, t in times.items()}
    for v, median in medians.items():
        achieved = flops / median
        print(
            f"  GAC+ESS {v:<3}  step {1e3 * median:7.1f} ms (min {1e3 * min(times[v]):.1f}, "
            f"max {1e3 * max(times[v]):.1f})  {tokens / median:7.0f} tokens/s  "
            f"{achieved / 1e9:6.1f} GFLOP/s  MFU {100 * achieved / peak:5.1f}%"
        )
    counts = [regimes.count(k) for k in range(3)]
    print(
        f"  step-time ratio GAC+ESS on / off: {medians['on'] / medians['off']:.3f}  "
        f"(GAC regimes pass/project/skip on timed steps: {counts[0]}/{counts[1]}/{counts[2]})"
    )


OPTIONS = {
    "plain": {},
    "kl reference": dict(loss=LossConfig(kl_coef=1e-3)),
    "kl reference offloaded": dict(
        loss=LossConfig(kl_coef=1e-3), config=LearnerConfig(reference_offload=True)
    ),
    "lora r8": dict(lora=models.LoraConfig(rank=8)),
}


def _options_learner(config, options):
    model = models.create_model(config, seed=0)
    kwargs = dict(options)
    trainable = None
    if "lora" in kwargs:
        model = models.apply_lora(model, kwargs.pop("lora"), rngs=nnx.Rngs(params=0))
        trainable = models.lora_filter
    tx = make_optimizer(**variants()["off"])
    return GRPOLearner(model, tx, models.make_mesh(), trainable=trainable, **kwargs)


def bench_options(config, rounds, label="10M"):
    """Step times {option: [seconds]}, interleaved round by round."""
    learners = {name: _options_learner(config, o) for name, o in OPTIONS.items()}
    batches = [fake_batch(config, seed=s, version=0) for s in range(NUM_BATCHES)]
    for learner in learners.values():
        for step in range(2):
            learner.step(batches[step], step)
    times = {name: [] for name in learners}
    for r in range(rounds):
        for name, learner in learners.items():
            start = time.perf_counter()
            learner.step(batches[r % NUM_BATCHES], 2 + r)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    print(f"\noptions on {label}, plain chain: step time, and ratio to the plain step")
    for name, t in times.items():
        median = statistics.median(t)
        ratios = [a / b for a, b in zip(t, times["plain"], strict=True)]
        print(
            f"  {name:<24} {1e3 * median:7.1f} ms  ratio {median / base:.3f} "
            f"(per-round ratios {min(ratios):.2f}-{max(ratios):.2f})"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed rounds instead of 10")
    parser.add_argument(
        "--smoke", action="store_true", help="every path once: 1 round, the tiny config only"
    )
    args = parser.parse_args()
    rounds = 1 if args.smoke else 3 if args.quick else 10
    configs = {"tiny": CONFIGS["tiny"]} if args.smoke else CONFIGS

    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s); {rounds} timed rounds per config"
    )
    peak_timer = make_peak()
    peak_times = [peak_timer() for _ in range(3)]
    results = {
        name: bench_config(config, rounds, peak_timer, peak_times)
        for name, config in configs.items()
    }
    matmul_flops = 2 * PEAK_N**3
    peak = matmul_flops / statistics.median(peak_times)
    print(
        f"peak: jitted {PEAK_N}x{PEAK_N} fp32 matmul, median {peak / 1e9:.1f} GFLOP/s over "
        f"{len(peak_times)} runs interleaved with the steps "
        f"(min {matmul_flops / max(peak_times) / 1e9:.1f}, "
        f"max {matmul_flops / min(peak_times) / 1e9:.1f})"
    )
    print("model FLOPs/token = 6 * N_matmul + 12 * layers * heads * head_dim * seq_len")
    for name, (times, regimes) in results.items():
        report(name, configs[name], times, regimes, peak)
    options_on = "tiny" if args.smoke else "10M"
    bench_options(configs[options_on], rounds, options_on)


if __name__ == "__main__":
    main()
