"""Policy losses: values and gradients against float64 loop references.

Each reference computes the per-token loss and its analytic derivative with respect to
``logp`` token by token; the aggregation's derivative is a per-token coefficient. The JAX
gradient must match it everywhere, including the exact zeros a method promises (clipped
PPO tokens, padded tokens).
"""

import inspect
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.objectives import (
    AGGREGATIONS,
    bapo_clip_bounds,
    bapo_loss,
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    naive_pg_loss,
    naive_pg_trust_region_loss,
    ppo_clip_loss,
    ppo_recompute_loss,
    reinforce_loss,
    topr_loss,
    trajectory_balance_loss,
    truncated_importance_weights,
)

B, T = 6, 7


def _inputs(seed, scale=0.5):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 1.0, (B, T)).astype(np.float32)
    behaviour = (logp + rng.normal(0.0, scale, (B, T))).astype(np.float32)
    mask = rng.random((B, T)) > 0.25
    mask[0] = False  # fully padded sequence
    mask[1] = False
    mask[1, 3] = True  # single-token sequence
    adv = (np.abs(rng.normal(0.0, 1.0, B)) * [1, -1, 1, -1, 1, -1]).astype(np.float32)
    # Padded positions hold garbage: it must not reach values or gradients.
    logp = np.where(mask, logp, np.float32(1e4))
    behaviour = np.where(mask, behaviour, np.float32(-1e4))
    return logp, behaviour, mask, adv


def _coefficients(mask, mode):
    """d(aggregate)/d(per-token loss), token by token (float64)."""
    coef = np.zeros(mask.shape)
    counts = mask.sum(-1)
    valid_rows = int((counts > 0).sum())
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            if mode == "token-mean":
                coef[b, t] = 1.0 / mask.sum()
            elif mode == "seq-mean-token-mean":
                coef[b, t] = 1.0 / (valid_rows * counts[b])
            elif mode == "seq-mean-token-sum":
                coef[b, t] = 1.0 / valid_rows
            else:
                coef[b, t] = 1.0 / (mask.shape[0] * mask.shape[1])
    return coef


def _adv_bt(adv):
    return np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv


def _ref_ppo_token(r, a, lower, upper, dual):
    """(loss, d loss / d log r) of one token of the clipped surrogate."""
    if a > 0 and r > upper:
        loss, grad = -a * upper, 0.0
    elif a < 0 and r < lower:
        loss, grad = -a * lower, 0.0
    else:
        loss, grad = -a * r, -a * r
    if dual is not None and a < 0 and r > dual:
        loss, grad = -a * dual, 0.0
    return loss, grad


def _check(got, grad, ref_loss_bt, ref_grad_bt, mask, mode, rtol=2e-5):
    coef = _coefficients(mask, mode)
    np.testing.assert_allclose(float(got), float(np.sum(coef * ref_loss_bt)), rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), coef * ref_grad_bt, rtol=rtol, atol=1e-7)
    assert np.all(np.asarray(grad)[~mask] == 0.0)


def _value_and_grad(fn, logp):
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)


