"""The random-skip control (`random_skip`): its Markov chain against a float64 NumPy
reference, its skip as GAC's (params and inner state kept bit for bit), its seed, and its
home in the run config."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gac_jax.learner.optimizer import make_optimizer
from gac_jax.transforms import (
    REGIME_SKIP,
    GACConfig,
    alignment_controlled,
    alignment_statistics,
    gradient_alignment_monitor,
    random_skip,
)

PARAMS = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}


def _chain_reference(rate, mean_streak):
    """float64: the transition matrix [[applied->applied, ->skip], [skip->applied, ->skip]],
    its stationary skip rate (an eigenvector, not the closed form) and mean streak."""
    stay = rate if mean_streak is None else 1.0 - 1.0 / mean_streak
    enter = rate if mean_streak is None else rate / (mean_streak * (1.0 - rate))
    matrix = np.array([[1.0 - enter, enter], [1.0 - stay, stay]], np.float64)
    values, vectors = np.linalg.eig(matrix.T)
    stationary = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    return matrix, stationary[1] / stationary.sum(), 1.0 / (1.0 - stay)


def _skips(tx, steps, params=PARAMS):
    """bool [steps]: whether each step was skipped, from a scanned, jitted run."""
    g = jax.tree.map(jnp.ones_like, params)

    def step(state, _):
        _, state = tx.update(g, state, params)
        return state, alignment_statistics(state)["gac_skipped"]

    _, skipped = jax.jit(lambda: jax.lax.scan(step, tx.init(params), None, length=steps))()
    return np.asarray(skipped) > 0


def _streak_lengths(skipped):
    runs = "".join("s" if s else "." for s in skipped).split(".")
    return np.array([len(r) for r in runs if r])


@pytest.mark.parametrize(("rate", "mean_streak"), [(0.436, None), (0.436, 3.7), (0.1, 5.0)])
def test_skip_rate_streaks_and_transitions_match_the_chain(rate, mean_streak):
    steps = 40_000
    matrix, stationary, streak = _chain_reference(rate, mean_streak)
    np.testing.assert_allclose(stationary, rate, rtol=1e-12)  # The chain the factory means.
    skipped = _skips(alignment_controlled(optax.sgd(0.1), random_skip(rate, mean_streak)), steps)
    # Four standard errors; the fraction's variance is widened by the chain's memory.
    memory = matrix[1, 1] - matrix[0, 1]
    error = np.sqrt(rate * (1 - rate) / steps * (1 + memory) / (1 - memory))
    assert abs(skipped.mean() - rate) < 4 * error
    lengths = _streak_lengths(skipped)
    assert abs(lengths.mean() - streak) < 4 * np.sqrt(streak * (streak - 1) / len(lengths) + 1e-12)
    for previous in (0, 1):  # Each transition's frequency.
        after = skipped[1:][skipped[:-1] == previous]
        p = matrix[previous, 1]
        assert abs(after.mean() - p) < 4 * np.sqrt(p * (1 - p) / len(after)) + 1e-12


def test_a_skipped_step_keeps_params_and_inner_state_bit_for_bit():
    rng = np.random.default_rng(0)
    tx = alignment_controlled(optax.adamw(1e-2), random_skip(0.5, 2.0, seed=3))
    monitor = gradient_alignment_monitor()
    state, watched, params, update = (
        tx.init(PARAMS),
        monitor.init(PARAMS),
        PARAMS,
        jax.jit(tx.update),
    )
    streak, seen = 0, set()
    for _ in range(30):
        g = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in PARAMS.items()}
        updates, new_state = update(g, state, params)
        new_params = optax.apply_updates(params, updates)
        stats = alignment_statistics(new_state)
        skipped = bool(stats["gac_skipped"])
        seen.add(skipped)
        same = jax.tree.map(
            np.array_equal, (params, state.gac_inner_state), (new_params, new_state.gac_inner_state)
        )
        assert all(jax.tree.leaves(same)) == skipped
        streak = streak + 1 if skipped else 0
        assert int(stats["gac_skip_streak"]) == streak
        assert (int(stats["gac_regime"]) == REGIME_SKIP) == skipped
        _, watched = monitor.update(g, watched)  # The cosine is a plain monitor's.
        np.testing.assert_allclose(stats["gac_cosine"], watched.gac_cosine, rtol=1e-6, atol=1e-7)
        params, state = new_params, new_state
    assert seen == {True, False}


def test_the_seed_decides_the_skips_and_the_config_passes_it():
    draws = {
        seed: _skips(alignment_controlled(optax.sgd(0.1), random_skip(0.3, seed=seed)), 200)
        for seed in (0, 1)
    }
    assert not np.array_equal(draws[0], draws[1])
    again = _skips(alignment_controlled(optax.sgd(0.1), random_skip(0.3, seed=1)), 200)
    np.testing.assert_array_equal(again, draws[1])
    config = GACConfig(monitor_only=True, random_skip_rate=0.3)
    np.testing.assert_array_equal(_skips(config.wrap(optax.sgd(0.1), seed=1), 200), draws[1])
    chain = make_optimizer(gac=config, seed=1)  # Clip, AdamW (injected rate), the control.
    np.testing.assert_array_equal(_skips(chain, 200), draws[1])


def test_injected_and_plain_draw_the_same():
    plain = random_skip(0.4, 2.5, seed=2)
    injected = optax.inject_hyperparams(random_skip)(0.4, 2.5, seed=2)
    np.testing.assert_array_equal(
        _skips(alignment_controlled(optax.sgd(0.1), injected), 300),
        _skips(alignment_controlled(optax.sgd(0.1), plain), 300),
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(rate=1.0), "rate=1.0"),
        (dict(rate=-0.1), "rate=-0.1"),
        (dict(rate=0.3, mean_streak=0.5), "mean_streak=0.5"),
        (dict(rate=0.8, mean_streak=3.0), r"mean_streak=3.0 must be >= .* = 4 "),
    ],
)
def test_bad_arguments_name_their_value(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        random_skip(**kwargs)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        (dict(random_skip_rate=0.3), "random_skip_rate=0.3 skips in GAC's place"),
        (dict(monitor_only=True, random_skip_rate=1.5), "random_skip_rate=1.5"),
        (dict(monitor_only=True, random_skip_streak=2.0), "random_skip_streak=2.0 is not used"),
        (
            dict(monitor_only=True, random_skip_rate=0.5, random_skip_streak=0.9),
            "random_skip_streak=0.9",
        ),
    ],
)
def test_config_refuses_what_it_cannot_do(fields, fragment):
    with pytest.raises(ValueError, match=fragment):
        GACConfig(**fields).validate()
