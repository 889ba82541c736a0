"""Small, fast problems for demonstrations, notebooks and tests of the stabilizers.

They are real policy-gradient problems (sampling, rewards, importance weights, staleness),
small enough to run in seconds on a laptop CPU; they are not language models.
"""

from gac_jax.toys.stale_bandit import BanditConfig, BanditRunResult, run_stale_bandit

__all__ = ["BanditConfig", "BanditRunResult", "run_stale_bandit"]