# ------------------------------------------------------------------------------ REINFORCE


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_reinforce_default_weights_are_the_token_ratio(mode):
    logp, behaviour, mask, adv = _inputs(0)
    (loss, aux), grad = _value_and_grad(
        lambda lp: reinforce_loss(lp, behaviour, adv, mask, aggregation=mode), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        w = math.exp(float(logp[b, t]) - float(behaviour[b, t]))
        loss_bt[b, t] = -w * adv[b] * float(logp[b, t])
        grad_bt[b, t] = -w * adv[b]  # the weight is a constant: no d w / d logp term
    _check(loss, grad, loss_bt, grad_bt, mask, mode)
    assert set(aux) == {"weight_mean", "ratio_mean", "approx_kl"}


def test_reinforce_with_truncated_weights():
    logp, behaviour, mask, adv = _inputs(1, scale=1.0)
    weights = truncated_importance_weights(logp, behaviour, mask, cap=1.2).weights
    (loss, _), grad = _value_and_grad(
        lambda lp: reinforce_loss(lp, behaviour, adv, mask, is_weights=weights), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        w = min(math.exp(float(logp[b, t]) - float(behaviour[b, t])), 1.2)
        loss_bt[b, t], grad_bt[b, t] = -w * adv[b] * float(logp[b, t]), -w * adv[b]
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")


# ------------------------------------------------------------------------------------ PPO


@pytest.mark.parametrize(
    "eps_low,eps_high,dual,mode,per_token",
    [
        (0.2, 0.2, None, "token-mean", False),
        (0.2, 0.28, 3.0, "token-mean", True),
        (0.1, 0.3, 1.5, "seq-mean-token-mean", False),
        (0.2, 0.2, None, "seq-mean-token-sum", True),
        (0.2, 0.2, 2.0, "seq-mean-token-sum-norm", False),
    ],
)
def test_ppo_clip_matches_reference(eps_low, eps_high, dual, mode, per_token):
    logp, behaviour, mask, adv = _inputs(2, scale=0.8)
    if per_token:
        adv = np.random.default_rng(2).normal(size=(B, T)).astype(np.float32)
    (loss, aux), grad = _value_and_grad(
        lambda lp: ppo_clip_loss(
            lp,
            behaviour,
            adv,
            mask,
            eps_low=eps_low,
            eps_high=eps_high,
            dual_clip=dual,
            aggregation=mode,
        ),
        logp,
    )
    adv_bt = _adv_bt(adv)
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    low = high = dual_n = 0
    for b, t in zip(*np.nonzero(mask), strict=True):
        r = math.exp(float(logp[b, t]) - float(behaviour[b, t]))
        a = float(adv_bt[b, t])
        loss_bt[b, t], grad_bt[b, t] = _ref_ppo_token(r, a, 1 - eps_low, 1 + eps_high, dual)
        low += a < 0 and r < 1 - eps_low
        high += a > 0 and r > 1 + eps_high
        dual_n += dual is not None and a < 0 and r > dual
    _check(loss, grad, loss_bt, grad_bt, mask, mode)
    n = mask.sum()
    assert low > 0 and high > 0  # the data exercises both clips
    np.testing.assert_allclose(float(aux["clip_fraction_low"]), low / n, rtol=1e-6)
    np.testing.assert_allclose(float(aux["clip_fraction_high"]), high / n, rtol=1e-6)
    np.testing.assert_allclose(float(aux["clip_fraction"]), (low + high) / n, rtol=1e-6)
    np.testing.assert_allclose(float(aux["dual_clip_fraction"]), dual_n / n, rtol=1e-6, atol=0)


def test_ppo_clipped_tokens_get_exactly_zero_gradient():
    logp = np.log(np.array([[1.5, 0.5, 1.1, 0.5, 5.0]], np.float32))
    behaviour = np.zeros_like(logp)
    adv = np.array([[1.0, -1.0, 1.0, 1.0, -1.0]], np.float32)
    mask = np.ones_like(logp, bool)
    grad = jax.jit(jax.grad(lambda lp: ppo_clip_loss(lp, behaviour, adv, mask, dual_clip=3.0)[0]))(
        logp
    )
    grad = np.asarray(grad)[0]
    # token 0: A>0, r>1.2 clipped; 1: A<0, r<0.8 clipped; 4: A<0, r>3 dual-clipped.
    assert grad[0] == 0.0 and grad[1] == 0.0 and grad[4] == 0.0
    np.testing.assert_allclose(grad[[2, 3]], [-1.1 / 5, -0.5 / 5], rtol=1e-5)


def test_ppo_extra_weights_multiply_the_token_loss():
    logp, behaviour, mask, adv = _inputs(3)
    weights = np.random.default_rng(3).uniform(0.5, 2.0, B).astype(np.float32)
    (loss, _), grad = _value_and_grad(
        lambda lp: ppo_clip_loss(lp, behaviour, adv, mask, is_weights=weights), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        r = math.exp(float(logp[b, t]) - float(behaviour[b, t]))
        value, g = _ref_ppo_token(r, float(adv[b]), 0.8, 1.2, None)
        loss_bt[b, t], grad_bt[b, t] = weights[b] * value, weights[b] * g
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")


def test_decoupled_ppo_matches_reference():
    logp, behaviour, mask, adv = _inputs(4, scale=0.8)
    proximal = (logp + np.random.default_rng(4).normal(0, 0.3, (B, T))).astype(np.float32)
    (loss, aux), grad = _value_and_grad(
        lambda lp: decoupled_ppo_loss(
            lp,
            behaviour,
            adv,
            mask,
            proximal_logp=proximal,
            behaviour_weight_cap=2.0,
            dual_clip=3.0,
        ),
        logp,
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    dropped = 0
    for b, t in zip(*np.nonzero(mask), strict=True):
        u = math.exp(float(logp[b, t]) - float(proximal[b, t]))
        w = math.exp(float(proximal[b, t]) - float(behaviour[b, t]))
        if w > 2.0:
            dropped += 1
            continue
        value, g = _ref_ppo_token(u, float(adv[b]), 0.8, 1.2, 3.0)
        loss_bt[b, t], grad_bt[b, t] = w * value, w * g
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")
    assert dropped > 0
    np.testing.assert_allclose(
        float(aux["behaviour_mask_fraction"]), dropped / mask.sum(), rtol=1e-6
    )


# ------------------------------------------------------------ the naive asynchronous baselines


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_naive_pg_is_the_unweighted_policy_gradient(mode):
    # Far-off behaviour log-probs: an importance weight would change everything; none may.
    logp, behaviour, mask, adv = _inputs(11, scale=2.0)
    (loss, aux), grad = _value_and_grad(
        lambda lp: naive_pg_loss(lp, behaviour, adv, mask, aggregation=mode), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        loss_bt[b, t], grad_bt[b, t] = -float(adv[b]) * float(logp[b, t]), -float(adv[b])
    _check(loss, grad, loss_bt, grad_bt, mask, mode)
    assert float(aux["weight_mean"]) == 1.0


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.2), (0.1, 0.28)])
def test_naive_pg_trust_region_drops_what_ppo_clip_silences(eps_low, eps_high, mode):
    logp, behaviour, mask, adv = _inputs(14, scale=0.5)
    kw = {"eps_low": eps_low, "eps_high": eps_high, "aggregation": mode}
    (loss, aux), grad = _value_and_grad(
        lambda lp: naive_pg_trust_region_loss(lp, behaviour, adv, mask, **kw), logp
    )
    loss_bt, grad_bt, dropped = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T), bool)
    for b, t in zip(*np.nonzero(mask), strict=True):
        r, a = math.exp(float(logp[b, t]) - float(behaviour[b, t])), float(adv[b])
        assert min(abs(r - 1 - eps_high), abs(r - 1 + eps_low)) > 1e-4  # no float32 tie
        dropped[b, t] = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
        if not dropped[b, t]:
            loss_bt[b, t], grad_bt[b, t] = -a * float(logp[b, t]), -a
    _check(loss, grad, loss_bt, grad_bt, mask, mode)
    assert dropped.any() and (mask & ~dropped).any()
    np.testing.assert_allclose(float(aux["clip_fraction"]), dropped.sum() / mask.sum(), rtol=1e-6)
    # naive_pg's gradient on the kept tokens, none on the dropped ones ...
    _, naive = _value_and_grad(
        lambda lp: naive_pg_loss(lp, behaviour, adv, mask, aggregation=mode), logp
    )
    np.testing.assert_array_equal(np.asarray(grad)[~dropped], np.asarray(naive)[~dropped])
    assert np.all(np.asarray(grad)[dropped] == 0.0)
    # ... and PPO-clip's divided by the ratio: the same trust region, no importance weight.
    _, ppo = _value_and_grad(lambda lp: ppo_clip_loss(lp, behaviour, adv, mask, **kw), logp)
    ratio = np.exp(np.where(mask, logp - behaviour, 0.0).astype(np.float64))
    np.testing.assert_allclose(np.asarray(ppo) / ratio, np.asarray(grad), rtol=1e-5, atol=1e-8)
    ours, ppos = (
        inspect.signature(f).parameters for f in (naive_pg_trust_region_loss, ppo_clip_loss)
    )
    assert all(ours[k].default == ppos[k].default for k in ("eps_low", "eps_high"))


