"""Test configuration shared by the whole suite.

The fake device count must be set before JAX initialises its backends, so it is set
here at import time, before any test module imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import HealthCheck, settings  # noqa: E402

# JIT compilation makes the first example of each property slow; deadlines would flake.
settings.register_profile(
    "gac_jax",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("gac_jax")
