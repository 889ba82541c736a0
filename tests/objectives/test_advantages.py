"""Advantage estimators against float64 loop references over explicit groups."""

import math

import jax
import numpy as np
import pytest

from gac_jax.objectives import (
    dr_grpo_advantages,
    grad_sq_norm_proxy,
    grpo_advantages,
    rloo_advantages,
    sequence_log_ratio,
    vcpo_advantages,
)

_vcpo = jax.jit(vcpo_advantages, static_argnames=("normalize_std", "std_ddof"))


def _groups(ids, where):
    groups = {}
    for i, g in enumerate(ids):
        if where[i]:
            groups.setdefault(int(g), []).append(i)
    return groups


def _std(values, ddof):
    n = len(values)
    if n - ddof <= 0:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof))


def _reference(kind, rewards, ids, where, eps=1e-6, ddof=1, log_w=None, g2=None):
    out = np.zeros(len(rewards))
    for members in _groups(ids, where).values():
        r = [float(rewards[i]) for i in members]
        n, mean, std = len(r), sum(r) / len(r), _std(r, ddof)
        for i in members:
            if kind == "grpo":
                out[i] = 0.0 if n == 1 or std == 0 else (rewards[i] - mean) / (std + eps)
            elif kind == "dr_grpo":
                out[i] = rewards[i] - mean
            elif kind == "rloo":
                others = [float(rewards[j]) for j in members if j != i]
                out[i] = rewards[i] - sum(others) / len(others) if others else 0.0
            else:  # vcpo: weights w^2 |g|^2 in float64, no log-space tricks
                weights = [math.exp(2 * log_w[j]) * g2[j] for j in members]
                total = sum(weights)
                if total > 0:
                    b = (
                        sum(w * float(rewards[j]) for w, j in zip(weights, members, strict=True))
                        / total
                    )
                else:
                    b = mean
                out[i] = 0.0 if std == 0 else (rewards[i] - b) / (std + eps)
    return out


def _data(seed, batch=12):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=batch)
    # Arbitrary, unsorted, negative and large ids; one singleton group (id 99).
    ids = rng.choice(np.array([-7, 3, 1000, 42]), size=batch)
    ids[0] = 99
    where = rng.random(batch) > 0.15
    return rewards, ids.astype(np.int32), where


@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_matches_reference(ddof):
    rewards, ids, where = _data(0)
    adv, aux = jax.jit(lambda r, g, w: grpo_advantages(r, g, where=w, std_ddof=ddof))(
        rewards, ids, where
    )
    np.testing.assert_allclose(
        np.asarray(adv), _reference("grpo", rewards, ids, where, ddof=ddof), rtol=1e-5, atol=1e-6
    )
    assert np.all(np.asarray(adv)[~where] == 0.0)
    assert aux["group_size"].shape == (12,)


def test_dr_grpo_and_rloo_match_reference():
    rewards, ids, where = _data(1)
    for kind, fn in (("dr_grpo", dr_grpo_advantages), ("rloo", rloo_advantages)):
        adv, _ = jax.jit(lambda r, g, w, fn=fn: fn(r, g, where=w))(rewards, ids, where)
        np.testing.assert_allclose(
            np.asarray(adv), _reference(kind, rewards, ids, where), rtol=1e-5, atol=1e-6
        )


def test_grpo_binary_rewards_known_values():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    ids = np.array([5, 5, 5, 5, 8, 8])
    adv, aux = jax.jit(lambda r, g: grpo_advantages(r, g, epsilon=0.0))(rewards, ids)
    std = np.std([1, 0, 0, 0], ddof=1)
    np.testing.assert_allclose(
        np.asarray(adv)[:4], (np.array([1, 0, 0, 0]) - 0.25) / std, rtol=1e-6
    )
    # A group whose rewards are all equal carries no signal.
    assert np.all(np.asarray(adv)[4:] == 0.0)
    np.testing.assert_allclose(np.asarray(aux["baseline"]), [0.25] * 4 + [1.0] * 2)


def test_rloo_is_the_scaled_dr_grpo_advantage():
    rewards, ids, _ = _data(2)
    rloo, aux = jax.jit(rloo_advantages)(rewards, ids)
    dr, _ = jax.jit(dr_grpo_advantages)(rewards, ids)
    n = np.asarray(aux["group_size"])
    expected = np.where(n > 1, n / np.maximum(n - 1, 1) * np.asarray(dr), 0.0)
    np.testing.assert_allclose(np.asarray(rloo), expected, rtol=1e-5, atol=1e-6)


def test_vcpo_matches_reference():
    rewards, ids, where = _data(3)
    rng = np.random.default_rng(3)
    log_w = rng.normal(0.0, 1.0, size=12)
    g2 = rng.uniform(0.5, 3.0, size=12)
    g2[3] = 0.0  # a zero-norm sequence carries no weight
    adv, aux = jax.jit(
        lambda r, g, w, lw, gn: vcpo_advantages(r, g, log_weights=lw, grad_sq_norms=gn, where=w)
    )(rewards, ids, where, log_w, g2)
    expected = _reference("vcpo", rewards, ids, where, ddof=0, log_w=log_w, g2=g2)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=2e-5, atol=1e-6)


