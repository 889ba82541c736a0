"""VCPO's ESS step scaling and the ESS it rests on, against float64 NumPy."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax import effective_sample_size, scale_by_ess


def _reference_ess(log_w, mask=None):
    log_w = np.asarray(log_w, np.float64)
    if mask is not None:
        log_w = log_w[np.asarray(mask, bool)]
    if log_w.size == 0:
        return 0.0, 1.0
    w = np.exp(log_w - log_w.max())  # Shift: the ratio is invariant, float64 stays finite.
    ess = w.sum() ** 2 / (w * w).sum()
    return ess, ess / log_w.size


log_weight_vectors = hnp.arrays(
    np.float32, st.sampled_from([1, 5, 64]), elements=st.floats(-1e4, 1e4, width=32)
)


@given(log_w=log_weight_vectors, data=st.data())
def test_ess_matches_reference_and_lies_in_range(log_w, data):
    mask = data.draw(hnp.arrays(np.bool_, log_w.shape))
    result = jax.jit(effective_sample_size)(jnp.asarray(log_w), jnp.asarray(mask))
    ess, ratio = _reference_ess(log_w, mask)
    np.testing.assert_allclose(result.ess, ess, rtol=1e-4)
    np.testing.assert_allclose(result.ess_ratio, ratio, rtol=1e-4)
    n = int(mask.sum())
    assert result.num_valid == n
    if n:
        assert 1.0 - 1e-5 <= float(result.ess) <= n * (1 + 1e-5)


@given(value=st.floats(-1e4, 1e4, width=32), n=st.sampled_from([1, 2, 50]))
def test_equal_weights_give_full_sample_size(value, n):
    result = jax.jit(effective_sample_size)(jnp.full((n,), value, jnp.float32))
    np.testing.assert_allclose(result.ess, n, rtol=1e-5)
    np.testing.assert_allclose(result.ess_ratio, 1.0, rtol=1e-5)


def test_ess_mask_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        effective_sample_size(jnp.zeros(4), jnp.ones(3, bool))


@pytest.mark.parametrize("power, exponent", [("sqrt", 0.5), ("linear", 1.0), (0.25, 0.25)])
@pytest.mark.parametrize("rho_base", [1.0, 0.55])
def test_scale_matches_formula(power, exponent, rho_base):
    tx = scale_by_ess(rho_base=rho_base, power=power)
    updates = {"w": jnp.arange(6.0).reshape(2, 3)}
    state = tx.init(updates)
    step = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for spread in (0.0, 0.5, 2.0, 8.0):
        log_w = (spread * rng.normal(size=16)).astype(np.float32)
        out, state = step(updates, state, log_importance_weights=jnp.asarray(log_w))
        _, rho = _reference_ess(log_w)
        scale = min(1.0, rho / rho_base) ** exponent
        np.testing.assert_allclose(state.ess_ratio, rho, rtol=1e-5)
        np.testing.assert_allclose(state.ess_scale, scale, rtol=1e-5)
        np.testing.assert_allclose(out["w"], scale * np.arange(6.0).reshape(2, 3), rtol=1e-5)
    assert int(state.ess_count) == 4


@given(rho=st.floats(0.0, 1.0), rho_base=st.floats(0.01, 1.0))
def test_scale_is_one_at_or_above_base_and_below_one_under_it(rho, rho_base):
    tx = scale_by_ess(rho_base=rho_base)
    state = tx.init({"w": jnp.ones(2)})
    out, state = jax.jit(tx.update)({"w": jnp.ones(2)}, state, ess_ratio=jnp.float32(rho))
    if np.float32(rho) >= np.float32(rho_base):
        assert float(state.ess_scale) == 1.0
    else:
        assert 0.0 <= float(state.ess_scale) < 1.0
    np.testing.assert_allclose(out["w"], float(state.ess_scale))


def test_masked_sequences_are_excluded():
    tx = scale_by_ess(rho_base=1.0, power="linear")
    state = tx.init({"w": jnp.ones(1)})
    log_w = jnp.asarray([0.0, 0.0, 50.0, 0.0])  # The outlier is padding.
    mask = jnp.asarray([True, True, False, True])
    _, state = jax.jit(tx.update)(
        {"w": jnp.ones(1)}, state, log_importance_weights=log_w, sequence_mask=mask
    )
    np.testing.assert_allclose(state.ess_ratio, 1.0)
    np.testing.assert_allclose(state.ess_scale, 1.0)


@pytest.mark.parametrize("cap", [0.5, 2.0, 8.0])
def test_the_ess_of_truncated_weights(cap):
    # VCPO's `use_clipped` switch: the ESS of min(w, cap), the weights truncated IS trains
    # with; against float64 NumPy on the truncated weights themselves.
    log_w = np.random.default_rng(0).normal(0.0, 2.0, size=32).astype(np.float32)
    tx = scale_by_ess(rho_base=1.0, power="sqrt", truncation_cap=cap)
    _, state = tx.update({"w": jnp.ones(1)}, tx.init(None), log_importance_weights=log_w)
    w = np.minimum(np.exp(log_w.astype(np.float64)), cap)
    expected = w.sum() ** 2 / (w * w).sum() / w.size
    np.testing.assert_allclose(state.ess_ratio, expected, rtol=1e-5)
    _, raw = scale_by_ess().update({"w": jnp.ones(1)}, tx.init(None), log_importance_weights=log_w)
    assert float(state.ess_ratio) > float(raw.ess_ratio)  # Truncation thins the tail.
    with pytest.raises(ValueError, match="truncation_cap"):
        scale_by_ess(truncation_cap=0.0)


def test_ema_of_ratio():
    tx = scale_by_ess(ema_decay=0.5)
    state = tx.init({"w": jnp.ones(1)})
    step = jax.jit(tx.update)
    for rho in (0.8, 0.4, 0.2):
        _, state = step({"w": jnp.ones(1)}, state, ess_ratio=jnp.float32(rho))
    np.testing.assert_allclose(state.ess_ratio_ema, 0.5 * (0.5 * 0.8 + 0.5 * 0.4) + 0.5 * 0.2)


def test_nonfinite_weights_poison_the_update_not_the_ema():
    tx = scale_by_ess()
    state = tx.init({"w": jnp.ones(1)})
    step = jax.jit(tx.update)
    _, state = step({"w": jnp.ones(1)}, state, ess_ratio=jnp.float32(0.5))
    out, state = step({"w": jnp.ones(1)}, state, log_importance_weights=jnp.asarray([0.0, jnp.nan]))
    assert np.isnan(out["w"]).all()
    np.testing.assert_allclose(state.ess_ratio_ema, 0.5)


def _reference_ess_limit(log_w, mask):
    """float64 ESS of weights with infinite logs, as the limit of finite large ones."""
    log_w = np.asarray(log_w, np.float64)[np.asarray(mask, bool)]
    if np.isnan(log_w).any():
        return np.nan, np.nan
    if not log_w.size:
        return 0.0, 1.0
    if np.isneginf(log_w).all():
        return 0.0, 0.0  # Nothing carries weight: the ESS is 0 (the step is scaled to 0).
    # +inf as a log weight far above every finite one (exp underflows the rest to exactly 0
    # in float64), -inf as one far below.
    big = np.abs(log_w[np.isfinite(log_w)]).max(initial=0.0) + 1e4
    finite = np.clip(log_w, -big, big)
    w = np.exp(finite - finite.max())
    ess = w.sum() ** 2 / (w * w).sum()
    return ess, ess / log_w.size


@pytest.mark.parametrize(
    "log_w, mask",
    [
        ([0.0, 1.0, np.inf], None),
        ([0.0, np.inf, 3.0, np.inf], None),
        ([np.inf, np.inf, np.inf], None),
        ([0.0, -np.inf, 1.0, -2.0], None),
        ([-np.inf, -np.inf], None),
        ([-np.inf, np.inf, 5.0], None),
        ([0.0, np.inf, np.inf, 1.0], [True, True, False, True]),
        ([0.0, np.nan, 1.0], [True, False, True]),
        ([0.0, np.nan, np.inf], None),
        ([np.nan, -np.inf], None),
    ],
)
def test_infinite_log_weights_are_their_limit(log_w, mask):
    mask = np.ones(len(log_w), bool) if mask is None else np.asarray(mask)
    log_w32 = jnp.asarray(log_w, jnp.float32)
    result = jax.jit(effective_sample_size)(log_w32, jnp.asarray(mask))
    ess, ratio = _reference_ess_limit(log_w, mask)
    np.testing.assert_allclose(result.ess, ess, rtol=1e-5)
    np.testing.assert_allclose(result.ess_ratio, ratio, rtol=1e-5)
    # The number of +inf entries is the limit itself.
    valid = np.asarray(log_w)[mask]
    if np.isposinf(valid).any() and not np.isnan(valid).any():
        assert float(result.ess) == np.isposinf(valid).sum()


def test_dominant_sequence_gives_a_finite_update():
    tx = scale_by_ess(rho_base=1.0, power="sqrt")
    state = tx.init({"w": jnp.ones(2)})
    out, state = jax.jit(tx.update)(
        {"w": jnp.ones(2)}, state, log_importance_weights=jnp.asarray([0.0, 1.0, jnp.inf])
    )
    # One dominant sequence of three: ESS = 1, rho = 1/3, scale = sqrt(1/3).
    np.testing.assert_allclose(state.ess_ratio, 1.0 / 3.0, rtol=1e-6)
    np.testing.assert_allclose(out["w"], np.sqrt(1.0 / 3.0), rtol=1e-6)
    np.testing.assert_allclose(state.ess_ratio_ema, 1.0 / 3.0, rtol=1e-6)


def test_injected_and_plain_forms_agree():
    plain = scale_by_ess(rho_base=0.7)
    injected = optax.inject_hyperparams(scale_by_ess)(rho_base=0.7, power="sqrt")
    updates = {"w": jnp.ones((2, 2))}
    s_plain, s_injected = plain.init(updates), injected.init(updates)
    log_w = jnp.asarray([0.0, 1.0, -1.0, 4.0])
    out_plain, s_plain = jax.jit(plain.update)(updates, s_plain, log_importance_weights=log_w)
    out_inj, s_injected = jax.jit(injected.update)(
        updates, s_injected, log_importance_weights=log_w
    )
    np.testing.assert_allclose(out_inj["w"], out_plain["w"], rtol=1e-6)
    np.testing.assert_allclose(optax.tree.get(s_injected, "ess_scale"), s_plain.ess_scale)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(rho_base=0.0), "rho_base=0.0"),
        (dict(rho_base=-1.0), "rho_base=-1.0"),
        (dict(rho_base=1.5), "rho_base=1.5"),
        (dict(power="cubic"), "power='cubic'"),
        (dict(power=0.0), "power=0.0"),
        (dict(ema_decay=1.0), "ema_decay=1.0"),
    ],
)
def test_invalid_arguments_name_the_value(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        scale_by_ess(**kwargs)


def test_update_needs_exactly_one_signal():
    tx = scale_by_ess()
    state = tx.init({"w": jnp.ones(1)})
    with pytest.raises(ValueError, match="exactly one"):
        tx.update({"w": jnp.ones(1)}, state)
    with pytest.raises(ValueError, match="exactly one"):
        tx.update({"w": jnp.ones(1)}, state, log_importance_weights=jnp.zeros(2), ess_ratio=0.5)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        tx.update({"w": jnp.ones(1)}, state, log_importance_weights=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="ess_ratio=1.5"):
        tx.update({"w": jnp.ones(1)}, state, ess_ratio=1.5)
