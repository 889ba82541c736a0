"""GAC around the optimizer (`alignment_controlled`): a true skip, the applied-update cosine.

The skip is checked as `optax.apply_if_finite`'s is: after a skipped step the params and
the whole inner state (Adam's moments and count, an injected schedule's step) equal what
they were, bit for bit. The applied-update cosine is checked against a float64 NumPy Adam.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gac_jax.learner.optimizer import OptimizerConfig, make_optimizer
from gac_jax.transforms import (
    REGIME_PROJECT,
    REGIME_SKIP,
    GACConfig,
    alignment_controlled,
    alignment_statistics,
    gradient_alignment_control,
    scale_by_ess,
)

PARAMS = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}


def _grads(seed, steps, persistence):
    """g_t = persistence * g_{t-1} + noise (float32 trees like PARAMS)."""
    rng = np.random.default_rng(seed)
    out, previous = [], None
    for _ in range(steps):
        noise = {k: rng.normal(size=v.shape) for k, v in PARAMS.items()}
        g = noise if previous is None else {k: persistence * previous[k] + noise[k] for k in noise}
        out.append({k: jnp.asarray(v, jnp.float32) for k, v in g.items()})
        previous = g
    return out


def _same(a, b):
    return all(
        bool(jnp.array_equal(x, y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _run(tx, grads, params=PARAMS, **extra):
    state = tx.init(params)
    step = jax.jit(tx.update)
    history = []
    for g in grads:
        updates, new_state = step(g, state, params, **extra)
        new_params = optax.apply_updates(params, updates)
        history.append((params, state, new_params, new_state))
        params, state = new_params, new_state
    return history


INNERS = {
    "adamw": lambda: optax.adamw(1e-2, b1=0.9),
    "injected_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.schedules.linear_schedule(1e-2, 1e-3, 20)  # Moves every step.
    ),
}


def _passes_over_memory(tx):
    """XLA's bytes accessed by the compiled update, in units of the one leaf's bytes."""
    params, grads = {"w": jnp.zeros((256, 256))}, {"w": jnp.ones((256, 256))}
    cost = jax.jit(tx.update).lower(grads, tx.init(params), params).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"] / (4 * 256 * 256)


def test_a_control_that_cannot_skip_leaves_the_skips_selects_out():
    """With monitors only, or a control with skip off, nothing can skip: the program holds
    no select over Adam's two moments (each would read the old and new moment and write
    one, 6 passes over memory in all)."""
    adamw = lambda: optax.adamw(1e-3)  # noqa: E731
    skipping = _passes_over_memory(alignment_controlled(adamw(), gradient_alignment_control()))
    for control in (None, gradient_alignment_control(skip=False)):
        assert _passes_over_memory(alignment_controlled(adamw(), control)) <= skipping - 6


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_a_skipped_step_keeps_params_and_the_whole_optimizer_state(inner):
    # Identical gradients: cosine 1 from the second step on, every one of them skipped.
    grads = [_grads(0, 1, 0.0)[0]] * 5
    tx = alignment_controlled(INNERS[inner](), gradient_alignment_control(0.1, 0.5))
    history = _run(tx, grads)
    for t, (params, state, new_params, new_state) in enumerate(history):
        stats = alignment_statistics(new_state)
        if t == 0:
            assert float(stats["gac_skipped"]) == 0.0 and not _same(params, new_params)
            continue
        assert float(stats["gac_skipped"]) == 1.0 and int(stats["gac_regime"]) == REGIME_SKIP
        assert _same(params, new_params)
        assert _same(state.gac_inner_state, new_state.gac_inner_state)
    assert int(history[-1][3].gac_skipped_steps) == 4


def test_the_bare_transform_in_a_chain_still_moves_the_params():
    # Why the wrapper exists: a zero gradient handed to Adam still applies its momentum.
    grads = [_grads(0, 1, 0.0)[0]] * 3
    chain = optax.chain(gradient_alignment_control(0.1, 0.5), optax.adamw(1e-2))
    params, _, new_params, _ = _run(chain, grads)[-1]
    assert not _same(params, new_params)


def test_the_learners_chain_skips_truly_with_its_schedule():
    config = OptimizerConfig(schedule="warmup_cosine", warmup_steps=2, decay_steps=10)
    tx = make_optimizer(config, GACConfig(tau_low=0.1, tau_high=0.5))
    grads = [_grads(1, 1, 0.0)[0]] * 4
    history = _run(tx, grads)
    for params, state, new_params, new_state in history[1:]:
        assert float(alignment_statistics(new_state)["gac_skipped"]) == 1.0
        assert _same(params, new_params)
        inner = optax.tree.get(new_state, "gac_inner_state")
        assert _same(optax.tree.get(state, "gac_inner_state"), inner)
    # The schedule did not advance over the skips: the next rate is the second step's.
    inner = optax.tree.get(history[-1][3], "gac_inner_state")
    assert int(inner.count) == 1 and int(inner.inner_state[0].count) == 1


def test_skip_in_a_chain_with_clip_and_ess_scaling():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        alignment_controlled(optax.adamw(1e-2), gradient_alignment_control(0.1, 0.5)),
        scale_by_ess(),
    )
    grads = [_grads(2, 1, 0.0)[0]] * 3
    log_w = jnp.asarray([0.0, 1.0, -1.0])
    params, state, new_params, new_state = _run(tx, grads, log_importance_weights=log_w)[-1]
    assert _same(params, new_params)
    assert _same(
        optax.tree.get(state, "gac_inner_state"), optax.tree.get(new_state, "gac_inner_state")
    )


def _numpy_adam_updates(grads, lr, b1, b2, eps):
    """Adam's updates in float64, written out (Kingma and Ba, Algorithm 1)."""
    keys = sorted(grads[0])
    flat = [np.concatenate([np.asarray(g[k], np.float64).ravel() for k in keys]) for g in grads]
    m, v, out = np.zeros_like(flat[0]), np.zeros_like(flat[0]), []
    for t, g in enumerate(flat, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        out.append(-lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps))
    return out


