"""Gradient Alignment Control against an independent float64 NumPy reference."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gac_jax
from gac_jax.transforms import (
    REGIME_NONFINITE,
    REGIME_PASS,
    REGIME_PROJECT,
    REGIME_SKIP,
    gradient_alignment_control,
    gradient_alignment_monitor,
    set_gac_reference,
)

# --------------------------------------------------------------------------------------
# The reference: float64, one flat vector per control unit, partial projection found by
# bisection on the cosine (not by the closed form the library uses).


def _cos(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(np.dot(a, b) / (na * nb))


def _reference_control(g, r, tau_low, tau_high, projection, skip):
    """Returns (emitted, regime) for one control unit, float64."""
    c = _cos(g, r)
    if skip and c > tau_high:
        return np.zeros_like(g), REGIME_SKIP
    if c <= tau_low:
        return g.copy(), REGIME_PASS
    full_alpha = np.dot(g, r) / np.dot(r, r)
    if projection == "full":
        return g - full_alpha * r, REGIME_PROJECT
    lo, hi = 0.0, full_alpha  # cos(g - a r, r) falls monotonically from c to 0 on [0, hi].
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _cos(g - mid * r, r) > tau_low:
            lo = mid
        else:
            hi = mid
    return g - 0.5 * (lo + hi) * r, REGIME_PROJECT


class ReferenceGAC:
    """Multi-step float64 GAC over a dict of arrays."""

    def __init__(self, tau_low, tau_high, projection, skip, reference, scope, ema_decay=0.9):
        self.args = (tau_low, tau_high, projection, skip)
        self.reference_mode, self.scope, self.ema_decay = reference, scope, ema_decay
        self.ref = None

    def step(self, grads):
        keys = sorted(grads)
        g = {k: np.asarray(grads[k], np.float64).ravel() for k in keys}
        if self.ref is None:
            self.ref = {k: np.zeros_like(g[k]) for k in keys}
        r = self.ref
        out, regimes = {}, []
        if self.scope == "global":
            flat_g = np.concatenate([g[k] for k in keys])
            flat_r = np.concatenate([r[k] for k in keys])
            flat_out, regime = _reference_control(flat_g, flat_r, *self.args)
            offsets = np.cumsum([0] + [g[k].size for k in keys])
            for i, k in enumerate(keys):
                out[k] = flat_out[offsets[i] : offsets[i + 1]]
            regimes = [regime] * len(keys)
        else:
            for k in keys:
                out[k], regime = _reference_control(g[k], r[k], *self.args)
                regimes.append(regime)
        flat = lambda tree: np.concatenate([tree[k] for k in keys])  # noqa: E731
        cosine, cosine_after = _cos(flat(g), flat(r)), _cos(flat(out), flat(r))
        new_ref = {}
        for k, regime in zip(keys, regimes, strict=True):
            if self.reference_mode == "gradient":
                new_ref[k] = g[k]
            elif self.reference_mode == "update":
                new_ref[k] = r[k] if regime == REGIME_SKIP else out[k]
            else:
                new_ref[k] = self.ema_decay * r[k] + (1 - self.ema_decay) * g[k]
        self.ref = new_ref
        shaped = {k: out[k].reshape(np.shape(grads[k])) for k in keys}
        return shaped, max(regimes), cosine, cosine_after


def _correlated_grads(seed, steps, shapes, persistence):
    """Gradient sequence g_t = persistence * g_{t-1} + noise: cosines over the whole range."""
    rng = np.random.default_rng(seed)
    grads, previous = [], None
    for t in range(steps):
        noise = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
        if previous is None:
            current = noise
        else:
            p = persistence[t % len(persistence)]
            current = {k: (p * previous[k] + noise[k]).astype(np.float32) for k in shapes}
        grads.append(current)
        previous = current
    return grads


SHAPES = {"dense": (6, 5), "bias": (5,), "embed": (3, 4, 2)}


@pytest.mark.parametrize("projection", ["partial", "full"])
@pytest.mark.parametrize("reference", ["gradient", "update", "ema"])
@pytest.mark.parametrize("scope", ["global", "per_leaf"])
@pytest.mark.parametrize("skip", [True, False])
def test_matches_float64_reference(projection, reference, scope, skip):
    tau_low, tau_high = 0.3, 0.85
    grads = _correlated_grads(0, 12, SHAPES, persistence=[0.0, 0.8, 3.0, 20.0, -2.0, 1.0])
    tx = gradient_alignment_control(
        tau_low, tau_high, projection=projection, skip=skip, reference=reference, scope=scope
    )
    ref = ReferenceGAC(tau_low, tau_high, projection, skip, reference, scope)
    state = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    update = jax.jit(tx.update)
    seen = set()
    for g in grads:
        out, state = update({k: jnp.asarray(v) for k, v in g.items()}, state)
        want, regime, cosine, cosine_after = ref.step(g)
        # float32 rounding of g - alpha r is relative to the inputs, not to the difference.
        scale = max(np.abs(v).max() for v in g.values())
        for k in SHAPES:
            np.testing.assert_allclose(out[k], want[k], rtol=1e-4, atol=1e-5 * scale)
        assert int(state.gac_regime) == regime
        # An "update" reference is an earlier output, which carries the projection's
        # rounding (checked above to 1e-5 of the inputs' scale, not of the output's).
        np.testing.assert_allclose(
            state.gac_cosine, cosine, atol=1e-5 if reference == "gradient" else 1e-4
        )
        if reference == "gradient":  # The carried |r|^2 is the stored reference's.
            stored = jax.tree.leaves(state.gac_reference)
            measured = [np.sum(np.square(x, dtype=np.float64)) for x in stored]
            np.testing.assert_allclose(state.gac_reference_sq, measured, rtol=1e-5)
        # Projecting a nearly parallel gradient is ill-conditioned: float32 loses digits
        # in proportion to 1 / (1 - |c|) (c = 0.99998 leaves about three).
        tol = 1e-4 + 5e-8 / max(1 - abs(cosine), 1e-9)
        np.testing.assert_allclose(state.gac_cosine_after, cosine_after, atol=tol)
        seen.add(regime)
    # The sequence is built to exercise every regime the configuration allows.
    assert REGIME_PASS in seen and REGIME_PROJECT in seen
    assert (REGIME_SKIP in seen) == skip
    counts = [state.gac_pass_count, state.gac_project_count, state.gac_skip_count]
    assert sum(int(c) for c in counts) == len(grads)


def _with_reference(tx, params, reference):
    return set_gac_reference(tx.init(params), reference)


# Two lengths only: every new shape is a new compilation, and the properties do not
# depend on the length.
finite_vectors = hnp.arrays(
    np.float32,
    st.sampled_from([7, 40]),
    elements=st.floats(-100, 100, width=32, allow_subnormal=False),
)


@given(
    data=st.data(),
    g=finite_vectors,
    tau_low=st.floats(0.0, 0.9),
    projection=st.sampled_from(["partial", "full"]),
)
def test_projection_caps_cosine_and_keeps_orthogonal_part(data, g, tau_low, projection):
    r = data.draw(hnp.arrays(np.float32, g.shape, elements=st.floats(-100, 100, width=32)))
    g64, r64 = g.astype(np.float64), r.astype(np.float64)
    assume(np.linalg.norm(g64) > 1e-3 and np.linalg.norm(r64) > 1e-3)
    tx = gradient_alignment_control(tau_low, 1.0, projection=projection)
    state = _with_reference(tx, jnp.zeros(g.shape), jnp.asarray(r))
    out, state = jax.jit(tx.update)(jnp.asarray(g), state)
    out = np.asarray(out, np.float64)
    unit_r = r64 / np.linalg.norm(r64)
    target = tau_low if projection == "partial" else 0.0
    assert _cos(out, r64) <= max(target, _cos(g64, r64)) + 1e-4 * (1 + np.linalg.norm(g64))
    if _cos(g64, r64) > tau_low:
        # Projection only moves the update along r: the orthogonal component is untouched.
        ortho_in = g64 - np.dot(g64, unit_r) * unit_r
        ortho_out = out - np.dot(out, unit_r) * unit_r
        np.testing.assert_allclose(ortho_out, ortho_in, atol=1e-4 * (1 + np.abs(g64).max()))
    else:
        np.testing.assert_array_equal(out, g64)


@given(g=finite_vectors, flip=st.booleans(), scale=st.floats(0.01, 10))
def test_orthogonal_or_opposed_gradient_passes_unchanged(g, flip, scale):
    g64 = g.astype(np.float64)
    assume(np.linalg.norm(g64) > 1e-3)
    if flip:  # Opposed: the reference points the other way.
        r = (-scale * g64).astype(np.float32)
    else:  # Orthogonal: Gram-Schmidt a random vector against g.
        r64 = np.random.default_rng(0).normal(size=g.shape)
        r = (r64 - np.dot(r64, g64) / np.dot(g64, g64) * g64).astype(np.float32)
        assume(np.linalg.norm(r) > 1e-3 and abs(_cos(g64, r)) < 1e-3)
    tx = gradient_alignment_control(0.05, 0.5)
    state = _with_reference(tx, jnp.zeros(g.shape), jnp.asarray(r))
    out, state = jax.jit(tx.update)(jnp.asarray(g), state)
    np.testing.assert_array_equal(np.asarray(out), g)
    assert int(state.gac_regime) == REGIME_PASS


def test_skip_yields_zero_update_and_counts():
    tx = gradient_alignment_control(0.1, 0.5)
    g = {"a": jnp.arange(1.0, 7.0).reshape(2, 3), "b": jnp.ones(3)}
    state = tx.init(g)
    update = jax.jit(tx.update)
    out, state = update(g, state)
    assert int(state.gac_regime) == REGIME_PASS  # First step: zero reference.
    np.testing.assert_array_equal(out["a"], g["a"])
    out, state = update(jax.tree.map(lambda x: 2 * x, g), state)
    assert int(state.gac_regime) == REGIME_SKIP
    for leaf in jax.tree.leaves(out):
        np.testing.assert_array_equal(leaf, 0.0)
    assert (int(state.gac_pass_count), int(state.gac_skip_count)) == (1, 1)
    np.testing.assert_allclose(state.gac_cosine, 1.0, atol=1e-6)
    np.testing.assert_allclose(state.gac_cosine_after, 0.0)


def test_zero_gradient_and_zero_reference_pass():
    tx = gradient_alignment_control(0.1, 0.5)
    params = {"a": jnp.zeros(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    out, state = update({"a": jnp.ones(4)}, state)  # Zero reference.
    np.testing.assert_array_equal(out["a"], 1.0)
    out, state = update({"a": jnp.zeros(4)}, state)  # Zero gradient.
    np.testing.assert_array_equal(out["a"], 0.0)
    assert int(state.gac_regime) == REGIME_PASS and float(state.gac_cosine) == 0.0
    assert int(state.gac_pass_count) == 2


@pytest.mark.parametrize("reference", ["gradient", "update", "ema"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradient_never_corrupts_reference(reference, bad):
    tx = gradient_alignment_control(0.1, 0.5, reference=reference)
    update = jax.jit(tx.update)
    state = tx.init({"a": jnp.zeros(3)})
    _, state = update({"a": jnp.array([1.0, 0.0, 0.0])}, state)
    before = np.asarray(state.gac_reference["a"])
    before_sq = np.asarray(state.gac_reference_sq)
    out, state = update({"a": jnp.array([bad, 1.0, 0.0])}, state)
    np.testing.assert_array_equal(state.gac_reference["a"], before)
    np.testing.assert_array_equal(state.gac_reference_sq, before_sq)
    assert int(state.gac_regime) == REGIME_NONFINITE
    assert int(state.gac_nonfinite_count) == 1
    assert np.isnan(state.gac_cosine)
    # The bad gradient goes downstream unchanged (optax.apply_if_finite can drop it) ...
    np.testing.assert_array_equal(np.asarray(out["a"])[1:], [1.0, 0.0])
    # ... and the next finite step is compared with the last good reference.
    out, state = update({"a": jnp.array([0.0, 1.0, 0.0])}, state)
    assert int(state.gac_regime) == REGIME_PASS
    np.testing.assert_array_equal(out["a"], [0.0, 1.0, 0.0])


def test_monitor_records_cosine_without_changing_gradient():
    tx = gradient_alignment_monitor()
    update = jax.jit(tx.update)
    g = {"a": jnp.array([1.0, 2.0, 3.0])}
    state = tx.init(g)
    _, state = update(g, state)
    out, state = update(g, state)
    np.testing.assert_array_equal(out["a"], g["a"])
    np.testing.assert_allclose(state.gac_cosine, 1.0, atol=1e-6)
    np.testing.assert_allclose(state.gac_cosine_after, 1.0, atol=1e-6)
    assert int(state.gac_regime) == REGIME_PASS


@pytest.mark.parametrize("reference", ["gradient", "update", "ema"])
def test_monitor_emits_its_input_and_carries_its_references_norms(reference):
    """A monitor's output is its input bit for bit (signed zeros included), and with the
    "gradient" or "update" reference the |r|^2 it carries instead of re-measuring is the
    stored reference's own."""
    tx = gradient_alignment_monitor(reference=reference)
    update = jax.jit(tx.update)
    grads = _correlated_grads(3, 6, SHAPES, persistence=[0.0, 2.0, -1.0])
    state = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    for g in grads:
        g = {k: jnp.asarray(v).at[(0,) * len(v.shape)].set(-0.0) for k, v in g.items()}
        out, state = update(g, state)
        for k in SHAPES:
            assert np.asarray(out[k]).tobytes() == np.asarray(g[k]).tobytes()
        if reference != "ema":
            stored = jax.tree.leaves(state.gac_reference)
            measured = [np.sum(np.square(x, dtype=np.float64)) for x in stored]
            np.testing.assert_allclose(state.gac_reference_sq, measured, rtol=1e-6)