def test_ppo_recompute_clips_against_the_learners_own_logps():
    logp, behaviour, mask, adv = _inputs(12, scale=2.0)
    proximal = (logp + np.random.default_rng(12).normal(0, 0.3, (B, T))).astype(np.float32)
    (loss, _), grad = _value_and_grad(
        lambda lp: ppo_recompute_loss(lp, behaviour, adv, mask, proximal_logp=proximal), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        u = math.exp(float(logp[b, t]) - float(proximal[b, t]))
        loss_bt[b, t], grad_bt[b, t] = _ref_ppo_token(u, float(adv[b]), 0.8, 1.2, None)
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")


def test_ppo_recompute_at_the_batch_start_is_naive_pg():
    # One update a batch: the proximal log-probs are the current ones, the ratio is 1.
    logp, behaviour, mask, adv = _inputs(13, scale=2.0)
    _, grad = _value_and_grad(
        lambda lp: ppo_recompute_loss(
            lp, behaviour, adv, mask, proximal_logp=jax.lax.stop_gradient(lp)
        ),
        logp,
    )
    _, naive = _value_and_grad(lambda lp: naive_pg_loss(lp, behaviour, adv, mask), logp)
    grad_bt = np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        grad_bt[b, t] = -float(adv[b])
    coef = _coefficients(mask, "token-mean")
    np.testing.assert_allclose(np.asarray(grad, np.float64), grad_bt * coef, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(naive, np.float64), grad_bt * coef, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------- CISPO


def test_cispo_weight_is_clipped_and_stop_gradient():
    logp, behaviour, mask, adv = _inputs(5, scale=0.8)
    (loss, aux), grad = _value_and_grad(
        lambda lp: cispo_loss(lp, behaviour, adv, mask, eps_low=0.3, eps_high=0.2), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    clipped = 0
    for b, t in zip(*np.nonzero(mask), strict=True):
        r = math.exp(float(logp[b, t]) - float(behaviour[b, t]))
        w = min(max(r, 0.7), 1.2)
        clipped += w != r
        loss_bt[b, t] = -w * adv[b] * float(logp[b, t])
        # Only the log-prob is differentiated: clipped tokens keep their gradient.
        grad_bt[b, t] = -w * adv[b]
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")
    assert clipped > 0 and np.all(np.asarray(grad)[mask] != 0.0)
    np.testing.assert_allclose(float(aux["clip_fraction"]), clipped / mask.sum(), rtol=1e-6)


# ----------------------------------------------------------------------------------- GSPO


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.05)])
def test_gspo_token_form_matches_sequence_reference(eps):
    logp, behaviour, mask, adv = _inputs(6, scale=0.15)
    (loss, aux), grad = _value_and_grad(
        lambda lp: gspo_loss(lp, behaviour, adv, mask, eps_low=eps[0], eps_high=eps[1]), logp
    )
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    seq_ratios = []
    for b in range(B):
        tokens = np.nonzero(mask[b])[0]
        if len(tokens) == 0:
            continue
        s = math.exp(np.mean([float(logp[b, t]) - float(behaviour[b, t]) for t in tokens]))
        seq_ratios.append(s)
        value, g = _ref_ppo_token(s, float(adv[b]), 1 - eps[0], 1 + eps[1], None)
        for t in tokens:
            # d s / d logp_t = s / n_b: with seq-mean-token-mean the 1/n_b is in the coefficient.
            loss_bt[b, t], grad_bt[b, t] = value, g
    _check(loss, grad, loss_bt, grad_bt, mask, "seq-mean-token-mean")
    np.testing.assert_allclose(float(aux["ratio_mean"]), np.mean(seq_ratios), rtol=1e-5)


