"""KL estimators and the KL penalty against float64 references."""

import jax
import numpy as np
import pytest

from gac_jax.objectives import KL_ESTIMATORS, kl_estimate, kl_penalty


def _reference_kl(logp, ref, estimator):
    out = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        log_r = ref[idx] - logp[idx]
        if estimator == "k1":
            out[idx] = -log_r
        elif estimator == "k2":
            out[idx] = 0.5 * log_r**2
        else:
            out[idx] = np.exp(log_r) - 1.0 - log_r
    return out


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_estimators_match_reference(estimator):
    rng = np.random.default_rng(0)
    logp = rng.normal(-2.0, 1.0, size=(3, 6))
    ref = logp + rng.normal(0.0, 0.7, size=(3, 6))
    got = jax.jit(lambda a, b: kl_estimate(a, b, estimator=estimator))(logp, ref)
    np.testing.assert_allclose(
        np.asarray(got), _reference_kl(logp, ref, estimator), rtol=2e-5, atol=1e-6
    )


def test_k3_estimates_the_true_kl_of_a_categorical():
    # E_{y~p}[k3] = KL(p || q) exactly, for the sampling distribution p.
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    k3 = np.asarray(kl_estimate(np.log(p), np.log(q), estimator="k3"))
    np.testing.assert_allclose(np.sum(p * k3), np.sum(p * np.log(p / q)), rtol=1e-5)


def test_k3_stays_finite_and_keeps_its_gradient_sign_beyond_the_clamp():
    logp = np.array([-1e4, 0.0, -30.0])
    ref = np.array([0.0, -1e4, 0.0])
    value, grad = jax.jit(
        jax.value_and_grad(lambda lp: kl_estimate(lp, ref, estimator="k3").sum())
    )(logp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    # True gradient d/dlogp (e^{ref-logp} - 1 - (ref - logp)) = 1 - e^{ref - logp}.
    assert np.all(np.sign(np.asarray(grad)) == np.sign(1.0 - np.exp(np.clip(ref - logp, -50, 50))))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_penalty_is_coef_times_token_mean(estimator):
    rng = np.random.default_rng(1)
    logp = rng.normal(-1.0, 0.5, size=(4, 5))
    ref = logp + rng.normal(0.0, 0.3, size=(4, 5))
    mask = rng.random((4, 5)) > 0.3
    loss, aux = jax.jit(lambda a, b, m: kl_penalty(a, b, m, estimator=estimator, coef=0.1))(
        logp, ref, mask
    )
    per_token = _reference_kl(logp, ref, estimator)
    kept = np.array([per_token[i] for i in zip(*np.nonzero(mask), strict=True)])
    expected = np.mean(kept)
    # k1's terms are signed: tolerance against their magnitudes, not their mean.
    atol = 1e-5 * np.mean(np.abs(kept))
    np.testing.assert_allclose(float(loss), 0.1 * expected, rtol=1e-5, atol=0.1 * atol)
    np.testing.assert_allclose(float(aux["kl"]), expected, rtol=1e-5, atol=atol)


def test_penalty_gradient_is_zero_on_padded_tokens():
    logp = np.array([[-1.0, 1e4, -2.0]])
    ref = np.array([[-1.5, -1e4, -1.0]])
    mask = np.array([[True, False, True]])
    grad = jax.jit(jax.grad(lambda lp: kl_penalty(lp, ref, mask, coef=1.0)[0]))(logp)
    grad = np.asarray(grad)
    assert grad[0, 1] == 0.0 and np.all(np.isfinite(grad))
    # k3 gradient 1 - e^{ref - logp}, averaged over 2 valid tokens.
    np.testing.assert_allclose(grad[0, [0, 2]], (1 - np.exp(ref - logp))[0, [0, 2]] / 2, rtol=1e-5)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(np.zeros(2), np.zeros(2), estimator="k4")
    with pytest.raises(ValueError, match="coef"):
        kl_penalty(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), coef=-1.0)
