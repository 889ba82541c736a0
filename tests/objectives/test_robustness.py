"""Robustness: extreme log-probabilities (+-1e4), empty masks, single-token sequences and
groups with equal rewards give finite values and gradients everywhere, and padded tokens
never receive gradient. Property tests over such inputs, one compiled function per
method (fixed shapes, so hypothesis examples reuse the compilation)."""

import functools
import inspect

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gac_jax.objectives as obj

B, T = 4, 3

_logps = hnp.arrays(
    np.float32,
    (B, T),
    elements=st.one_of(
        st.sampled_from([-1e4, -60.0, -3.0, -0.7, 0.0, 1e4]), st.floats(-5.0, 0.0, width=32)
    ),
)
_masks = hnp.arrays(np.bool_, (B, T))
_advantages = hnp.arrays(np.float32, (B,), elements=st.sampled_from([-2.0, -1e-3, 0.0, 0.5, 3.0]))
_rewards = hnp.arrays(np.float32, (B,), elements=st.sampled_from([0.0, 1.0]))
_group_ids = hnp.arrays(np.int32, (B,), elements=st.sampled_from([0, 1, 1000, -5]))


def _loss_kwargs(name, other_logp, group_ids):
    if name == "decoupled_ppo":
        return {"proximal_logp": other_logp, "behaviour_weight_cap": 3.0}
    if name == "ppo_recompute":
        return {"proximal_logp": other_logp}
    if name == "tb":
        return {"reference_logp": other_logp, "group_ids": group_ids}
    if name == "m2po_harmful":
        return {"variant": "harmful_budget"}
    return {}


_LOSS_NAMES = [*obj.POLICY_LOSSES, "m2po_harmful"]


@functools.cache
def _loss_fn(name):
    fn = obj.POLICY_LOSSES["m2po" if name == "m2po_harmful" else name]

    def loss(logp, behaviour, signal, mask, other, group_ids):
        return fn(logp, behaviour, signal, mask, **_loss_kwargs(name, other, group_ids))

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _assert_finite(tree, what):
    for leaf in jax.tree_util.tree_leaves(tree):
        assert np.all(np.isfinite(np.asarray(leaf))), what


def _check_losses(logp, behaviour, mask, adv, rewards, other, group_ids):
    for name in _LOSS_NAMES:
        signal = rewards if name == "tb" else adv
        (loss, aux), grad = _loss_fn(name)(logp, behaviour, signal, mask, other, group_ids)
        _assert_finite((loss, aux, grad), name)
        assert np.all(np.asarray(grad)[~mask] == 0.0), name


@given(
    logp=_logps,
    behaviour=_logps,
    other=_logps,
    mask=_masks,
    adv=_advantages,
    rewards=_rewards,
    group_ids=_group_ids,
)
def test_every_policy_loss_is_finite_with_zero_gradient_on_padding(
    logp, behaviour, other, mask, adv, rewards, group_ids
):
    _check_losses(logp, behaviour, mask, adv, rewards, other, group_ids)


@jax.jit
def _everything_else(logp, behaviour, mask, adv, rewards, group_ids):
    log_w = obj.sequence_log_ratio(logp, behaviour, mask)
    out = {
        "diag": obj.off_policy_diagnostics(logp, behaviour, mask),
        "clip": obj.clip_fractions(logp, behaviour, adv, mask, dual_clip=3.0),
        "m2po": obj.m2po_mask(logp, behaviour, mask),
        "m2po_harmful": obj.m2po_harmful_clip(logp, behaviour, adv, mask),
        "bapo": obj.bapo_clip_bounds(logp, behaviour, adv, mask),
        "icepop": obj.icepop_weights(logp, behaviour, mask),
        "ratio_geo": obj.importance_ratio(logp, behaviour, mask, level="geometric"),
        "ratio_seq": obj.importance_ratio(logp, behaviour, mask, level="sequence"),
        "grpo": obj.grpo_advantages(rewards, group_ids, epsilon=0.0),
        "dr_grpo": obj.dr_grpo_advantages(rewards, group_ids),
        "rloo": obj.rloo_advantages(rewards, group_ids),
        "vcpo": obj.vcpo_advantages(
            rewards, group_ids, log_weights=log_w, grad_sq_norms=obj.grad_sq_norm_proxy(mask)
        ),
    }
    for level in ("token", "sequence", "geometric"):
        out[f"tis_{level}"] = obj.truncated_importance_weights(logp, behaviour, mask, level=level)
        out[f"mis_{level}"] = obj.masked_importance_weights(logp, behaviour, mask, level=level)
    for estimator in obj.KL_ESTIMATORS:
        out[f"kl_{estimator}"] = obj.kl_penalty(logp, behaviour, mask, estimator=estimator)
    return out


