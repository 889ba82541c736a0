"""The bound on consecutive skips (`max_consecutive_skips`): never more skips in a row, the
step after them projected to `tau_low`, the streak counters against a NumPy recount, plain
and under `optax.inject_hyperparams`, and the loop's one warning."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gac_jax.train.metrics import skip_streak_warning
from gac_jax.transforms import (
    REGIME_PROJECT,
    REGIME_SKIP,
    GACConfig,
    alignment_controlled,
    alignment_statistics,
    gradient_alignment_control,
)

PARAMS = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
TAU_LOW, TAU_HIGH = 0.3, 0.7


def _gradients(seed, aligned):
    """One gradient per entry of `aligned`: near the previous one's direction (cosine about
    0.99) where True, a fresh random one where False."""
    rng = np.random.default_rng(seed)
    out, previous = [], None
    for keep in aligned:
        fresh = {k: rng.normal(size=v.shape) for k, v in PARAMS.items()}
        if keep and previous is not None:
            fresh = {k: previous[k] + 0.15 * fresh[k] for k in fresh}
        out.append({k: jnp.asarray(v, jnp.float32) for k, v in fresh.items()})
        previous = fresh
    return out


@functools.cache
def _step(bound, level, injected):
    """A jitted update of Adam under GAC acting on `level`, and its init."""
    factory = optax.inject_hyperparams(gradient_alignment_control) if injected else None
    factory = factory or gradient_alignment_control
    reference = "update" if level == "update" else "gradient"
    control = factory(TAU_LOW, TAU_HIGH, reference=reference, max_consecutive_skips=bound)
    tx = alignment_controlled(optax.adam(1e-2), control, acts_on=level)
    return tx.init, jax.jit(tx.update)


def _stats(bound, level, grads, injected=False):
    init, update = _step(bound, level, injected)
    params, state, out = PARAMS, init(PARAMS), []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append({k: np.asarray(v) for k, v in alignment_statistics(state).items()})
    return out


def _streaks(skipped):
    """NumPy recount: the streak of skips ending at each step, and the longest so far."""
    streak, longest, out = 0, 0, []
    for s in skipped:
        streak = streak + 1 if s else 0
        longest = max(longest, streak)
        out.append((streak, longest))
    return out


@settings(max_examples=12, deadline=None)
@given(
    bound=st.sampled_from([1, 2, 3]),
    level=st.sampled_from(["gradient", "update"]),
    aligned=st.lists(st.booleans(), min_size=12, max_size=24).map(lambda a: [True] * 6 + a),
    seed=st.integers(0, 2**16),
)
def test_never_more_skips_in_a_row_than_the_bound(bound, level, aligned, seed):
    stats = _stats(bound, level, _gradients(seed, aligned))
    prefix = "gac_" if level == "gradient" else "gac_update_"
    skipped = [bool(s["gac_skipped"]) for s in stats]
    for t, (s, (streak, longest)) in enumerate(zip(stats, _streaks(skipped), strict=True)):
        assert (int(s["gac_skip_streak"]), int(s["gac_skip_streak_longest"])) == (streak, longest)
        assert streak <= bound
        if t >= bound and all(skipped[t - bound : t]):  # The bound reached: no skip now.
            assert not skipped[t]
            if float(s[prefix + "cosine"]) > TAU_HIGH:  # Would have skipped: projected.
                assert int(s[prefix + "regime"]) == REGIME_PROJECT
                assert float(s[prefix + "cosine_after"]) <= TAU_LOW + 1e-4
    assert max(longest for _, longest in _streaks(skipped)) == bound  # Reached, at 6 aligned.


@pytest.mark.parametrize("level", ["gradient", "update"])
def test_unbounded_skips_repeat_and_the_bound_breaks_them(level):
    grads = _gradients(0, [False]) * 12  # One gradient throughout: every step would skip.
    unbounded = [bool(s["gac_skipped"]) for s in _stats(None, level, grads)]
    first = unbounded.index(True)
    assert first <= 2 and all(unbounded[first:])
    bounded = [bool(s["gac_skipped"]) for s in _stats(3, level, grads)]
    assert bounded[: first + 3] == unbounded[: first + 3] and not bounded[first + 3]
    runs = "".join("s" if b else "." for b in bounded).split(".")
    assert {len(r) for r in runs[:-1]} <= {0, 3} and len(runs[-1]) <= 3  # Skips resume.


def test_injected_bound_counts_the_same_and_can_be_changed():
    grads = _gradients(1, [True] * 10 + [False] + [True] * 9)
    plain, injected = _stats(2, "gradient", grads), _stats(2, "gradient", grads, injected=True)
    for a, b in zip(plain, injected, strict=True):
        for name in ("gac_skipped", "gac_regime", "gac_skip_streak", "gac_skip_streak_longest"):
            assert a[name] == b[name], name
    # The bound is a traced hyperparameter there: raised in the state, it lets skips run on.
    init, update = _step(2, "gradient", True)
    state, params = init(PARAMS), PARAMS
    optax.tree.get(state, "hyperparams")["max_consecutive_skips"] = jnp.asarray(100)
    for g in grads[:8]:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    assert int(alignment_statistics(state)["gac_skip_streak"]) == 7  # All but the first.


def test_the_bare_transform_counts_its_streaks():
    tx = gradient_alignment_control(TAU_LOW, TAU_HIGH, max_consecutive_skips=2)
    state, update = tx.init(PARAMS), jax.jit(tx.update)
    streaks, skipped = [], []
    for g in _gradients(2, [True] * 8):
        _, state = update(g, state)
        stats = alignment_statistics(state)
        streaks.append((int(stats["gac_skip_streak"]), int(stats["gac_skip_streak_longest"])))
        skipped.append(int(stats["gac_regime"]) == REGIME_SKIP)
    assert streaks == _streaks(skipped)
    assert streaks[1:] == [(1, 1), (2, 2), (0, 2), (1, 2), (2, 2), (0, 2), (1, 2)]


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_a_bad_bound_names_its_value(bad):
    with pytest.raises(ValueError, match=f"max_consecutive_skips={bad}"):
        gradient_alignment_control(max_consecutive_skips=bad)


def test_the_loop_warns_once_when_skips_reach_the_bound():
    def feed(gac, longest_by_step):
        said = []
        warn = skip_streak_warning(gac, said.append)
        for step, longest in enumerate(longest_by_step):
            warn(step, {"gac_skip_streak_longest": float(longest)})
        return "\n".join(said)

    err = feed(GACConfig(max_consecutive_skips=3), [0, 2, 3, 3, 7])
    assert err.count("warning") == 1 and "skipped 3 steps in a row by step 2" in err
    assert "max_consecutive_skips=None" in feed(GACConfig(max_consecutive_skips=None), [0, 99])
    assert feed(GACConfig(max_consecutive_skips=3), [0, 2]) == ""
    assert feed(GACConfig(monitor_only=True), [0, 50]) == ""