# ----------------------------------------------------------------------------------- TOPR


def test_topr_treats_positive_and_negative_samples_differently():
    logp, behaviour, mask, adv = _inputs(7, scale=0.4)
    adv[2:] = [1.0, -1.0, -0.5, 0.7]
    (loss, aux), grad = _value_and_grad(lambda lp: topr_loss(lp, behaviour, adv, mask), logp)
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    truncated = 0
    for b in range(B):
        tokens = np.nonzero(mask[b])[0]
        log_w = sum(float(logp[b, t]) - float(behaviour[b, t]) for t in tokens)
        w = 1.0 if adv[b] >= 0 else min(math.exp(log_w), 1.0)
        truncated += len(tokens) if (adv[b] < 0 and log_w > 0) else 0
        for t in tokens:
            loss_bt[b, t] = -w * adv[b] * float(logp[b, t])
            grad_bt[b, t] = -w * adv[b]
    _check(loss, grad, loss_bt, grad_bt, mask, "seq-mean-token-sum")
    np.testing.assert_allclose(float(aux["truncated_fraction"]), truncated / mask.sum(), rtol=1e-6)


def test_topr_ignores_the_ratio_of_positive_samples():
    # A positive sample whose probability collapsed still gets its full SFT gradient; a
    # negative one the current policy has left behind (ratio e^-40) gets almost none.
    logp = np.array([[-50.0, -1.0], [-50.0, -1.0]], np.float32)
    behaviour = np.array([[-10.0, -1.0], [-10.0, -1.0]], np.float32)
    mask = np.ones((2, 2), bool)
    adv = np.array([1.0, -1.0], np.float32)
    grad = np.asarray(jax.jit(jax.grad(lambda lp: topr_loss(lp, behaviour, adv, mask)[0]))(logp))
    np.testing.assert_allclose(grad[0], [-0.5, -0.5], rtol=1e-6)
    assert np.all(np.abs(grad[1]) < 1e-15)