def test_adaptive_thresholds_follow_low_cosines_and_never_rise():
    tau_low, tau_high = 0.4, 0.9
    tx = gradient_alignment_control(
        tau_low, tau_high, thresholds="adaptive", adaptive_k=2.0, adaptive_warmup=5
    )
    update = jax.jit(tx.update)
    rng = np.random.default_rng(1)
    state = tx.init({"a": jnp.zeros(256)})
    cosines = []
    for _ in range(30):  # Independent gradients: cosines near 0, std about 1/16.
        _, state = update({"a": jnp.asarray(rng.normal(size=256), jnp.float32)}, state)
        cosines.append(float(state.gac_cosine))
    low, high = float(state.gac_tau_low), float(state.gac_tau_high)
    assert 0.0 <= low < tau_low - 0.1  # Slid well below the configured band.
    np.testing.assert_allclose(high - low, tau_high - tau_low, rtol=1e-6)
    # An aligned stretch raises the statistics, but never the band above its configuration.
    g = rng.normal(size=256).astype(np.float32)
    for _ in range(40):
        _, state = update({"a": jnp.asarray(g)}, state)
        assert float(state.gac_tau_low) <= tau_low + 1e-7
        assert float(state.gac_tau_high) <= tau_high + 1e-7


def test_adaptive_warmup_uses_fixed_thresholds():
    tx = gradient_alignment_control(0.3, 0.7, thresholds="adaptive", adaptive_warmup=100)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(2)
    state = tx.init({"a": jnp.zeros(64)})
    for _ in range(5):
        _, state = update({"a": jnp.asarray(rng.normal(size=64), jnp.float32)}, state)
    np.testing.assert_allclose([state.gac_tau_low, state.gac_tau_high], [0.3, 0.7])
    assert int(state.gac_stats_count) == 4  # The first step has no reference.


