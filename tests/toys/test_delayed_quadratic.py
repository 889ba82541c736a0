"""The delayed quadratic: its SGD stability boundary against the closed form, and the
true skip seen from the outside (unbounded, a run that skips every step never moves)."""

import jax
import numpy as np
import optax
import pytest

from gac_jax.toys.delayed_quadratic import (
    DelayedQuadratic,
    delayed_losses,
    sgd_stability_limit,
    stability_boundary,
)
from gac_jax.transforms import alignment_controlled, gradient_alignment_control
from gac_jax.transforms.alignment import MAX_CONSECUTIVE_SKIPS

# One eigenvalue, no noise: x_{t+1} = x_t - eta h x_{t-k} exactly.
SCALAR = DelayedQuadratic(dim=1, curvature=(1.0, 1.0), noise=0.0, steps=2000, converged_below=1e-3)


def test_sgd_boundary_is_the_closed_form():
    lags = (0, 1, 3, 8)
    rates = np.geomspace(0.02, 2.5, 160)
    boundary = stability_boundary(lambda lr: optax.sgd(lr), lags, rates, SCALAR)
    for lag in lags:
        limit = sgd_stability_limit(lag, 1.0)
        # The largest converging grid rate lies just under the limit (convergence slows to
        # nothing at the limit itself, so the last few grid points may not make it).
        assert 0.93 * limit <= boundary[lag] < limit, (lag, boundary[lag], limit)


def test_sgd_recursion_matches_numpy():
    lag, lr, h = 2, 0.3, 1.0
    problem = DelayedQuadratic(dim=1, curvature=(h, h), noise=0.0, steps=20)
    x0 = float(jax.random.normal(jax.random.key(problem.seed), (1,))[0])  # The start.
    x = [x0] * (lag + 1)  # Iterates before the first step are the start.
    for _ in range(problem.steps):
        x.append(x[-1] - lr * h * x[-1 - lag])
    reference = 0.5 * h * np.square(np.asarray(x[lag + 1 :], np.float64))
    losses = delayed_losses(lambda r: optax.sgd(r), lag, [lr], problem)[0]
    # float32 against float64: the loss passes near 0, so an absolute floor too.
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=1e-7 * reference.max())


def _longest_still(losses):
    """The longest run of consecutive steps that left the loss unchanged (skipped steps)."""
    runs = "".join("s" if same else "." for same in losses[1:] == losses[:-1]).split(".")
    return max(len(run) for run in runs)


@pytest.mark.parametrize(
    ("control", "acts_on"),
    [
        (
            lambda bound: gradient_alignment_control(0.2, 0.8, max_consecutive_skips=bound),
            "gradient",
        ),
        (
            lambda bound: gradient_alignment_control(
                0.9, 0.97, reference="update", max_consecutive_skips=bound
            ),
            "update",
        ),
    ],
    ids=["gradient", "update"],
)
def test_the_skip_that_deadlocked_the_readmes_chain_now_descends(control, acts_on):
    # The noisy quadratic, signal above noise: consecutive gradients (and Adam's updates)
    # have cosine about 0.99, so every step skips, and with params, Adam's state and the
    # reference frozen a skip repeats itself. The default bound breaks the streak.
    problem = DelayedQuadratic(steps=1000)

    def losses(bound):
        def chain(lr):
            inner = alignment_controlled(optax.adamw(lr), control(bound), acts_on=acts_on)
            return optax.chain(optax.clip_by_global_norm(1.0), inner)

        return delayed_losses(chain, 0, [1e-2], problem)[0]

    stuck, bounded = losses(None), losses(MAX_CONSECUTIVE_SKIPS)
    assert _longest_still(stuck) >= 500 and stuck[-1] > 0.85 * stuck[0]  # Half the run.
    assert _longest_still(bounded) == MAX_CONSECUTIVE_SKIPS
    assert bounded[-1] < 0.7 * bounded[0]
