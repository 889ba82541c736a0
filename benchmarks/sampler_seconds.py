"""The CPU seconds of the canary's 10M model's `Sampler` (32 rows x 128 new tokens), greedy
and at temperature 1: a change of the decoder's layout moves both sides of the canary's
ratio, so it shows only here. Run it in two checkouts, one after the other:

    PYTHONPATH=<checkout> python benchmarks/sampler_seconds.py [--calls 4] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from learner import CONFIGS

from gac_jax import models


def main(argv=None) -> dict[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=4, help="timed calls (the least is kept)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 8 new tokens")
    args = parser.parse_args(argv)
    config = CONFIGS["tiny" if args.smoke else "10M"]
    rows, prompt, new = (4, 8, 8) if args.smoke else (32, 16, 128)
    graphdef, state = nnx.split(models.create_model(config, seed=0))
    prompts = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (rows, prompt)))
    mask = jnp.ones(prompts.shape, bool)
    sampler = models.Sampler(config, max_new_tokens=new, eos_ids=1, pad_id=0)
    least = {}
    for temperature in (0.0, 1.0):

        def call(temperature=temperature):
            key = jax.random.key(0)
            out = sampler(graphdef, state, prompts, mask, key, temperature=temperature)
            return jax.block_until_ready(out.tokens)

        call()  # Compiles.
        seconds = []
        for _ in range(args.calls):
            start = time.process_time()
            call()
            seconds.append(time.process_time() - start)
        least[temperature] = min(seconds)
        print(f"temperature {temperature:g}: CPU s {', '.join(f'{s:.2f}' for s in seconds)}")
    print(f"least: greedy {least[0.0]:.2f} / temperature 1 {least[1.0]:.2f} CPU s", flush=True)
    return least


if __name__ == "__main__":
    main()
