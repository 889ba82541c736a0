"""Slot refill (continuous batching) against the fixed sampler on heavy-tailed lengths.

    python benchmarks/sampler.py [--rounds 3] [--prompts 64] [--slots 16]

The 9.6M-parameter tiny Qwen3 of `vs_tunix.py` (6 layers, width 384, SwiGLU 1024, 6
query heads of 64, 2 KV heads, vocabulary 512, tied embeddings, fp32) answers `--prompts`
random 16-token prompts with up to 1024 new tokens each. Every row gets its own length
limit, drawn per round from a log-normal with median 64 (sigma `--sigma`) and clipped to
[1, 1024], the heavy tail of RL completions. The random model's EOS id (2) can end a row
sooner; it does so for both samplers alike.

  fixed   `models.Sampler`: all prompts in one batch (as `TaskGroupGenerator` calls it),
          every row decoded until the longest one has ended.
  refill  `models.RefillSampler` with `--slots` decode slots: a row that ends hands its
          slot and its KV cache to the next prompt.

Both decode greedily by default (`--temperature 0`), so they must return the same tokens:
the script checks it each round. Generated tokens/s = the rows' total completion length
over the call's wall time (outputs on the host). After warm-up (compilation and one short
call each, excluded), every round draws new lengths and times both back to back, alternating
which goes first; per sampler the median tokens/s over rounds is printed, and last the
median over rounds of the within-round ratio refill / fixed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from bench_models import EOS, PAD, SIZES, gac_config
from flax import nnx

from gac_jax import models

PROMPT, MAX_NEW, MEDIAN = 16, 1024, 64


def model_config() -> models.ModelConfig:
    """The 9.6M-parameter configuration of `benchmarks/vs_tunix.py`."""
    return gac_config(SIZES["10M"])


def heavy_tailed_limits(rng: np.random.Generator, rows: int, sigma: float) -> np.ndarray:
    """Per-row limits: log-normal with median 64, clipped to [1, 1024]."""
    draws = rng.lognormal(np.log(MEDIAN), sigma, size=rows)
    return np.clip(np.rint(draws), 1, MAX_NEW).astype(np.int32)


def timed(fn) -> tuple[float, models.SampleOutput]:
    start = time.perf_counter()
    out = jax.device_get(fn())
    return time.perf_counter() - start, out


def build(args):
    """`call(name, limits, seed) -> SampleOutput` for the two samplers on one model."""
    cfg = model_config()
    model = models.create_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    params = sum(x.size for x in jax.tree.leaves(state))
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, size=(args.prompts, PROMPT), dtype=np.int32)
    mask = np.ones(prompts.shape, bool)
    common = dict(max_new_tokens=MAX_NEW, eos_ids=EOS, pad_id=PAD)
    samplers = {
        "fixed": models.Sampler(cfg, **common),
        "refill": models.RefillSampler(cfg, slots=args.slots, **common),
    }
    print(
        f"model {params / 1e6:.1f}M params; {args.prompts} prompts of {PROMPT} tokens, "
        f"<= {MAX_NEW} new (log-normal median {MEDIAN}, sigma {args.sigma}); "
        f"refill slots {args.slots}; temperature {args.temperature}",
        flush=True,
    )

    def call(name, limits, seed):
        return samplers[name](
            graphdef,
            state,
            prompts,
            mask,
            jax.random.key(seed),
            temperature=args.temperature,
            max_new_tokens=limits,
        )

    return call


def run_round(call, r: int, args) -> dict[str, float]:
    """Times both samplers on round `r`'s lengths; returns their tokens/s."""
    limits = heavy_tailed_limits(np.random.default_rng(r + 1), args.prompts, args.sigma)
    names = ["fixed", "refill"] if r % 2 == 0 else ["refill", "fixed"]
    seconds, outs = {}, {}
    for name in names:
        seconds[name], outs[name] = timed(lambda name=name: call(name, limits, r))
    tokens = {name: int(np.sum(out.lengths)) for name, out in outs.items()}
    rates = {name: tokens[name] / seconds[name] for name in names}
    same = np.array_equal(outs["fixed"].tokens, outs["refill"].tokens)
    print(
        f"round {r}: longest limit {limits.max()}, mean {limits.mean():.0f}; "
        + "; ".join(
            f"{name} {tokens[name]} tok in {seconds[name]:.2f} s ({rates[name]:.0f} tok/s)"
            for name in ("fixed", "refill")
        )
        + f"; ratio {rates['refill'] / rates['fixed']:.2f}"
        + ("" if args.temperature else f"; same tokens: {same}"),
        flush=True,
    )
    return rates


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    call = build(args)
    warm = np.full((args.prompts,), 4, np.int32)  # Compiles; a short call is enough.
    for name in ("fixed", "refill"):
        seconds, _ = timed(lambda name=name: call(name, warm, 0))
        print(f"  {name}: compile + first call {seconds:.1f} s", flush=True)
    rounds = [run_round(call, r, args) for r in range(args.rounds)]
    for name in ("fixed", "refill"):
        median = statistics.median(rates[name] for rates in rounds)
        print(f"{name}: median {median:.0f} generated tokens/s")
    ratio = statistics.median(rates["refill"] / rates["fixed"] for rates in rounds)
    print(f"refill / fixed tokens/s: median ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