# ----------------------------------------------------------------------------------- BAPO


def _ref_share(ratio, adv_bt, mask, low, high, contribution):
    pos = neg = 0.0
    for b, t in zip(*np.nonzero(mask), strict=True):
        r, a = float(ratio[b, t]), float(adv_bt[b, t])
        if contribution == "unclipped":
            if a > 0 and r <= high:
                pos += r * a
            elif a < 0 and r >= low:
                neg += -r * a
        elif a > 0:
            pos += min(r, high) * a
        elif a < 0:
            neg += -max(r, low) * a
    return pos / (pos + neg) if pos + neg > 0 else 1.0


def _ref_bapo_path(
    ratio, adv_bt, mask, target, contribution, bounds=(0.6, 0.9, 1.2, 3.0), step=0.05
):
    low, low_max, high, high_max = bounds
    path = [(low, high, _ref_share(ratio, adv_bt, mask, low, high, contribution))]
    while path[-1][2] < target and (low < low_max - 1e-9 or high < high_max - 1e-9):
        if low < low_max - 1e-9:
            low = min(low + step, low_max)
        else:
            high = min(high + step, high_max)
        path.append((low, high, _ref_share(ratio, adv_bt, mask, low, high, contribution)))
    return path


@pytest.mark.parametrize("contribution", ["unclipped", "clamped"])
def test_bapo_matches_reference(contribution):
    logp, behaviour, mask, adv = _inputs(8, scale=0.7)
    adv = np.abs(adv) * np.array([1, 1, -1, -1, -1, 1], np.float32)  # negative-heavy batch
    (loss, aux), grad = _value_and_grad(
        lambda lp: bapo_loss(
            lp, behaviour, adv, mask, target_positive_share=0.5, contribution=contribution
        ),
        logp,
    )
    ratio = np.exp(np.where(mask, logp.astype(np.float64) - behaviour, 0.0))
    path = _ref_bapo_path(ratio, _adv_bt(adv), mask, 0.5, contribution)
    low, high, share = path[-1]
    assert len(path) > 1  # the search moved
    np.testing.assert_allclose(float(aux["clip_low"]), low, rtol=1e-5)
    np.testing.assert_allclose(float(aux["clip_high"]), high, rtol=1e-5)
    np.testing.assert_allclose(float(aux["positive_share"]), share, rtol=1e-4)
    assert float(aux["search_steps"]) == len(path) - 1
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        loss_bt[b, t], grad_bt[b, t] = _ref_ppo_token(ratio[b, t], float(adv[b]), low, high, 3.0)
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")