def test_bfloat16_reference_storage():
    tx = gradient_alignment_control(0.2, 0.9, reference_dtype="bfloat16")
    params = {"a": jnp.zeros((4, 8))}
    state = tx.init(params)
    assert state.gac_reference["a"].dtype == jnp.bfloat16
    rng = np.random.default_rng(3)
    g0 = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    g1 = g0 + 0.5 * jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    update = jax.jit(tx.update)
    _, state = update({"a": g0}, state)
    out, state = update({"a": g1}, state)
    assert out["a"].dtype == jnp.float32 and state.gac_reference["a"].dtype == jnp.bfloat16
    want, *_ = _reference_control(
        np.asarray(g1, np.float64).ravel(),
        np.asarray(g0.astype(jnp.bfloat16), np.float64).ravel(),
        0.2,
        0.9,
        "partial",
        True,
    )
    np.testing.assert_allclose(np.asarray(out["a"]).ravel(), want, rtol=1e-3, atol=1e-4)


def test_set_gac_reference_sets_the_norms_the_next_step_uses():
    tx = gradient_alignment_control()  # float32 reference: its norm is carried, not re-read.
    state = tx.init({"a": jnp.zeros(3), "b": jnp.zeros((2, 2))})
    reference = {"a": jnp.array([1.0, 2.0, 2.0]), "b": jnp.full((2, 2), 0.5)}
    grads = {"a": jnp.array([1.0, 2.0, 2.0]), "b": jnp.zeros((2, 2))}
    state = set_gac_reference(state, reference)
    np.testing.assert_allclose(state.gac_reference_sq, [9.0, 1.0])
    _, after = tx.update(grads, state)
    np.testing.assert_allclose(after.gac_cosine, 3.0 / np.sqrt(10.0), rtol=1e-6)
    # Replacing the reference alone leaves the carried norms stale (zero here): the
    # cosine is then wrong, which is why set_gac_reference exists.
    stale = tx.init({"a": jnp.zeros(3), "b": jnp.zeros((2, 2))})._replace(gac_reference=reference)
    _, after = tx.update(grads, stale)
    assert float(after.gac_cosine) == 0.0
    # Lower-precision storage: the leaves are cast, the norms measured on the cast values.
    tx16 = gradient_alignment_control(reference_dtype="bfloat16")
    state16 = set_gac_reference(tx16.init({"a": jnp.zeros(3)}), {"a": jnp.array([1.0, 0.1, 0.0])})
    assert state16.gac_reference["a"].dtype == jnp.bfloat16
    cast = np.asarray(state16.gac_reference["a"], np.float64)
    np.testing.assert_allclose(state16.gac_reference_sq, [np.sum(cast**2)], rtol=1e-6)
    with pytest.raises(ValueError):
        set_gac_reference(state, {"a": jnp.zeros(3)})


