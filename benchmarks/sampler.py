"""The sampler's generated tokens/s with and without slot refill (continuous batching).

    python benchmarks/sampler.py [--quick] [--rounds 3] [--prompts 64] [--slots 16]
                                 [--lengths heavy|equal]

The 9.6M-parameter tiny Qwen3 of `vs_tunix.py` (6 layers, width 384, SwiGLU 1024, 6
query heads of 64, 2 KV heads, vocabulary 512, tied embeddings, fp32) answers `--prompts`
random 16-token prompts with up to `--max-new` (1024) new tokens each. With `--lengths
heavy` (the default) every row gets its own length limit, drawn per round from a
log-normal with median 64 (sigma `--sigma`) and clipped to [1, max-new], the heavy tail
of RL completions; with `--lengths equal` every row may run to max-new (what slot refill
cannot speed up: it should cost nothing there). The random model's EOS id (2) can end a
row sooner; it does so for both settings alike.

  all     `models.Sampler` with no slot limit: all prompts in one batch (as
          `TaskGroupGenerator` calls it), decoded until the longest one has ended (the
          tail compacted to narrower batches once few rows are left).
  slots   `models.Sampler(slots=--slots)`: a row that ends hands its slot and its KV
          cache to the next prompt.

Both decode greedily by default (`--temperature 0`), so they must return the same tokens
(as do sampled rows: keys are per row): the script checks it each round. Generated
tokens/s = the rows' total completion length over the call's wall time (outputs on the
host). After warm-up (compilation and one short call each, excluded), every round draws
new lengths and times both back to back, alternating which goes first; per setting the
median tokens/s over rounds is printed, and last the median over rounds of the
within-round ratio slots / all. `--quick` (1 round, 8 prompts, 64 new tokens, 4 slots)
only checks that it runs.
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

PROMPT, MEDIAN = 16, 64
NAMES = ("all", "slots")


def model_config() -> models.ModelConfig:
    """The 9.6M-parameter configuration of `benchmarks/vs_tunix.py`."""
    return gac_config(SIZES["10M"])


def row_limits(rng: np.random.Generator, args) -> np.ndarray:
    """Per-row limits: max-new each (`equal`), or log-normal with median 64, clipped to
    [1, max-new] (`heavy`)."""
    if args.lengths == "equal":
        return np.full((args.prompts,), args.max_new, np.int32)
    draws = rng.lognormal(np.log(MEDIAN), args.sigma, size=args.prompts)
    return np.clip(np.rint(draws), 1, args.max_new).astype(np.int32)


def timed(fn) -> tuple[float, models.SampleOutput]:
    start = time.perf_counter()
    out = jax.device_get(fn())
    return time.perf_counter() - start, out


def build(args):
    """`call(name, limits, seed) -> SampleOutput` for the two settings on one model."""
    cfg = model_config()
    model = models.create_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    params = sum(x.size for x in jax.tree.leaves(state))
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, size=(args.prompts, PROMPT), dtype=np.int32)
    mask = np.ones(prompts.shape, bool)
    common = dict(max_new_tokens=args.max_new, eos_ids=EOS, pad_id=PAD)
    samplers = {
        "all": models.Sampler(cfg, **common),
        "slots": models.Sampler(cfg, slots=args.slots, **common),
    }
    lengths = (
        f"log-normal median {MEDIAN}, sigma {args.sigma}" if args.lengths == "heavy" else "equal"
    )
    print(
        f"model {params / 1e6:.1f}M params; {args.prompts} prompts of {PROMPT} tokens, "
        f"<= {args.max_new} new ({lengths}); slots {args.slots}; "
        f"temperature {args.temperature}",
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
    """Times both settings on round `r`'s lengths; returns their tokens/s."""
    limits = row_limits(np.random.default_rng(r + 1), args)
    names = list(NAMES) if r % 2 == 0 else list(reversed(NAMES))
    seconds, outs = {}, {}
    for name in names:
        seconds[name], outs[name] = timed(lambda name=name: call(name, limits, r))
    tokens = {name: int(np.sum(out.lengths)) for name, out in outs.items()}
    rates = {name: tokens[name] / seconds[name] for name in names}
    same = np.array_equal(outs["all"].tokens, outs["slots"].tokens)
    print(
        f"round {r}: longest limit {limits.max()}, mean {limits.mean():.0f}; "
        + "; ".join(
            f"{name} {tokens[name]} tok in {seconds[name]:.2f} s ({rates[name]:.0f} tok/s)"
            for name in NAMES
        )
        + f"; ratio {rates['slots'] / rates['all']:.2f}; same tokens: {same}",
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
    parser.add_argument("--lengths", choices=("heavy", "equal"), default="heavy")
    parser.add_argument("--max-new", type=int, default=1024, help="static max_new_tokens")
    parser.add_argument("--quick", action="store_true", help="1 round of 8 short rows")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prompts, args.max_new, args.slots = 1, 8, 64, 4

    call = build(args)
    warm = np.full((args.prompts,), 4, np.int32)  # Compiles; a short call is enough.
    for name in NAMES:
        seconds, _ = timed(lambda name=name: call(name, warm, 0))
        print(f"  {name}: compile + first call {seconds:.1f} s", flush=True)
    rounds = [run_round(call, r, args) for r in range(args.rounds)]
    for name in NAMES:
        median = statistics.median(rates[name] for rates in rounds)
        print(f"{name}: median {median:.0f} generated tokens/s")
    ratio = statistics.median(rates["slots"] / rates["all"] for rates in rounds)
    print(f"slots / all tokens/s: median ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
