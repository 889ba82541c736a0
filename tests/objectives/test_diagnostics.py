"""Off-policy diagnostics against float64 loop references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gac_jax.objectives import (
    clip_fractions,
    kl_behaviour_current,
    mask_fraction,
    off_policy_diagnostics,
    ratio_statistics,
    second_moment,
    sequence_ess,
)


def _inputs(seed, batch=6, length=5, scale=0.4):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.8, (batch, length)).astype(np.float32)
    behaviour = (logp + rng.normal(0.0, scale, (batch, length))).astype(np.float32)
    mask = rng.random((batch, length)) > 0.3
    mask[0] = False
    return logp, behaviour, mask


def _valid_log_ratios(logp, behaviour, mask):
    return [float(logp[i]) - float(behaviour[i]) for i in zip(*np.nonzero(mask), strict=True)]


_all = jax.jit(off_policy_diagnostics)


def test_sequence_ess_matches_reference():
    logp, behaviour, mask = _inputs(0)
    got = jax.jit(sequence_ess)(logp, behaviour, mask)
    weights = []
    for b in range(logp.shape[0]):
        if mask[b].any():
            weights.append(
                math.exp(
                    sum(_valid_log_ratios(logp[b : b + 1], behaviour[b : b + 1], mask[b : b + 1]))
                )
            )
    ess = sum(weights) ** 2 / sum(w * w for w in weights)
    np.testing.assert_allclose(float(got["ess"]), ess, rtol=1e-5)
    np.testing.assert_allclose(float(got["ess_ratio"]), ess / len(weights), rtol=1e-5)


def test_sequence_ess_is_stable_for_huge_log_weights():
    logp = np.array([[1e4, 0.0], [0.0, 0.0], [-1e4, 0.0]], np.float32)
    behaviour = np.zeros_like(logp)
    got = jax.jit(sequence_ess)(logp, behaviour, np.ones_like(logp, bool))
    # One weight dominates by e^10000: a single effective sample out of three.
    np.testing.assert_allclose(float(got["ess"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(got["ess_ratio"]), 1 / 3, rtol=1e-6)


def test_ratio_statistics_match_reference():
    logp, behaviour, mask = _inputs(1, scale=0.8)
    got = jax.jit(lambda a, b, m: ratio_statistics(a, b, m, quantiles=(0.1, 0.5, 0.95)))(
        logp, behaviour, mask
    )
    ratios = np.exp(np.array(_valid_log_ratios(logp, behaviour, mask)))
    np.testing.assert_allclose(float(got["ratio_mean"]), ratios.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(got["ratio_min"]), ratios.min(), rtol=1e-5)
    np.testing.assert_allclose(float(got["ratio_max"]), ratios.max(), rtol=1e-5)
    for q in (0.1, 0.5, 0.95):
        np.testing.assert_allclose(
            float(got[f"ratio_q{100 * q:g}"]), np.quantile(ratios, q), rtol=1e-5
        )
    np.testing.assert_allclose(
        float(got["log_ratio_abs_max"]), np.abs(np.log(ratios)).max(), rtol=1e-5
    )


def test_second_moment_and_kl_match_reference():
    logp, behaviour, mask = _inputs(2)
    ell = np.array(_valid_log_ratios(logp, behaviour, mask))
    np.testing.assert_allclose(
        float(jax.jit(second_moment)(logp, behaviour, mask)), np.mean(ell**2), rtol=1e-5
    )
    kl = jax.jit(kl_behaviour_current)(logp, behaviour, mask)
    # k1 is a mean of signed log-ratios: tolerance against their magnitudes, not their mean.
    np.testing.assert_allclose(
        float(kl["kl_k1"]), np.mean(-ell), rtol=1e-5, atol=1e-5 * np.mean(np.abs(ell))
    )
    np.testing.assert_allclose(float(kl["kl_k3"]), np.mean(np.exp(ell) - 1 - ell), rtol=1e-5)


def test_clip_fractions_match_reference():
    logp, behaviour, mask = _inputs(3, scale=1.0)
    adv = np.array([1.0, -1.0, 0.5, -2.0, 0.0, -0.3], np.float32)
    got = jax.jit(
        lambda a, b, d, m: clip_fractions(a, b, d, m, eps_low=0.2, eps_high=0.28, dual_clip=2.0)
    )(logp, behaviour, adv, mask)
    low = high = dual = n = 0
    for b, t in zip(*np.nonzero(mask), strict=True):
        r = math.exp(float(logp[b, t]) - float(behaviour[b, t]))
        n += 1
        high += adv[b] > 0 and r > 1.28
        low += adv[b] < 0 and r < 0.8
        dual += adv[b] < 0 and r > 2.0
    assert low and high and dual
    np.testing.assert_allclose(float(got["clip_fraction_low"]), low / n, rtol=1e-6)
    np.testing.assert_allclose(float(got["clip_fraction_high"]), high / n, rtol=1e-6)
    np.testing.assert_allclose(float(got["clip_fraction"]), (low + high) / n, rtol=1e-6)
    np.testing.assert_allclose(float(got["dual_clip_fraction"]), dual / n, rtol=1e-6)


def test_mask_fraction():
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    kept = np.array([[1, 0, 0], [0, 0, 1]], bool)
    assert float(mask_fraction(mask, kept)) == pytest.approx(2 / 3)
    assert float(mask_fraction(np.zeros((2, 3), bool), kept)) == 0.0


def test_everything_is_finite_and_neutral_without_valid_tokens():
    logp, behaviour, _ = _inputs(4)
    got = _all(logp, behaviour, np.zeros(logp.shape, bool))
    assert all(np.isfinite(float(v)) for v in got.values())
    assert float(got["ess_ratio"]) == 1.0 and float(got["ratio_q50"]) == 1.0
    assert float(got["num_valid_tokens"]) == 0.0 and float(got["m2"]) == 0.0


def test_diagnostics_carry_no_gradient_and_survive_huge_log_probs():
    logp, behaviour, mask = _inputs(5)
    logp[1, :], behaviour[1, :] = 1e4, -1e4
    mask[1, :] = True
    got = _all(logp, behaviour, mask)
    assert all(np.isfinite(float(v)) for v in got.values())
    grad = jax.jit(
        jax.grad(
            lambda a: sum(jnp.sum(v) for v in off_policy_diagnostics(a, behaviour, mask).values())
        )
    )(logp)
    assert np.all(np.asarray(grad) == 0.0)