def test_injected_and_plain_forms_agree():
    kwargs = dict(projection="partial", reference="ema", scope="per_leaf")
    plain = gradient_alignment_control(0.25, 0.75, **kwargs)
    injected = optax.inject_hyperparams(gradient_alignment_control)(
        tau_low=0.25, tau_high=0.75, ema_decay=0.9, **kwargs
    )
    grads = _correlated_grads(4, 8, SHAPES, persistence=[1.5, 0.2, 5.0])
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    s_plain, s_injected = plain.init(params), injected.init(params)
    step_plain, step_injected = jax.jit(plain.update), jax.jit(injected.update)
    for g in grads:
        g = {k: jnp.asarray(v) for k, v in g.items()}
        out_plain, s_plain = step_plain(g, s_plain)
        out_injected, s_injected = step_injected(g, s_injected)
        # Constants fold differently from traced values: equal up to float32 rounding.
        for k in SHAPES:
            np.testing.assert_allclose(out_injected[k], out_plain[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            optax.tree.get(s_injected, "gac_cosine"),
            optax.tree.get(s_plain, "gac_cosine"),
            rtol=1e-6,
        )
    # The hyperparameter really is a traced input: changing it changes the result.
    s_injected.hyperparams["tau_low"] = jnp.asarray(0.0)
    s_injected.hyperparams["tau_high"] = jnp.asarray(0.01)
    g = {k: jnp.asarray(v) for k, v in grads[-1].items()}
    out, s_injected = step_injected(g, s_injected)
    assert int(optax.tree.get(s_injected, "gac_regime")) == REGIME_SKIP


def test_statistics_readable_with_optax_tree_get():
    tx = optax.chain(optax.clip_by_global_norm(1.0), gradient_alignment_control())
    state = tx.init({"a": jnp.zeros(3)})
    for name in ("gac_cosine", "gac_cosine_after", "gac_regime", "gac_skip_count"):
        assert optax.tree.get(state, name).shape == ()


def test_chain_under_jit_with_adamw_and_ess():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        gac_jax.gradient_alignment_control(0.2, 0.8),
        optax.adamw(1e-2),
        gac_jax.scale_by_ess(rho_base=0.9),
    )
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads, log_w):
        updates, state = tx.update(grads, state, params, log_importance_weights=log_w)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(5)
    base = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}
    for t in range(4):
        grads = {k: jnp.asarray(v * (1 + t), jnp.float32) for k, v in base.items()}
        log_w = jnp.asarray([0.0, 0.0, 3.0, -3.0])
        params, state = step(params, state, grads, log_w)
    assert int(optax.tree.get(state, "gac_skip_count")) == 3  # Identical directions.
    ess = (np.exp([0, 0, 3, -3]).sum() ** 2) / np.exp(2 * np.array([0, 0, 3, -3])).sum()
    np.testing.assert_allclose(optax.tree.get(state, "ess_ratio"), ess / 4, rtol=1e-5)
    np.testing.assert_allclose(
        optax.tree.get(state, "ess_scale"), np.sqrt(ess / 4 / 0.9), rtol=1e-5
    )
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_abstract_init_on_shape_dtype_structs():
    tx = gradient_alignment_control(reference_dtype="bfloat16")
    abstract = {"a": jax.ShapeDtypeStruct((3, 2), jnp.float32)}
    shapes = jax.eval_shape(tx.init, abstract)
    assert shapes.gac_reference["a"].shape == (3, 2)
    assert shapes.gac_reference["a"].dtype == jnp.bfloat16
    concrete = tx.init(abstract)  # Direct init from the abstract tree makes zeros.
    np.testing.assert_array_equal(concrete.gac_reference["a"], np.zeros((3, 2)))


