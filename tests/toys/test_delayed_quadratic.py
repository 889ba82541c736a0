"""The delayed quadratic: its SGD stability boundary against the closed form, and the
true skip seen from the outside (a run that skips every step never moves)."""

import jax
import numpy as np
import optax
import pytest

from gac_jax.toys.delayed_quadratic import (
    DelayedQuadratic,
    converged,
    delayed_losses,
    sgd_stability_limit,
    stability_boundary,
)
from gac_jax.transforms import alignment_controlled, gradient_alignment_control

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


@pytest.mark.parametrize("lag", [0, 4])
def test_a_control_that_skips_every_step_never_moves(lag):
    # Identical consecutive gradients (no noise, one dimension): cosine 1 from the second
    # step on, so every later step is skipped and the loss stays where step 1 left it.
    problem = DelayedQuadratic(dim=1, curvature=(1.0, 1.0), noise=0.0, steps=30)
    tx = lambda lr: alignment_controlled(optax.adam(lr), gradient_alignment_control(0.2, 0.8))  # noqa: E731
    losses = delayed_losses(tx, lag, [0.01], problem)[0]
    assert np.all(losses[1:] == losses[0])
    assert not converged(losses[None], problem)[0]
