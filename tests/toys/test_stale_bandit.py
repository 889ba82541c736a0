"""The contextual-bandit toy: it learns, it is reproducible, its lag is real."""

import numpy as np
import optax
import pytest

import gac_jax
from gac_jax.toys import BanditConfig, run_stale_bandit


def _chain():
    return optax.chain(gac_jax.gradient_alignment_monitor(), optax.adam(3e-3))


def test_learns_and_is_reproducible():
    config = BanditConfig(steps=60, num_contexts=16, batch_contexts=16, seed=3)
    first = run_stale_bandit(config, _chain)
    second = run_stale_bandit(config, _chain)
    np.testing.assert_array_equal(first.reward, second.reward)
    np.testing.assert_array_equal(first.cosine, second.cosine)
    assert first.reward[-10:].mean() > first.reward[:10].mean() + 0.2
    assert np.all(first.ess_ratio == 1.0)  # Synchronous: behaviour policy = current policy.


def test_staleness_makes_importance_weights_unequal():
    config = BanditConfig(steps=40, num_contexts=16, batch_contexts=16, staleness=6)
    result = run_stale_bandit(config, _chain)
    # Steps 0..6 train on version 0 samples; the gap, and with it the weights, only grows.
    assert result.ess_ratio[0] == 1.0
    assert np.all(result.ess_ratio[10:] < 1.0)


def test_gac_in_the_chain_reports_regimes():
    config = BanditConfig(steps=30, num_contexts=16, batch_contexts=16, staleness=4)
    result = run_stale_bandit(
        config,
        lambda: optax.chain(gac_jax.gradient_alignment_control(0.05, 0.9), optax.adam(3e-3)),
    )
    assert set(np.unique(result.regime)) <= {0, 1, 2}
    projected = result.regime == 1
    assert projected.any()
    np.testing.assert_allclose(result.cosine_after[projected], 0.05, atol=1e-3)


def test_bad_config_is_an_error():
    with pytest.raises(ValueError, match="batch_contexts=100"):
        run_stale_bandit(BanditConfig(batch_contexts=100), _chain)
    with pytest.raises(ValueError, match="staleness=-1"):
        run_stale_bandit(BanditConfig(staleness=-1), _chain)