_bapo_bounds_jit = jax.jit(
    lambda a, b, d, m: bapo_clip_bounds(a, b, d, m, target_positive_share=0.6)
)


@given(
    ell=hnp.arrays(np.float32, (4, 5), elements=st.floats(-1.5, 1.5, width=32)),
    adv=hnp.arrays(np.float32, (4,), elements=st.sampled_from([-2.0, -0.5, 0.0, 0.3, 1.0])),
    mask=hnp.arrays(np.bool_, (4, 5)),
)
def test_bapo_property_reaches_target_or_stops_at_limits(ell, adv, mask):
    zeros = np.zeros_like(ell)
    out = _bapo_bounds_jit(ell, zeros, adv, mask)
    low, high, share = float(out.clip_low), float(out.clip_high), float(out.positive_share)
    assert 0.6 - 1e-6 <= low <= 0.9 + 1e-6 and 1.2 - 1e-6 <= high <= 3.0 + 1e-6
    ratio = np.exp(ell.astype(np.float64))
    adv_bt = np.broadcast_to(adv[:, None], (4, 5))
    ref_share = _ref_share(ratio, adv_bt, mask, low, high, "unclipped")
    assert share == pytest.approx(ref_share, rel=1e-4, abs=1e-6)
    at_limits = low == pytest.approx(0.9) and high == pytest.approx(3.0)
    assert share >= 0.6 - 1e-5 or at_limits
    if int(out.num_steps) > 0:  # it stopped at the first point that reached the target
        prev_low, prev_high = (
            (low - 0.05, high) if high == pytest.approx(1.2) else (low, high - 0.05)
        )
        prev_high = max(prev_high, 1.2)
        assert _ref_share(ratio, adv_bt, mask, prev_low, prev_high, "unclipped") < 0.6 + 1e-5


# ----------------------------------------------------------------------------------- M2PO


def test_m2po_mask_variant_matches_reference():
    logp, behaviour, mask, adv = _inputs(9, scale=0.4)
    (loss, aux), grad = _value_and_grad(
        lambda lp: m2po_loss(lp, behaviour, adv, mask, tau_m2=0.04), logp
    )
    ell = np.where(mask, logp.astype(np.float64) - behaviour, 0.0)
    kept = {(b, t) for b, t in zip(*np.nonzero(mask), strict=True)}
    while kept and np.mean([ell[i] ** 2 for i in kept]) >= 0.04:
        kept.remove(max(kept, key=lambda i: ell[i] ** 2))
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in kept:
        r = math.exp(ell[b, t])
        loss_bt[b, t], grad_bt[b, t] = -adv[b] * r, -adv[b] * r
    # The normaliser counts every valid token, the dropped ones included (paper's Eq.).
    _check(loss, grad, loss_bt, grad_bt, mask, "token-mean")
    assert 0 < len(kept) < mask.sum()
    np.testing.assert_allclose(float(aux["masked_fraction"]), 1 - len(kept) / mask.sum(), rtol=1e-6)
    assert float(aux["m2_after"]) < 0.04


def test_m2po_harmful_budget_variant_clips_with_the_official_bounds():
    logp, behaviour, mask, adv = _inputs(10, scale=0.4)
    (loss, aux), grad = _value_and_grad(
        lambda lp: m2po_loss(lp, behaviour, adv, mask, tau_m2=0.02, variant="harmful_budget"),
        logp,
    )
    ell = np.where(mask, logp.astype(np.float64) - behaviour, 0.0)
    harmful = sorted(
        ell[b, t] ** 2
        for b, t in zip(*np.nonzero(mask), strict=True)
        if (adv[b] > 0 and ell[b, t] > 0) or (adv[b] < 0 and ell[b, t] < 0)
    )
    n = len(harmful)
    assert np.mean(harmful) > 0.02
    k = next(k for k in range(n) if harmful[k] * (n - k - 1) + sum(harmful[: k + 1]) >= 0.02 * n)
    tau = math.sqrt(harmful[k - 1]) if k else 0.0
    lower, upper = math.exp(-tau), math.exp(tau)
    np.testing.assert_allclose(float(aux["eps_low"]), 1 - lower, rtol=1e-4)
    np.testing.assert_allclose(float(aux["eps_high"]), upper - 1, rtol=1e-4)
    loss_bt, grad_bt = np.zeros((B, T)), np.zeros((B, T))
    for b, t in zip(*np.nonzero(mask), strict=True):
        loss_bt[b, t], grad_bt[b, t] = _ref_ppo_token(
            math.exp(ell[b, t]), float(adv[b]), lower, upper, None
        )
    # The token defining tau sits on the bound; its gradient depends on rounding.
    on_bound = np.isclose(np.abs(ell), tau, rtol=1e-5, atol=0)
    grad = np.where(on_bound, 0.0, np.asarray(grad))
    grad_bt = np.where(on_bound, 0.0, grad_bt)
    coef = _coefficients(mask, "token-mean")
    np.testing.assert_allclose(float(loss), np.sum(coef * loss_bt), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad, coef * grad_bt, rtol=2e-5, atol=1e-7)