def _released_reference(rewards, ids, where, log_w, g2, cap, scope, eps=1e-6):
    """The authors' code, read from mit-han-lab/vcpo (c7f030f, staleness_utils.py L447-491):
    weight min(w, cap)^2 w^2 |g|^2, per group on the rewards or over the batch on the
    group-normalised advantages; float64, no log-space tricks."""
    weight = [
        min(math.exp(lw), cap) ** 2 * math.exp(2 * lw) * g for lw, g in zip(log_w, g2, strict=True)
    ]
    out = np.zeros(len(rewards))
    groups = _groups(ids, where)
    normalised = {}
    for members in groups.values():
        r = [float(rewards[i]) for i in members]
        mean, std = sum(r) / len(r), _std(r, 0)
        for i in members:
            normalised[i] = 0.0 if std == 0 else (rewards[i] - mean) / (std + eps)
        if scope == "group":
            total = sum(weight[i] for i in members)
            b = sum(weight[i] * rewards[i] for i in members) / total if total > 0 else mean
            for i in members:
                out[i] = 0.0 if std == 0 else (rewards[i] - b) / (std + eps)
    if scope == "batch":
        total = sum(weight[i] for i in normalised)
        b = sum(weight[i] * normalised[i] for i in normalised) / total
        for i, a in normalised.items():
            out[i] = a - b
    return out


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_vcpo_released_weights_and_scopes_match_the_authors_code(scope):
    rewards, ids, where = _data(5)
    rng = np.random.default_rng(5)
    log_w = rng.normal(0.5, 1.5, size=12)  # Some weights above the cap of 2.
    g2 = rng.uniform(0.5, 3.0, size=12)
    adv, _ = jax.jit(
        lambda r, g, w, lw, gn: vcpo_advantages(
            r,
            g,
            log_weights=lw,
            grad_sq_norms=gn,
            where=w,
            baseline_weights="released",
            cap=2.0,
            scope=scope,
        )
    )(rewards, ids, where, log_w, g2)
    expected = _released_reference(rewards, ids, where, log_w, g2, 2.0, scope)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=2e-5, atol=2e-6)
    # The paper's weights give another baseline as soon as some weight differs from 1.
    paper, _ = _vcpo(rewards, ids, log_weights=log_w, grad_sq_norms=g2, where=where)
    assert scope == "batch" or not np.allclose(np.asarray(paper), expected, atol=1e-3)


def test_vcpo_reduces_to_grpo_on_policy_with_equal_norms():
    rewards, ids, _ = _data(4)
    adv, _ = _vcpo(rewards, ids, log_weights=np.zeros(12), grad_sq_norms=np.ones(12), std_ddof=1)
    grpo, _ = jax.jit(grpo_advantages)(rewards, ids)
    np.testing.assert_allclose(np.asarray(adv), np.asarray(grpo), rtol=1e-5, atol=1e-6)


def test_vcpo_baseline_follows_the_dominant_weight_for_huge_log_weights():
    rewards = np.array([1.0, 0.0, 0.0, 0.5])
    ids = np.zeros(4, np.int32)
    log_w = np.array([5000.0, -5000.0, 0.0, 4000.0])  # exp(2 * 5000) overflows any float
    adv, aux = _vcpo(rewards, ids, log_weights=log_w, grad_sq_norms=np.ones(4))
    assert np.all(np.isfinite(np.asarray(adv)))
    np.testing.assert_allclose(np.asarray(aux["baseline"]), 1.0)


def test_vcpo_without_std_normalisation():
    rewards, ids, where = _data(5)
    log_w, g2 = np.linspace(-1, 1, 12), np.linspace(1, 2, 12)
    adv, aux = _vcpo(
        rewards, ids, log_weights=log_w, grad_sq_norms=g2, where=where, normalize_std=False
    )
    expected = np.where(where, rewards - np.asarray(aux["baseline"]), 0.0)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-5, atol=1e-6)


def test_vcpo_takes_sequence_log_ratios():
    rng = np.random.default_rng(6)
    logp = rng.normal(-1, 0.3, (4, 5))
    behaviour = logp + rng.normal(0, 0.2, (4, 5))
    mask = rng.random((4, 5)) > 0.2
    log_w = np.asarray(jax.jit(sequence_log_ratio)(logp, behaviour, mask))
    np.testing.assert_allclose(log_w, np.sum(np.where(mask, logp - behaviour, 0), -1), rtol=1e-5)
    adv, _ = _vcpo(
        np.array([1.0, 0.0, 1.0, 0.0]),
        np.array([0, 0, 1, 1]),
        log_weights=log_w,
        grad_sq_norms=grad_sq_norm_proxy(mask),
    )
    assert adv.shape == (4,)


def test_grad_sq_norm_proxies():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_allclose(np.asarray(grad_sq_norm_proxy(mask, proxy="length")), [3, 1, 0])
    np.testing.assert_allclose(
        np.asarray(grad_sq_norm_proxy(mask, proxy="inverse_length")), [1 / 3, 1, 0], rtol=1e-6
    )
    np.testing.assert_allclose(np.asarray(grad_sq_norm_proxy(mask, proxy="uniform")), [1, 1, 0])
    with pytest.raises(ValueError, match="'norm'"):
        grad_sq_norm_proxy(mask, proxy="norm")


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="epsilon"):
        grpo_advantages(np.zeros(2), np.zeros(2, np.int32), epsilon=-1.0)
    with pytest.raises(ValueError, match="std_ddof"):
        grpo_advantages(np.zeros(2), np.zeros(2, np.int32), std_ddof=2)
    with pytest.raises(ValueError, match="integers"):
        grpo_advantages(np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="group_ids"):
        rloo_advantages(np.zeros(2), np.zeros(3, np.int32))
