"""Test configuration shared by the whole suite.

The fake device count must be set before JAX initialises its backends, so it is set
here at import time, before any test module imports jax.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# XLA:CPU compiles cheaply in the suite's processes (and the subprocesses that inherit
# these variables), unless the caller set a flag itself: LLVM at -O0 and the older fusion
# emitters. Compiling is most of the suite's CPU time, and tests/learner/test_learner.py
# with tests/models/test_sampler.py from an empty cache took 101 s at -O1, 74 s at -O0
# and 47 s with both. -O0 changes float32 results by a few ulps, the same in every
# process of the suite; the emitters alone change no bit (a learner step's params after
# two steps hashed equal).
CHEAP_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# XLA's own defaults, as `jax.jit(..., compiler_options=...)`, for a test that claims two
# programs agree bit for bit as users compile them: at -O0 two chains of the same
# arithmetic can round differently (adafactor's against optax's: 17 of 32,768 by an ulp).
USERS_COMPILE_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
_flags = os.environ.get("XLA_FLAGS", "").split() + ["--xla_force_host_platform_device_count=8"]
_named = {flag.split("=", 1)[0] for flag in _flags}
_flags += [flag for flag in CHEAP_COMPILE_FLAGS if flag.split("=", 1)[0] not in _named]
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache shared by the test processes (xdist workers, and the
# subprocesses the CLI, multi-host and notebook tests start, which inherit these
# variables): the loop tests build the same programs again in every run they resume, and
# compiling dominated them (test_loop's resume tests: 83 s without it, 38 s with it, from
# an empty cache). Entries are keyed by the program's fingerprint and JAX's version, so a
# stale one is never used; the directory is git-ignored.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


# `make test` hands whole files to two xdist workers (`--dist loadfile`), two to each and
# then one at a time, in the collection's order (`--no-loadscope-reorder`: xdist's own
# order, most tests first, put these few-test files last). The slowest go first, so that
# the run does not end on one worker with a long file while the other core idles. Their
# order: their tests' seconds from an empty cache (5061dc5's `--durations`).
SLOWEST_FILES_FIRST = (
    "tests/test_benchmarks.py",
    "tests/experiments/test_lab.py",
    "tests/train/test_plan.py",
    "tests/train/test_multiturn.py",
    "tests/train/test_loop.py",
    "tests/train/test_readme_commands.py",
    "tests/train/test_multihost_loop.py",
    "tests/train/test_async_backends.py",
    "tests/train/test_real_model_readme.py",
    "tests/test_notebooks.py",
)


def pytest_collection_modifyitems(items):
    missing = [path for path in SLOWEST_FILES_FIRST if not (REPO / path).is_file()]
    if missing:  # A renamed file would silently lose its place.
        raise pytest.UsageError(f"SLOWEST_FILES_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # Stable.


@pytest.fixture(autouse=True)
def _real_hardware_presets_cache_in_the_suites_cache(monkeypatch):
    """The real-hardware presets' `compilation_cache` (a directory in the user's home)
    is the suite's own in every test, so a test that runs one writes nothing outside the
    repository and leaves its process's cache where the suite set it."""
    from gac_jax.train import config

    monkeypatch.setattr(
        config, "REAL_HARDWARE_COMPILATION_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"]
    )


@pytest.fixture
def free_port() -> int:
    """A TCP port nobody listens on (for a `jax.distributed` coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(local_devices: int | None) -> dict[str, str]:
    """This environment for a child process without conftest's 8 fake devices (with
    `local_devices` of its own, or none set: the process sets them) and with the suite's
    cheap compiles (`CHEAP_COMPILE_FLAGS`, inherited)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if local_devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={local_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


@pytest.fixture
def run_processes(tmp_path):
    """`run(commands, timeout, local_devices)`: runs `{name: argv}` concurrently as Python
    processes in `tmp_path`; kills them all when one fails or time runs out, and fails the
    test with each failed process's log tail."""

    def run(
        commands: dict[str, list[str]], timeout: float, local_devices: int | None = None
    ) -> None:
        procs, logs = {}, {}
        try:
            for name, args in commands.items():
                logs[name] = open(tmp_path / f"{name}.log", "w+")  # noqa: SIM115
                procs[name] = subprocess.Popen(
                    [sys.executable, *args],
                    stdout=logs[name],
                    stderr=subprocess.STDOUT,
                    env=process_env(local_devices),
                    cwd=tmp_path,
                )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs.values()):
                failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            problems = []
            for name, p in procs.items():
                logs[name].seek(0)
                if p.returncode != 0:
                    tail = "".join(line for line in logs[name] if "[Gloo]" not in line)[-3000:]
                    problems.append(f"{name} exited with {p.returncode}:\n{tail}")
                logs[name].close()
        assert not problems, "\n".join(problems)

    return run
