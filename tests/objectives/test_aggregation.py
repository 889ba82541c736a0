"""Loss aggregation against a float64 loop reference."""

import jax
import numpy as np
import pytest

from gac_jax.objectives import AGGREGATIONS, aggregate


def _reference(loss, mask, mode, max_tokens=None):
    batch, length = loss.shape
    if mode == "token-mean":
        total, count = 0.0, 0
        for b in range(batch):
            for t in range(length):
                if mask[b, t]:
                    total += float(loss[b, t])
                    count += 1
        return total / count if count else 0.0
    if mode == "seq-mean-token-sum-norm":
        total = sum(float(loss[b, t]) for b in range(batch) for t in range(length) if mask[b, t])
        return total / (batch * (max_tokens or length))
    per_seq = []
    for b in range(batch):
        values = [float(loss[b, t]) for t in range(length) if mask[b, t]]
        if not values:
            continue
        per_seq.append(sum(values) / len(values) if mode == "seq-mean-token-mean" else sum(values))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_matches_reference(mode):
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(5, 7))
    mask = rng.random((5, 7)) > 0.4
    mask[2] = False  # a fully padded row must not dilute the sequence means
    got = jax.jit(lambda x, m: aggregate(x, m, mode))(loss, mask)
    np.testing.assert_allclose(float(got), _reference(loss, mask, mode), rtol=1e-5, atol=1e-6)


def test_max_tokens_is_the_constant_normaliser():
    rng = np.random.default_rng(1)
    loss, mask = rng.normal(size=(3, 4)), rng.random((3, 4)) > 0.3
    got = jax.jit(lambda x, m: aggregate(x, m, "seq-mean-token-sum-norm", max_tokens=16))(
        loss, mask
    )
    expected = _reference(loss, mask, "seq-mean-token-sum-norm", max_tokens=16)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_padded_tokens_contribute_exactly_zero(mode):
    rng = np.random.default_rng(2)
    loss, mask = rng.normal(size=(4, 5)), rng.random((4, 5)) > 0.5
    mask[0, 0] = True
    poisoned = np.where(mask, loss, np.inf)
    fn = jax.jit(lambda x, m: aggregate(x, m, mode))
    assert float(fn(poisoned, mask)) == pytest.approx(float(fn(loss, mask)), rel=1e-6)
    grad = jax.jit(jax.grad(lambda x, m: aggregate(x, m, mode)))(poisoned, mask)
    assert np.all(np.asarray(grad)[~mask] == 0.0)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_all_zero_mask_gives_zero(mode):
    assert float(aggregate(np.ones((2, 3)), np.zeros((2, 3), bool), mode)) == 0.0


def test_float_mask_counts_nonzero_as_valid():
    loss = np.arange(6.0).reshape(2, 3)
    mask = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 2.0]])
    assert float(aggregate(loss, mask)) == pytest.approx((0 + 2 + 5) / 3)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'token-sum'.*expected one of"):
        aggregate(np.ones((2, 2)), np.ones((2, 2), bool), "token-sum")
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(np.ones((2, 2)), np.ones((2, 2), bool), "seq-mean-token-sum-norm", max_tokens=0)
    with pytest.raises(ValueError, match="mask"):
        aggregate(np.ones((2, 2)), np.ones((2, 3), bool))
