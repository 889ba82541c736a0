"""Nothing poisoned: a step with a non-finite loss, gradient or update is skipped whole.

Params and the whole optimizer state (Adam moments, GAC's reference and counters, ESS
state) stay bit for bit those of before the step, the next finite step proceeds as if the
bad one had never come, and too many bad steps in a row stop the learner with one line.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gac_jax import models
from gac_jax.learner import (
    GRPOLearner,
    LearnerConfig,
    NonFiniteStepError,
    OptimizerConfig,
    SupervisedLearner,
    TrainBatch,
    make_optimizer,
)
from gac_jax.rollout import Rollout, collate
from gac_jax.train.warm_start import encode_sft_batch
from gac_jax.transforms import ESSConfig, GACConfig

CONFIG = models.get_config("tiny")
G, L, PROMPT = 4, 6, 8

# What the poisoning transform writes into the gradient on the next steps; None: nothing.
_POISON = {"value": None}


def _poison_from_host() -> optax.GradientTransformationExtraArgs:
    """Replaces every gradient entry by `_POISON["value"]` whenever the host sets one.

    The switch is read through a callback, not the transform's state: a skipped step
    restores the whole optimizer state, so a counter in it could never move past the bad
    step.
    """

    def read_switch():
        value = _POISON["value"]
        return np.bool_(value is not None), np.float32(0.0 if value is None else value)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        shapes = (jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.float32))
        on, value = jax.pure_callback(read_switch, shapes)
        return jax.tree.map(lambda u: jnp.where(on, value, u).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update_fn)


@pytest.fixture(autouse=True)
def _no_poison():
    _POISON["value"] = None
    yield
    _POISON["value"] = None


def _rollouts(num_groups=2, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Rollout(
            prompt_id=i,
            group_id=i,
            prompt_tokens=rng.integers(3, 60, 3 + i % 3).astype(np.int32),
            completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
            completion_mask=np.ones((G, L), bool),
            behaviour_logp=(-3.0 * rng.random((G, L))).astype(np.float32),
            rewards=np.asarray([0.0, 1.0, 0.0, 1.0], np.float32),
            policy_version=0,
        )
        for i in range(num_groups)
    ]


def _batch(seed=0, **replace) -> TrainBatch:
    rollouts = [dataclasses.replace(r, **replace) for r in _rollouts(seed=seed)]
    return TrainBatch(**collate(rollouts, PROMPT))


def _learner(max_consecutive_nonfinite=3) -> GRPOLearner:
    tx = optax.chain(
        _poison_from_host(),
        make_optimizer(
            OptimizerConfig(learning_rate=1e-3),
            gac=GACConfig(tau_low=0.1, tau_high=0.9),
            ess=ESSConfig(rho_base=0.5),
        ),
    )
    return GRPOLearner(
        models.create_model(CONFIG, seed=0),
        tx,
        models.make_mesh(1, 1, 1),
        config=LearnerConfig(max_consecutive_nonfinite=max_consecutive_nonfinite),
    )


def _host_state(learner):
    """Params and optimizer state as host copies (the device buffers are donated)."""
    return jax.tree.map(np.array, jax.device_get((learner.params, learner.opt_state)))


def _assert_bitwise_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _all_finite(tree):
    return all(np.isfinite(np.asarray(x, np.float64)).all() for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def clean_run():
    """State and metrics after two finite steps, the second at learner version 3: what a
    run with a skipped step in between must reproduce bit for bit."""
    learner = _learner()
    learner.step(_batch(seed=0), 1)
    metrics = learner.step(_batch(seed=1), 3)
    return _host_state(learner), metrics


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_a_poisoned_update_is_skipped_and_leaves_no_trace(poison, clean_run):
    learner = _learner()
    assert learner.step(_batch(seed=0), 1)["nonfinite_step"] == 0.0
    before = _host_state(learner)
    # GAC's reference, Adam's moments and the counters are live after one step.
    gradient_alignment = optax.tree.get(before[1], "gac_gradient_alignment")
    assert np.any(jax.tree.leaves(gradient_alignment.gac_reference)[0] != 0)

    _POISON["value"] = poison
    metrics = learner.step(_batch(seed=2), 2)
    assert metrics["nonfinite_step"] == 1.0
    assert not np.isfinite(metrics["update_norm"])
    _assert_bitwise_equal(_host_state(learner), before)

    _POISON["value"] = None
    metrics = learner.step(_batch(seed=1), 3)
    assert metrics["nonfinite_step"] == 0.0
    clean_state, clean_metrics = clean_run
    _assert_bitwise_equal(_host_state(learner), clean_state)
    assert metrics == clean_metrics


def test_a_nan_log_prob_skips_the_step_and_the_next_batch_trains():
    learner = _learner()
    learner.step(_batch(seed=0), 0)
    before = _host_state(learner)
    behaviour = (-3.0 * np.random.default_rng(5).random((G, L))).astype(np.float32)
    behaviour[1, 2] = np.nan  # A corrupted log-prob of a valid token: the loss is NaN.
    metrics = learner.step(_batch(seed=1, behaviour_logp=behaviour), 1)
    assert metrics["nonfinite_step"] == 1.0
    assert np.isnan(metrics["loss"]) and np.isnan(metrics["grad_norm"])
    _assert_bitwise_equal(_host_state(learner), before)

    metrics = learner.step(_batch(seed=1), 2)
    assert metrics["nonfinite_step"] == 0.0 and np.isfinite(metrics["loss"])
    after = _host_state(learner)
    assert _all_finite(after)
    assert any(
        a.tobytes() != b.tobytes()
        for a, b in zip(jax.tree.leaves(after[0]), jax.tree.leaves(before[0]), strict=True)
    )
    assert learner.consecutive_nonfinite == 0


def test_a_nan_reward_skips_the_step():
    # GRPO would zero the group's advantages and train on with finite numbers: a broken
    # reward function must be seen, not averaged away.
    learner = _learner()
    learner.step(_batch(seed=0), 0)
    before = _host_state(learner)
    rewards = np.asarray([0.0, np.nan, 0.0, 1.0], np.float32)
    metrics = learner.step(_batch(seed=1, rewards=rewards), 1)
    assert metrics["nonfinite_step"] == 1.0 and np.isfinite(metrics["grad_norm"])
    _assert_bitwise_equal(_host_state(learner), before)
    assert learner.step(_batch(seed=1), 2)["nonfinite_step"] == 0.0


def test_a_minus_inf_behaviour_logp_never_poisons_the_state():
    learner = _learner()
    learner.step(_batch(seed=0), 0)
    before = _host_state(learner)
    behaviour = (-3.0 * np.random.default_rng(5).random((G, L))).astype(np.float32)
    behaviour[2, 1] = -np.inf  # A token the sampler "could not" have drawn: w = +inf.
    metrics = learner.step(_batch(seed=1, behaviour_logp=behaviour), 1)
    after = _host_state(learner)
    assert _all_finite(after)
    # ESS takes each group's dominant sequence at its limit: 2 of 8 sequences carry the
    # batch, rho = 0.25, and the step is scaled by sqrt(0.25 / rho_base), not made NaN.
    assert metrics["nonfinite_step"] == 0.0 and np.isfinite(metrics["update_norm"])
    np.testing.assert_allclose(metrics["ess_scale"], np.sqrt(0.25 / 0.5), rtol=1e-6)
    assert any(
        a.tobytes() != b.tobytes()
        for a, b in zip(jax.tree.leaves(after[0]), jax.tree.leaves(before[0]), strict=True)
    )


def test_consecutive_nonfinite_steps_raise_and_a_finite_one_resets_the_count():
    learner = _learner(max_consecutive_nonfinite=3)
    learner.step(_batch(seed=0), 9)
    before = _host_state(learner)
    _POISON["value"] = np.nan
    for version in (10, 11):
        assert learner.step(_batch(seed=1), version)["nonfinite_step"] == 1.0
    _POISON["value"] = None
    assert learner.step(_batch(seed=1), 12)["nonfinite_step"] == 0.0  # The count restarts.
    good = _host_state(learner)
    assert any(
        a.tobytes() != b.tobytes()
        for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(before), strict=True)
    )

    _POISON["value"] = np.inf
    learner.step(_batch(seed=2), 13)
    learner.step(_batch(seed=2), 14)
    message = (
        "step 15: 3 consecutive non-finite steps (loss, gradient, update or reward); "
        "params and optimizer state are those of step 12"
    )
    with pytest.raises(NonFiniteStepError) as raised:
        learner.step(_batch(seed=2), 15)
    assert str(raised.value) == message
    assert isinstance(raised.value, RuntimeError)
    _assert_bitwise_equal(_host_state(learner), good)


def test_nonfinite_steps_before_any_finite_one_name_the_first_bad_step():
    learner = _learner(max_consecutive_nonfinite=1)
    _POISON["value"] = np.nan
    with pytest.raises(NonFiniteStepError, match=r"^step 4: 1 consecutive .* before step 4$"):
        learner.step(_batch(seed=0), 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_consecutive_nonfinite_is_validated(bad):
    with pytest.raises(ValueError, match=f"max_consecutive_nonfinite={bad!r}"):
        LearnerConfig(max_consecutive_nonfinite=bad).validate()


def test_the_supervised_step_skips_a_poisoned_update_too():
    tokenizer = models.CharTokenizer()
    data = encode_sft_batch(tokenizer, ["Use 3 4: ", "ab"], ["3*4", "c"], length=16)
    tx = optax.chain(_poison_from_host(), optax.adamw(1e-3))
    learner = SupervisedLearner(models.create_model(CONFIG, seed=0), tx, models.make_mesh(1, 1, 1))
    assert learner.step(data)["nonfinite_step"] == 0.0
    before = _host_state(learner)
    _POISON["value"] = np.nan
    metrics = learner.step(data)
    assert metrics["nonfinite_step"] == 1.0 and np.isfinite(metrics["loss"])
    _assert_bitwise_equal(_host_state(learner), before)