# ------------------------------------------------------------------------------------- TB


def test_trajectory_balance_matches_reference():
    logp, behaviour, mask, _ = _inputs(11)
    rng = np.random.default_rng(11)
    reference = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    rewards = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], np.float32)
    group_ids = np.array([30, 30, -2, -2, 30, 77], np.int32)  # id 77 is a singleton
    beta = 0.5
    (loss, aux), grad = _value_and_grad(
        lambda lp: trajectory_balance_loss(
            lp, behaviour, rewards, mask, reference_logp=reference, group_ids=group_ids, beta=beta
        ),
        logp,
    )
    valid = mask.any(-1)
    d = np.array(
        [
            sum(float(logp[b, t]) - float(reference[b, t]) for t in np.nonzero(mask[b])[0])
            - rewards[b] / beta
            for b in range(B)
        ]
    )
    residual = np.zeros(B)
    for b in range(B):
        if valid[b]:
            members = [j for j in range(B) if valid[j] and group_ids[j] == group_ids[b]]
            residual[b] = d[b] - np.mean(d[members])
    n = valid.sum()
    np.testing.assert_allclose(float(loss), np.sum(residual**2) / n, rtol=1e-5)
    expected_grad = np.where(mask, 2 * residual[:, None] / n, 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
    assert residual[5] == 0.0 and np.all(np.asarray(grad)[5] == 0.0)  # singleton group
    assert np.isfinite(float(aux["log_z_mean"]))


def test_trajectory_balance_ignores_the_behaviour_policy():
    logp, behaviour, mask, _ = _inputs(12)
    rewards = np.linspace(0, 1, B).astype(np.float32)
    tb = jax.jit(
        lambda bl: trajectory_balance_loss(
            logp, bl, rewards, mask, reference_logp=logp - 0.1, group_ids=np.zeros(B, np.int32)
        )[0]
    )
    assert float(tb(behaviour)) == float(tb(behaviour - 5.0))


# ------------------------------------------------------------------------- validation


def test_rejects_bad_arguments():
    logp, behaviour, mask, adv = _inputs(13)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(logp, behaviour, adv, mask, eps_low=-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, behaviour, adv, mask, dual_clip=0.9)
    with pytest.raises(ValueError, match="'mean'.*expected one of"):
        cispo_loss(logp, behaviour, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(logp, behaviour, adv[:3], mask)
    with pytest.raises(ValueError, match="low_start"):
        bapo_loss(logp, behaviour, adv, mask, low_start=0.95)
    with pytest.raises(ValueError, match="Python number"):
        bapo_clip_bounds(logp, behaviour, adv, mask, high_step=jnp.float32(0.1))
    with pytest.raises(ValueError, match="'clip'"):
        m2po_loss(logp, behaviour, adv, mask, variant="clip")
    with pytest.raises(ValueError, match="beta"):
        trajectory_balance_loss(
            logp,
            behaviour,
            adv,
            mask,
            reference_logp=logp,
            group_ids=np.zeros(B, np.int32),
            beta=0.0,
        )
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        decoupled_ppo_loss(logp, behaviour, adv, mask, proximal_logp=logp, behaviour_weight_cap=0)
