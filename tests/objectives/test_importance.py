"""Importance ratios, TIS / MIS / IcePop weights and M2PO masks against float64 loops."""

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.objectives import (
    icepop_weights,
    importance_ratio,
    m2po_harmful_clip,
    m2po_mask,
    masked_importance_weights,
    sequence_log_ratio,
    token_log_ratio,
    truncated_importance_weights,
)


def _inputs(seed, batch=5, length=6, scale=0.6):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 1.0, (batch, length)).astype(np.float32)
    behaviour = (logp + rng.normal(0.0, scale, (batch, length))).astype(np.float32)
    mask = rng.random((batch, length)) > 0.25
    mask[0] = False  # a fully padded sequence
    mask[1, :] = False
    mask[1, 2] = True  # a single-token sequence
    return logp, behaviour, mask


def _ref_log_ratios(logp, behaviour, mask, level):
    """float64 per-token log-ratios at `level`, 0 on padded tokens."""
    out = np.zeros(logp.shape)
    for b in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[b, t]]
        diffs = [float(logp[b, t]) - float(behaviour[b, t]) for t in tokens]
        for t, d in zip(tokens, diffs, strict=True):
            if level == "token":
                out[b, t] = d
            elif level == "sequence":
                out[b, t] = sum(diffs)
            else:
                out[b, t] = sum(diffs) / len(diffs)
    return out