@given(
    logp=_logps,
    behaviour=_logps,
    mask=_masks,
    adv=_advantages,
    rewards=_rewards,
    group_ids=_group_ids,
)
def test_weights_masks_advantages_and_diagnostics_are_finite(
    logp, behaviour, mask, adv, rewards, group_ids
):
    out = _everything_else(logp, behaviour, mask, adv, rewards, group_ids)
    _assert_finite(out, "objectives")
    for key in ("m2po", "icepop", "mis_token", "mis_sequence"):
        assert not (np.asarray(out[key].mask) & ~mask).any(), key


@pytest.mark.parametrize("name", _LOSS_NAMES)
def test_single_token_sequences(name):
    # T = 1: every sequence is a single token (one of them padded).
    logp = np.array([[-0.5], [-1e4], [-2.0], [0.0]], np.float32)
    behaviour = np.array([[-0.7], [-1.0], [1e4], [0.0]], np.float32)
    mask = np.array([[True], [True], [True], [False]])
    adv = np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    rewards = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    group_ids = np.array([0, 0, 1, 1], np.int32)
    signal = rewards if name == "tb" else adv
    (loss, aux), grad = _loss_fn(name)(logp, behaviour, signal, mask, logp - 0.1, group_ids)
    _assert_finite((loss, aux, grad), name)
    assert np.asarray(grad)[3, 0] == 0.0


def test_groups_with_equal_rewards_have_zero_advantage():
    rewards = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.5], np.float32)
    group_ids = np.array([4, 4, 4, 9, 9, 2], np.int32)
    log_w = np.array([3e3, -3e3, 0.0, 1.0, 2.0, 0.0], np.float32)
    for name, fn in obj.ADVANTAGE_ESTIMATORS.items():
        kwargs = {"log_weights": log_w, "grad_sq_norms": np.ones(6)} if name == "vcpo" else {}
        adv, aux = jax.jit(lambda r, g, fn=fn, kw=kwargs: fn(r, g, **kw))(rewards, group_ids)
        _assert_finite((adv, aux), name)
        np.testing.assert_array_equal(np.asarray(adv), 0.0, err_msg=name)


def test_padded_positions_may_hold_nan_and_inf():
    rng = np.random.default_rng(0)
    logp = rng.normal(-1.0, 0.5, (B, T)).astype(np.float32)
    behaviour = (logp + 0.1).astype(np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)
    poisoned_logp = np.where(mask, logp, np.nan).astype(np.float32)
    poisoned_behaviour = np.where(mask, behaviour, np.inf).astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    rewards = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    group_ids = np.zeros(B, np.int32)
    for name in _LOSS_NAMES:
        signal = rewards if name == "tb" else adv
        fn = _loss_fn(name)
        (clean, _), _ = fn(logp, behaviour, signal, mask, behaviour, group_ids)
        (dirty, aux), grad = fn(
            poisoned_logp, poisoned_behaviour, signal, mask, behaviour, group_ids
        )
        _assert_finite((dirty, aux, grad), name)
        assert float(dirty) == pytest.approx(float(clean), rel=1e-6, abs=1e-7), name
        assert np.all(np.asarray(grad)[~mask] == 0.0), name


def test_jnp_inputs_work_like_numpy_inputs():
    logp = jnp.full((B, T), -1.0)
    mask = jnp.ones((B, T), bool)
    loss, _ = jax.jit(obj.ppo_clip_loss)(logp, logp, jnp.ones(B), mask)
    assert float(loss) == pytest.approx(-1.0)


def _takes_aggregation(name):
    fn = obj.POLICY_LOSSES["m2po" if name == "m2po_harmful" else name]
    return "aggregation" in inspect.signature(fn).parameters


@pytest.mark.parametrize("name", [n for n in _LOSS_NAMES if _takes_aggregation(n)])
def test_an_unknown_aggregation_is_refused_before_the_inputs_are_read(name):
    # A bad knob is named first, before any search or statistic runs and whatever the
    # inputs: here the behaviour log-probs have the wrong shape too.
    fn = obj.POLICY_LOSSES["m2po" if name == "m2po_harmful" else name]
    logp, mask = np.zeros((B, T), np.float32), np.ones((B, T), bool)
    kwargs = _loss_kwargs(name, logp, np.zeros((B,), np.int32))
    signal = np.zeros((B,), np.float32)
    with pytest.raises(ValueError, match="aggregation"):
        fn(logp, np.zeros((B, T + 1), np.float32), signal, mask, aggregation="bogus", **kwargs)
