"""Small, fast problems for demonstrations, notebooks and tests of the stabilizers.

The bandit is a real policy-gradient problem (sampling, rewards, importance weights,
staleness), small enough to run in seconds on a laptop CPU; the delayed quadratic is the
simplest model of asynchrony, delayed gradient descent, for stability boundaries. Neither
is a language model.
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
