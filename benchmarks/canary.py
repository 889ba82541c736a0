"""A cheap speed canary (issue #44): the sampler and the learner's step, each timed against a
fixed plain-JAX reference doing the same work in the same process, as a ratio.

    python benchmarks/canary.py            # the 10M model of learner.py, 5 rounds
    python benchmarks/canary.py --smoke    # the tiny model, one round (a test runs it)

  sampler   `models.Sampler` decoding R prompts greedily to N new tokens against a plain
            `jax.lax.scan` greedy decode of the same model with the decoder's KV cache
            (one prefill, then one token a step; no slots, refill, log-probs or versions).
            Both give the same tokens (checked); no row may end early, so both decode the
            same R x N tokens (checked).
  learner   `GRPOLearner.step` (PPO-clip, GRPO advantages, the alignment monitor, the
            diagnostics, metrics to the host; `learner.py`'s batch of 64 x 64 tokens)
            against one jitted step of `value_and_grad` of the mean completion log-prob
            (`models.per_token_logps`) and `optax.adamw`, on the same batch and model.

Each ratio is ours / the reference's time, the median over rounds of within-round ratios
(the two alternate in every round, so machine noise hits both): what a change to our code
costs shows as a ratio that moves, whatever the machine's speed. Record the figures per
commit in benchmarks/README.md ("Canary"); the smoke's only prove the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from learner import CONFIGS, fake_batch

from gac_jax import models
from gac_jax.learner import GRPOLearner, LearnerConfig, OptimizerConfig, make_optimizer
from gac_jax.models.decoder import init_cache

FULL = dict(model="10M", rows=32, prompt=16, new=128, rounds=5)
SMOKE = dict(model="tiny", rows=4, prompt=8, new=8, rounds=1)


def plain_decode(config: models.ModelConfig, new: int):
    """A jitted greedy decode: `(graphdef, state, prompts, mask) -> tokens [R, new]`."""

    def decode(graphdef, state, prompts, mask):
        model = nnx.merge(graphdef, state)
        rows, prompt_len = prompts.shape
        cache = init_cache(config, rows, prompt_len + new)
        hidden, cache = model.hidden_states(prompts, None, mask, cache)
        cache = cache | {"index": jnp.full((rows,), prompt_len, jnp.int32)}
        first = (model.logits(hidden[:, -1:])[:, 0], cache, jnp.sum(mask, axis=1, dtype=jnp.int32))

        def step(carry, _):
            logits, cache, positions = carry
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            rope = model.rope_tables(positions[:, None], cache["key_mask"].shape[1])
            index = cache["index"]
            ones = jnp.ones((rows, 1), bool)
            hidden, cache = model.hidden_states(
                tokens[:, None], positions[:, None], ones, cache, rope
            )
            cache = cache | {"index": index + 1}
            return (model.logits(hidden)[:, 0], cache, positions + 1), tokens

        _, tokens = jax.lax.scan(step, first, None, length=new)
        return tokens.T

    return jax.jit(decode)


def plain_train_step(tx: optax.GradientTransformation):
    """A jitted `(graphdef, params, opt_state, other, tokens, mask) -> (params, opt_state,
    loss)`: the mean completion log-prob's gradient, one AdamW update."""

    def step(graphdef, params, opt_state, other, tokens, mask):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, other)
            logps = models.per_token_logps(model, tokens, mask | True)
            return -jnp.sum(jnp.where(mask, logps, 0.0)) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(1, 2))


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def sampler_ratio(config, shape: dict) -> dict:
    model = models.create_model(config, seed=0)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, config.vocab_size, (shape["rows"], shape["prompt"])))
    mask = jnp.ones(prompts.shape, bool)
    # EOS: an id the prompts' greedy continuations never reach (checked below), so every
    # row decodes all `new` tokens, as the reference does.
    sampler = models.Sampler(config, max_new_tokens=shape["new"], eos_ids=1, pad_id=0)
    reference = plain_decode(config, shape["new"])
    ours_out = sampler(graphdef, state, prompts, mask, jax.random.key(0), temperature=0.0)
    plain_out = reference(graphdef, state, prompts, mask)
    if not bool(jnp.all(ours_out.lengths == shape["new"])):
        raise SystemExit("canary: a row drew EOS early; the two decodes do different work")
    np.testing.assert_array_equal(np.asarray(ours_out.tokens), np.asarray(plain_out))
    ratios = []
    for r in range(shape["rounds"]):
        ours = lambda: sampler(graphdef, state, prompts, mask, jax.random.key(0), temperature=0.0)  # noqa: E731
        plain = lambda: reference(graphdef, state, prompts, mask)  # noqa: E731
        first, second = (ours, plain) if r % 2 == 0 else (plain, ours)
        t1, t2 = _timed(first), _timed(second)
        ratios.append(t1 / t2 if r % 2 == 0 else t2 / t1)
    return {"ratio": statistics.median(ratios), "tokens": shape["rows"] * shape["new"]}


def learner_ratio(config, shape: dict) -> dict:
    batches = [fake_batch(config, seed, 0) for seed in range(2)]
    learner = GRPOLearner(
        models.create_model(config, seed=0),
        make_optimizer(OptimizerConfig(learning_rate=1e-4)),
        models.make_mesh(),
        config=LearnerConfig(micro_batches=1),  # Whole, as the plain step: like for like.
    )
    graphdef, params, other = nnx.split(models.create_model(config, seed=0), nnx.Param, ...)
    tx = optax.adamw(1e-4)
    step = plain_train_step(tx)
    state = {"params": params, "opt": tx.init(params)}
    inputs = [(jnp.asarray(b.tokens), jnp.asarray(b.loss_mask)) for b in batches]

    def plain(i):
        out = step(graphdef, state["params"], state["opt"], other, *inputs[i % 2])
        state["params"], state["opt"] = out[0], out[1]
        return out[2]

    learner.step(batches[0], 0)  # Compile both.
    jax.block_until_ready(plain(0))
    ratios = []
    for r in range(shape["rounds"]):
        ours_s = _timed(lambda r=r: learner.step(batches[r % 2], r + 1)["loss"])
        plain_s = _timed(lambda r=r: plain(r))
        ratios.append(ours_s / plain_s)
    return {"ratio": statistics.median(ratios), "tokens": int(np.prod(batches[0].tokens.shape))}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny model, one round")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    shape["rounds"] = args.rounds or shape["rounds"]
    config = CONFIGS[shape["model"]]
    result = {"sampler": sampler_ratio(config, shape), "learner": learner_ratio(config, shape)}
    print(
        f"canary ({shape['model']}, {shape['rounds']} rounds; ours / plain JAX, lower is "
        f"better): sampler {result['sampler']['ratio']:.2f}x "
        f"({shape['rows']} rows x {shape['new']} greedy tokens), learner step "
        f"{result['learner']['ratio']:.2f}x ({result['learner']['tokens']} tokens)"
    )
    return result


if __name__ == "__main__":
    main()