def test_log_ratios_match_reference():
    logp, behaviour, mask = _inputs(0)
    got = jax.jit(token_log_ratio)(logp, behaviour, mask)
    np.testing.assert_allclose(
        np.asarray(got), _ref_log_ratios(logp, behaviour, mask, "token"), atol=1e-6
    )
    for mode, level in (("sum", "sequence"), ("mean", "geometric")):
        got = jax.jit(lambda a, b, m, mode=mode: sequence_log_ratio(a, b, m, mode=mode))(
            logp, behaviour, mask
        )
        ref = _ref_log_ratios(logp, behaviour, mask, level)
        expected = [ref[b][mask[b]][0] if mask[b].any() else 0.0 for b in range(5)]
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_importance_ratio_value_and_gradient(level):
    logp, behaviour, mask = _inputs(1)
    ref = np.where(mask, np.exp(_ref_log_ratios(logp, behaviour, mask, level)), 0.0)
    fn = jax.jit(lambda a: importance_ratio(a, behaviour, mask, level=level))
    np.testing.assert_allclose(np.asarray(fn(logp)), ref, rtol=1e-5, atol=1e-7)
    # d/d logp_bt of sum_t' r_bt': token level r_bt; product level n_b * w_b; geometric s_b.
    grad = np.asarray(jax.jit(jax.grad(lambda a: jnp.sum(fn(a))))(logp))
    counts = mask.sum(-1, keepdims=True)
    factor = {"token": 1.0, "sequence": counts, "geometric": 1.0}[level]
    np.testing.assert_allclose(grad, np.where(mask, ref * factor, 0.0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_truncated_weights_match_reference(level):
    logp, behaviour, mask = _inputs(2, scale=1.0)
    out = jax.jit(lambda a, b, m: truncated_importance_weights(a, b, m, cap=1.5, level=level))(
        logp, behaviour, mask
    )
    ell = _ref_log_ratios(logp, behaviour, mask, level)
    expected = np.where(mask, np.minimum(np.exp(ell), 1.5), 0.0)
    np.testing.assert_allclose(np.asarray(out.weights), expected, rtol=1e-5, atol=1e-7)
    assert np.array_equal(np.asarray(out.mask), mask)
    np.testing.assert_allclose(float(out.fraction), np.mean(np.exp(ell[mask]) > 1.5), rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_weights_match_reference(level):
    logp, behaviour, mask = _inputs(3, scale=1.0)
    out = jax.jit(
        lambda a, b, m: masked_importance_weights(a, b, m, cap=2.0, lower=0.5, level=level)
    )(logp, behaviour, mask)
    ratio = np.exp(_ref_log_ratios(logp, behaviour, mask, level))
    keep = mask & (ratio <= 2.0) & (ratio >= 0.5)
    np.testing.assert_array_equal(np.asarray(out.mask), keep)
    np.testing.assert_allclose(
        np.asarray(out.weights), np.where(keep, ratio, 0.0), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(float(out.fraction), np.sum(mask & ~keep) / np.sum(mask), rtol=1e-6)
    if level != "token":  # a rejected sequence loses all of its tokens
        for b in range(5):
            assert out.mask[b][mask[b]].all() or not out.mask[b].any()


def test_icepop_band_matches_reference():
    logp, behaviour, mask = _inputs(4, scale=1.2)
    out = jax.jit(icepop_weights)(logp, behaviour, mask)
    ratio = np.exp(_ref_log_ratios(logp, behaviour, mask, "token"))
    keep = mask & (ratio >= 0.5) & (ratio <= 5.0)
    assert (~keep & mask).any() and keep.any()  # the data exercises both sides
    np.testing.assert_array_equal(np.asarray(out.mask), keep)
    np.testing.assert_allclose(
        np.asarray(out.weights), np.where(keep, ratio, 0.0), rtol=1e-5, atol=1e-7
    )


def test_weights_carry_no_gradient_and_survive_huge_log_probs():
    logp, behaviour, mask = _inputs(5)
    logp[2, 0], behaviour[2, 0] = 1e4, -1e4
    logp[3, 1], behaviour[3, 1] = -1e4, 1e4
    for fn in (truncated_importance_weights, masked_importance_weights, icepop_weights):
        out = jax.jit(fn)(logp, behaviour, mask)
        assert np.all(np.isfinite(np.asarray(out.weights)))
        grad = jax.jit(jax.grad(lambda a, fn=fn: jnp.sum(fn(a, behaviour, mask).weights)))(logp)
        assert np.all(np.asarray(grad) == 0.0)
    seq = jax.jit(lambda a, b, m: truncated_importance_weights(a, b, m, level="sequence"))(
        logp, behaviour, mask
    )
    assert np.all(np.asarray(seq.weights) <= 2.0 + 1e-6)


# ----------------------------------------------------------------------------- M2PO


def _ref_m2po_keep(ell, mask, tau):
    """Greedy loop: drop the largest squared log-ratio while the kept mean is >= tau."""
    kept = {(b, t) for b in range(ell.shape[0]) for t in range(ell.shape[1]) if mask[b, t]}
    while kept and sum(ell[i] ** 2 for i in kept) / len(kept) >= tau:
        kept.remove(max(kept, key=lambda i: ell[i] ** 2))
    keep = np.zeros(mask.shape, bool)
    for i in kept:
        keep[i] = True
    return keep


_m2po_jit = jax.jit(lambda a, b, m, tau: m2po_mask(a, b, m, tau_m2=tau))


def test_m2po_mask_matches_greedy_reference():
    logp, behaviour, mask = _inputs(6, batch=6, length=8, scale=0.4)
    ell = _ref_log_ratios(logp, behaviour, mask, "token")
    for tau in (0.005, 0.04, 0.2):
        out = _m2po_jit(logp, behaviour, mask, np.float32(tau))
        keep = _ref_m2po_keep(ell, mask, tau)
        np.testing.assert_array_equal(np.asarray(out.mask), keep)
        np.testing.assert_allclose(float(out.m2_before), np.mean(ell[mask] ** 2), rtol=1e-5)
        np.testing.assert_allclose(float(out.m2_after), np.mean(ell[keep] ** 2), rtol=1e-5)
        np.testing.assert_allclose(
            float(out.masked_fraction), 1 - keep.sum() / mask.sum(), rtol=1e-6
        )


def test_m2po_mask_keeps_small_values_next_to_a_huge_one():
    # Dropping 4e8 must not cancel the small values that remain (sums run from the bottom).
    logp = np.array([[2e4, 0.1, 0.1, 0.15, 0.0]], np.float32)
    behaviour = np.zeros_like(logp)
    out = _m2po_jit(logp, behaviour, np.ones_like(logp, bool), np.float32(0.04))
    np.testing.assert_array_equal(np.asarray(out.mask), [[False, True, True, True, True]])
    np.testing.assert_allclose(float(out.m2_after), (0.01 + 0.01 + 0.0225) / 4, rtol=1e-5)


_values = hnp.arrays(
    np.float32, (4, 6), elements=st.floats(-1.5, 1.5, width=32).filter(math.isfinite)
)


@given(
    logp=_values,
    behaviour=_values,
    mask=hnp.arrays(np.bool_, (4, 6)),
    tau=st.sampled_from([0.0, 0.01, 0.04, 0.3]),
)
def test_m2po_property_below_threshold_with_fewest_drops_largest_first(logp, behaviour, mask, tau):
    out = _m2po_jit(logp, behaviour, mask, np.float32(tau))
    keep = np.asarray(out.mask)
    m2 = (logp.astype(np.float64) - behaviour) ** 2
    assert not (keep & ~mask).any()
    rtol = 1e-5
    if keep.any():  # the kept second moment is below the threshold
        assert m2[keep].mean() < tau * (1 + rtol) + 1e-7
    dropped = mask & ~keep
    if dropped.any():
        # Largest first: nothing dropped is smaller than anything kept ...
        if keep.any():
            assert m2[dropped].min() >= m2[keep].max() * (1 - rtol) - 1e-7
        # ... and the fewest drops: keeping one more (the smallest dropped) would fail.
        with_one_more = np.append(m2[keep], m2[dropped].min())
        assert with_one_more.mean() >= tau * (1 - rtol) - 1e-7
    assert float(out.m2_after) < tau + 1e-6 or not keep.any()
    assert np.isfinite(float(out.m2_before))


def _ref_harmful(ell, adv, mask, tau, min_low=None, min_high=None):
    """Loop port of M2PO's official ``kpo_clip_harmful_tokens`` (without 1e-12 slacks)."""
    harmful = []
    for b in range(ell.shape[0]):
        for t in range(ell.shape[1]):
            a, d = adv[b], ell[b, t]
            if mask[b, t] and ((a > 0 and d > 0) or (a < 0 and d < 0)):
                harmful.append(d * d)
    n = len(harmful)
    m2_before = sum(harmful) / n if n else 0.0
    tau_c, m2_after = 20.0, m2_before
    if n and m2_before > tau:
        v = sorted(harmful)
        for k in range(n):
            if v[k] * (n - k - 1) + sum(v[: k + 1]) >= tau * n:
                break
        tau_c = math.sqrt(v[k - 1]) if k > 0 else 0.0
        m2_after = (v[k - 1] * (n - k) + sum(v[:k])) / n if k > 0 else 0.0
    eps_low, eps_high = 1 - math.exp(-tau_c), math.exp(tau_c) - 1
    if min_low is not None:
        eps_low = max(eps_low, min_low)
    if min_high is not None:
        eps_high = max(eps_high, min_high)
    return eps_low, eps_high, m2_before, m2_after, tau_c


@pytest.mark.parametrize(
    "tau,min_low,min_high",
    [(0.01, None, None), (0.04, None, None), (0.02, 0.3, 0.5), (5.0, None, None)],
)
def test_m2po_harmful_clip_matches_official_algorithm(tau, min_low, min_high):
    logp, behaviour, mask = _inputs(7, batch=6, length=8, scale=0.4)
    adv = np.array([1.0, -0.5, 0.8, -1.2, 0.3, 0.0], np.float32)
    out = jax.jit(
        lambda a, b, d, m: m2po_harmful_clip(
            a, b, d, m, tau_m2=tau, min_eps_low=min_low, min_eps_high=min_high
        )
    )(logp, behaviour, adv, mask)
    ell = _ref_log_ratios(logp, behaviour, mask, "token")
    eps_low, eps_high, m2_before, m2_after, tau_c = _ref_harmful(
        ell, adv, mask, tau, min_low, min_high
    )
    np.testing.assert_allclose(float(out.eps_low), eps_low, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(out.eps_high), eps_high, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(out.m2_before), m2_before, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(out.m2_after), m2_after, rtol=1e-4, atol=1e-7)
    ratio = np.exp(ell)
    adv_bt = np.broadcast_to(adv[:, None], mask.shape)
    clipped = mask & (
        ((adv_bt > 0) & (ratio > 1 + eps_high)) | ((adv_bt < 0) & (ratio < 1 - eps_low))
    )
    # Tokens sitting on the bound itself are decided by rounding; compare the others.
    clear = np.abs(np.abs(ell) - tau_c) > 1e-4
    np.testing.assert_array_equal(np.asarray(out.mask)[clear], (mask & ~clipped)[clear])
    if tau < 1.0:
        assert clipped.any()  # the budget binds in these cases


def test_rejects_bad_arguments():
    logp, behaviour, mask = _inputs(8)
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(logp, behaviour, mask, cap=0.0)
    with pytest.raises(ValueError, match="'seq'"):
        truncated_importance_weights(logp, behaviour, mask, level="seq")
    with pytest.raises(ValueError, match="band is empty"):
        icepop_weights(logp, behaviour, mask, low=3.0, high=2.0)
    with pytest.raises(ValueError, match="tau_m2"):
        m2po_mask(logp, behaviour, mask, tau_m2=-0.1)
    with pytest.raises(ValueError, match="behaviour_logp"):
        token_log_ratio(logp, behaviour[:, :3], mask)
    with pytest.raises(ValueError, match="mask"):
        token_log_ratio(logp, behaviour, mask[:, :3])
