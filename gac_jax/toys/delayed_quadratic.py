r"""Delayed gradient descent on a quadratic: where staleness makes an optimizer unstable.

The simplest model of asynchrony: minimise :math:`f(x) = \tfrac12 \sum_i h_i x_i^2` when
step `t` receives the gradient at the iterate of `lag` steps before, plus noise,

.. math::

    g_t = H x_{t-k} + \sigma \xi_t, \qquad x_{t+1} = x_t + \mathrm{tx}(g_t),

through any optax chain `tx`. For plain SGD the recursion on one eigenvalue,
:math:`x_{t+1} = x_t - \eta h x_{t-k}`, is stable exactly when
:math:`0 < \eta h < 2 \sin\!\big(\pi / (2(2k + 1))\big)` (`sgd_stability_limit`): the
largest stable step falls like :math:`1/k`, since a stale gradient keeps pushing in the
direction the iterate has already gone (delayed feedback; asynchrony acts like momentum,
Mitliagkas et al., arXiv 1605.09774). `stability_boundary` measures the largest step that
still converges for any chain (SGD, Adam, each GAC variant) at each staleness.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class DelayedQuadratic:
    """The problem: curvatures, gradient noise, length, and what counts as converged."""

    dim: int = 32
    curvature: tuple[float, float] = (0.2, 1.0)  # Smallest, largest h, log-spaced.
    noise: float = 0.05  # sigma, of each gradient coordinate.
    steps: int = 600
    # Converged: the mean loss over the last quarter of the steps is below this fraction
    # of the initial loss (`converged`).
    converged_below: float = 0.05
    seed: int = 0  # Of the initial point and the noise.

    def eigenvalues(self) -> np.ndarray:
        low, high = self.curvature
        return np.geomspace(low, high, self.dim).astype(np.float32)

    def start(self) -> jax.Array:
        """x_0, f32 [dim]: standard normal from `seed`."""
        return jax.random.normal(jax.random.key(self.seed), (self.dim,), jnp.float32)

    def initial_loss(self) -> float:
        return 0.5 * float(np.sum(self.eigenvalues() * np.asarray(self.start()) ** 2))


def sgd_stability_limit(lag: int, curvature: float) -> float:
    """The largest stable SGD step for `x_{t+1} = x_t - eta h x_{t-lag}` (exclusive)."""
    return 2.0 * math.sin(math.pi / (2 * (2 * lag + 1))) / curvature


def delayed_losses(
    make_tx: Callable[[jax.Array], optax.GradientTransformation],
    lag: int,
    learning_rates: Sequence[float],
    problem: DelayedQuadratic = DelayedQuadratic(),
) -> np.ndarray:
    """Loss at every step [len(learning_rates), steps] of `make_tx(lr)` at staleness `lag`.

    `make_tx` is called inside a traced function with a scalar array, so the runs of all
    learning rates share one compiled program (`jax.vmap`). A non-finite loss stays
    non-finite.
    """
    h, x0 = jnp.asarray(problem.eigenvalues()), problem.start()
    key = jax.random.fold_in(jax.random.key(problem.seed), 1)
    noise = problem.noise * jax.random.normal(key, (problem.steps, problem.dim), jnp.float32)

    def run(lr):
        tx = make_tx(lr)
        # The last lag + 1 iterates, oldest first: the gradient is taken at the oldest.
        history = jnp.broadcast_to(x0, (lag + 1, problem.dim))

        def step(carry, xi):
            history, state = carry
            x = history[-1]
            updates, state = tx.update(h * history[0] + xi, state, x)
            x = optax.apply_updates(x, updates)
            loss = 0.5 * jnp.sum(h * x * x)
            return (jnp.concatenate([history[1:], x[None]]), state), loss

        _, losses = jax.lax.scan(step, (history, tx.init(x0)), noise)
        return losses

    lrs = jnp.asarray(learning_rates, jnp.float32)
    return np.asarray(jax.jit(jax.vmap(run))(lrs))


def converged(losses: np.ndarray, problem: DelayedQuadratic = DelayedQuadratic()) -> np.ndarray:
    """bool [runs]: the mean loss of each run's last quarter is finite and below
    `problem.converged_below` times the initial loss."""
    initial = problem.initial_loss()
    # In float64: a diverging run's float32 losses would overflow the sum (with a warning).
    tail = losses[:, -max(1, losses.shape[1] // 4) :].astype(np.float64).mean(axis=1)
    return np.isfinite(tail) & (tail < problem.converged_below * initial)


def stability_boundary(
    make_tx: Callable[[jax.Array], optax.GradientTransformation],
    lags: Sequence[int],
    learning_rates: Sequence[float],
    problem: DelayedQuadratic = DelayedQuadratic(),
) -> dict[int, float]:
    """For each lag, the largest of `learning_rates` whose run converges (`converged`);
    nan when none does. (Too small a rate also fails: it has not converged by the end.)"""
    rates = np.asarray(learning_rates, np.float64)
    boundary = {}
    for lag in lags:
        ok = converged(delayed_losses(make_tx, lag, rates, problem), problem)
        boundary[lag] = float(rates[ok].max()) if ok.any() else math.nan
    return boundary
