"""Every notebook in notebooks/ runs top to bottom as a script in its fast mode.

The notebooks are jupytext percent-format `.py` files, so running one with `python` runs
every cell in order; a failing cell fails the script. Each runs in a fresh interpreter with
`GAC_JAX_FAST=1`, the Agg backend and without this process's fake devices (`process_env`):
one CPU device, as on a laptop (LLVM's optimisations off, as in the suite).
"""

import pathlib
import subprocess
import sys

import pytest

from tests.conftest import process_env

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = [
    "01_stale_aligned_gradients.py",
    "02_ess_and_variance.py",
    "03_bring_your_own_chain.py",
    "04_delayed_quadratic.py",
]
TIMEOUT_SECONDS = 300  # Each takes well under a minute alone; CI machines are shared.


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS_DIR.glob("[0-9]*.py")) == NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_fast_mode(name, tmp_path):
    env = {**process_env(None), "GAC_JAX_FAST": "1", "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, str(NOTEBOOKS_DIR / name)],
        cwd=tmp_path,  # Whatever a notebook might write lands here, not in the repo.
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, (
        f"{name} failed with exit status {result.returncode}.\n"
        f"--- stdout (tail) ---\n{result.stdout[-3000:]}\n"
        f"--- stderr (tail) ---\n{result.stderr[-6000:]}"
    )
