"""GenerationConfig's sampler choice: validation, `make_sampler`, and the generator with
either sampler."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.rollout import GenerationConfig, TaskGroupGenerator, make_sampler
from gac_jax.rollout.worker import GroupRequest


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(sampler="paged"), r"sampler='paged' must be one of \['fixed', 'refill'\]"),
        (dict(sampler="refill", slots=0), "slots=0 must be an int >= 1 or None"),
        (dict(sampler="refill", slots=True), "slots=True must be an int >= 1 or None"),
        (dict(slots=4), "slots=4 is only used with sampler='refill'"),
    ],
)
def test_bad_sampler_settings_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**fields).validate()


def test_make_sampler_builds_the_chosen_sampler():
    cfg, tokenizer = models.get_config("tiny"), models.CharTokenizer()
    fixed = make_sampler(cfg, tokenizer, GenerationConfig())
    refill = make_sampler(cfg, tokenizer, GenerationConfig(sampler="refill", slots=3))
    assert type(fixed) is models.Sampler
    assert isinstance(refill, models.RefillSampler) and refill.slots == 3
    assert (refill.max_new_tokens, refill.eos_ids, refill.pad_id) == (
        fixed.max_new_tokens,
        fixed.eos_ids,
        fixed.pad_id,
    )


def test_the_generator_gives_the_same_greedy_rollouts_with_either_sampler():
    model = models.create_model(models.get_config("tiny"), seed=0)
    graphdef, params = nnx.split(model)
    tokenizer = models.CharTokenizer()
    examples = ["1+2=", "13+4=", "7+70=", "2+2="]
    task = types.SimpleNamespace(prompt=lambda e: e, reward=lambda c, e: float(len(c)))
    requests = [GroupRequest(prompt_id=i, group_id=10 + i) for i in range(4)]
    rollouts = {}
    for name, slots in (("fixed", None), ("refill", 3)):
        config = GenerationConfig(
            group_size=2, prompt_length=8, max_new_tokens=6, temperature=0.0, greedy=True,
            sampler=name, slots=slots,
        )  # fmt: skip
        sampler = make_sampler(model.config, tokenizer, config)
        generator = TaskGroupGenerator(graphdef, sampler, task, examples, tokenizer, config)
        rollouts[name] = generator(params, 0, requests, jax.random.key(0))
    for a, b in zip(rollouts["fixed"], rollouts["refill"], strict=True):
        assert (a.prompt_id, a.group_id) == (b.prompt_id, b.group_id)
        np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
        np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_allclose(a.behaviour_logp, b.behaviour_logp, atol=1e-5)
