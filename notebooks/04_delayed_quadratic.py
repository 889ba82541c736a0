# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Delayed gradient descent: where staleness breaks an optimizer, and what GAC moves
#
# The smallest model of asynchronous training: minimise a quadratic
# $f(x) = \tfrac12 \sum_i h_i x_i^2$ when step $t$ receives the gradient at the iterate of
# $k$ steps before, plus noise: $g_t = H x_{t-k} + \sigma\xi_t$. For SGD the recursion
# $x_{t+1} = x_t - \eta h x_{t-k}$ is stable exactly when
# $\eta h < 2\sin(\pi / (2(2k+1)))$: a stale gradient keeps pushing where the iterate has
# already gone, so the largest stable step falls like $1/k$. Momentum adds its own delayed
# feedback on top (asynchrony already acts like momentum, Mitliagkas et al.,
# [arXiv 1605.09774](https://arxiv.org/abs/1605.09774)).
#
# `gac_jax.toys.stability_boundary` finds, for any optax chain, the largest step that
# still converges at each staleness. Here: SGD against its closed form, Adam at three
# momenta, and GAC (with its true skip, `alignment_controlled`) on raw gradients and on
# applied updates. Set `GAC_JAX_FAST=1` for the smoke-test size CI runs.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np
import optax

from gac_jax.toys import DelayedQuadratic, sgd_stability_limit, stability_boundary
from gac_jax.transforms import alignment_controlled, gradient_alignment_control

FAST = os.environ.get("GAC_JAX_FAST") == "1"
LAGS = (0, 2, 8) if FAST else (0, 1, 2, 4, 8, 16)
RATES = np.geomspace(1e-3, 3.0, 16 if FAST else 48)
PROBLEM = DelayedQuadratic(steps=200 if FAST else 600)


def gac(control, acts_on="gradient"):
    return lambda lr: alignment_controlled(optax.adam(lr), control, acts_on=acts_on)


CHAINS = {
    "sgd": lambda lr: optax.sgd(lr),
    "adam": lambda lr: optax.adam(lr),
    "adam, b1 0": lambda lr: optax.adam(lr, b1=0.0),
    "GAC on gradients, 0.2 / 0.8": gac(gradient_alignment_control(0.2, 0.8)),
    "GAC projection only": gac(gradient_alignment_control(0.2, 1.0, projection="full", skip=False)),
    "GAC on applied updates": gac(
        gradient_alignment_control(0.9, 0.97, reference="update"), acts_on="update"
    ),
}
bounds = {name: stability_boundary(make, LAGS, RATES, PROBLEM) for name, make in CHAINS.items()}
for name, bound in bounds.items():
    print(f"{name:30s}", "  ".join(f"k={k}: {v:.3g}" for k, v in bound.items()))

# %% [markdown]
# SGD's simulated boundary sits just under the closed form for the stiffest direction
# (the grid is coarse and convergence slows to nothing at the limit). A skip on raw
# gradients at the paper's default thresholds never converges here: on a smooth problem
# consecutive gradients are aligned even without staleness, so every step is skipped and
# nothing moves. The thresholds must come from the synchronous cosine of the problem at
# hand, which is what laboratory v4 does for the RL cell.

# %%
lags = np.asarray(LAGS[1:])
fig, ax = plt.subplots(figsize=(7, 4))
for name, bound in bounds.items():
    ax.plot(lags, [bound[k] for k in lags], "-o", label=name)
h_max = PROBLEM.curvature[1]
ax.plot(lags, [sgd_stability_limit(k, h_max) for k in lags], "k--", label="SGD, closed form")
ax.set(xscale="log", yscale="log", xlabel="staleness k", ylabel="largest converging step")
ax.legend(fontsize="small")
plt.show()

sgd = bounds["sgd"]
for k in LAGS:
    assert sgd[k] <= sgd_stability_limit(k, h_max), (k, sgd[k])