def _cos(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def test_applied_update_cosine_matches_a_numpy_adam():
    grads = _grads(3, 8, 0.3)
    tx = alignment_controlled(optax.adam(1e-2, b1=0.9, b2=0.999, eps=1e-8))
    history = _run(tx, grads)
    reference = _numpy_adam_updates(grads, 1e-2, 0.9, 0.999, 1e-8)
    for t, (*_, new_state) in enumerate(history):
        want = 0.0 if t == 0 else _cos(reference[t], reference[t - 1])
        got = float(alignment_statistics(new_state)["gac_update_cosine"])
        np.testing.assert_allclose(got, want, atol=2e-5)
        raw = (
            0.0
            if t == 0
            else _cos(
                *(
                    np.concatenate([np.ravel(g[k]) for k in sorted(g)])
                    for g in (grads[t], grads[t - 1])
                )
            )
        )
        np.testing.assert_allclose(
            float(alignment_statistics(new_state)["gac_cosine"]), raw, atol=2e-5
        )
    # Momentum aligns consecutive applied updates far more than the raw gradients.
    stats = [alignment_statistics(s) for *_, s in history[2:]]
    assert np.median([float(s["gac_update_cosine"]) for s in stats]) > np.median(
        [float(s["gac_cosine"]) for s in stats]
    )


def test_control_of_applied_updates_projects_what_the_params_get():
    grads = _grads(4, 10, 0.3)
    tau_low = 0.5
    control = gradient_alignment_control(tau_low, 1.0, reference="update")
    tx = alignment_controlled(optax.adam(1e-2), control, acts_on="update")
    history = _run(tx, grads)
    projected = 0
    for t in range(1, len(history)):
        applied = [
            np.concatenate([np.ravel(np.asarray(p[k] - q[k], np.float64)) for k in sorted(p)])
            for p, q in ((history[t][2], history[t][0]), (history[t - 1][2], history[t - 1][0]))
        ]
        assert _cos(*applied) <= tau_low + 1e-4  # Consecutive applied steps, as applied.
        projected += int(alignment_statistics(history[t][3])["gac_update_regime"]) == REGIME_PROJECT
    assert projected > 0


@pytest.mark.parametrize("after_skip", ["observed", "held"])
def test_reference_after_a_skip(after_skip):
    g0, g1 = _grads(5, 2, 0.0)
    tx = alignment_controlled(
        optax.adam(1e-2),
        gradient_alignment_control(0.1, 0.5),
        reference_after_skip=after_skip,
    )
    # g0, then g0 again (skipped), then g1: compared with g0 either way here, so make the
    # skipped gradient differ from the applied one.
    skipped = {k: g0[k] * 2.0 + 0.01 * g1[k] for k in g0}
    history = _run(tx, [g0, skipped, g1])
    assert float(alignment_statistics(history[1][3])["gac_skipped"]) == 1.0
    flat = lambda g: np.concatenate([np.ravel(np.asarray(g[k], np.float64)) for k in sorted(g)])  # noqa: E731
    expected_reference = skipped if after_skip == "observed" else g0
    want = _cos(flat(g1), flat(expected_reference))
    np.testing.assert_allclose(
        float(alignment_statistics(history[2][3])["gac_cosine"]), want, atol=2e-5
    )


def test_config_acts_where_it_says_and_refuses_bad_choices():
    config = GACConfig(tau_low=0.1, tau_high=0.5, acts_on="update", reference="update")
    tx = config.wrap(optax.adam(1e-2))
    history = _run(tx, [_grads(6, 1, 0.0)[0]] * 3)
    stats = alignment_statistics(history[-1][3])
    assert int(stats["gac_regime"]) == 0  # The gradient level only monitors.
    assert int(stats["gac_update_regime"]) == REGIME_SKIP and float(stats["gac_skipped"]) == 1.0
    for field, bad in (("acts_on", "params"), ("reference_after_skip", "never")):
        with pytest.raises(ValueError, match=f"{field}="):
            GACConfig(**{field: bad}).validate()


def test_an_injected_control_skips_and_holds_its_reference_the_same():
    grads = _grads(7, 6, 0.0)
    grads = [grads[0], grads[0], grads[1], grads[1], grads[2], grads[2]]  # Repeats: skips.

    def run(control):
        tx = alignment_controlled(optax.adam(1e-2), control, reference_after_skip="held")
        return [alignment_statistics(s) for *_, s in _run(tx, grads)]

    plain = run(gradient_alignment_control(0.1, 0.5))
    injected = run(optax.inject_hyperparams(gradient_alignment_control)(tau_low=0.1, tau_high=0.5))
    assert [float(s["gac_skipped"]) for s in plain] == [0, 1, 0, 1, 0, 1]
    for a, b in zip(plain, injected, strict=True):
        for name in ("gac_skipped", "gac_regime", "gac_cosine", "gac_update_cosine"):
            np.testing.assert_allclose(float(a[name]), float(b[name]), rtol=1e-5, atol=1e-6)