def test_sharded_state_keeps_param_shardings():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    specs = {"w": P("fsdp", "tensor"), "b": P("tensor"), "scale": P()}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    params = {
        "w": jax.device_put(jnp.ones((8, 6)), shardings["w"]),
        "b": jax.device_put(jnp.ones(6), shardings["b"]),
        "scale": jax.device_put(jnp.ones(()), shardings["scale"]),
    }
    tx = optax.chain(gradient_alignment_control(scope="per_leaf"), optax.adamw(1e-3))
    state = tx.init(params)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in params.items()
    }
    from_abstract = tx.init(abstract)
    for s in (state, from_abstract):
        for k in specs:
            assert s[0].gac_reference[k].sharding.is_equivalent_to(shardings[k], params[k].ndim)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(6)
    for _ in range(2):
        grads = {
            k: jax.device_put(jnp.asarray(rng.normal(size=v.shape), jnp.float32), shardings[k])
            for k, v in params.items()
        }
        updates, state = update(grads, state, params)
    for k in specs:
        assert state[0].gac_reference[k].sharding.is_equivalent_to(shardings[k], params[k].ndim)
        assert updates[k].sharding.is_equivalent_to(shardings[k], params[k].ndim)
    # Sharded and single-device runs compute the same thing.
    single = tx.init(jax.device_get(params))
    single_update = jax.jit(tx.update)
    rng = np.random.default_rng(6)
    for _ in range(2):
        grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
        single_out, single = single_update(grads, single, jax.device_get(params))
    for k in specs:
        np.testing.assert_allclose(updates[k], single_out[k], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(tau_low=0.6, tau_high=0.4), "tau_low=0.6"),
        (dict(tau_low=0.5, tau_high=0.5), "tau_low=0.5"),
        (dict(tau_low=-1.5), "tau_low=-1.5"),
        (dict(tau_low=-0.2), "tau_low=-0.2"),
        (dict(tau_high=1.2), "tau_high=1.2"),
        (dict(projection="half"), "projection='half'"),
        (dict(reference="momentum"), "reference='momentum'"),
        (dict(scope="layer"), "scope='layer'"),
        (dict(thresholds="auto"), "thresholds='auto'"),
        (dict(ema_decay=1.0), "ema_decay=1.0"),
        (dict(adaptive_decay=-0.1), "adaptive_decay=-0.1"),
    ],
)
def test_invalid_arguments_name_the_value(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        gradient_alignment_control(**kwargs)
