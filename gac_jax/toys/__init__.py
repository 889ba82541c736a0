"""Small, fast problems (not language models) for demonstrations, notebooks and tests of the
stabilizers: the bandit is a real policy-gradient problem (sampling, rewards, importance
weights, staleness) that runs in seconds on a laptop CPU; the delayed quadratic, delayed
gradient descent, is the simplest model of asynchrony, for stability boundaries.
"""

from gac_jax.toys.delayed_quadratic import (
    DelayedQuadratic,
    delayed_losses,
    sgd_stability_limit,
    stability_boundary,
)
from gac_jax.toys.stale_bandit import BanditConfig, BanditRunResult, run_stale_bandit

__all__ = ["BanditConfig", "BanditRunResult", "DelayedQuadratic", "delayed_losses",
           "run_stale_bandit", "sgd_stability_limit", "stability_boundary"]  # fmt: skip
