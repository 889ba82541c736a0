"""report_v4's theory block: each chain's converging steps as ranges with their gaps."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import optax
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.toys.delayed_quadratic import DelayedQuadratic, sgd_stability_limit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
import report_v4  # noqa: E402

RATES = np.geomspace(1e-3, 3.0, 48)


def test_step_ranges_by_hand():
    ok = np.zeros(48, bool)
    assert report_v4.step_ranges(ok) == "none"
    ok[[20, 21, 22, 24, 47]] = True
    assert report_v4.step_ranges(ok) == "0.0302-0.0424 / 0.0596 / 3"


@given(st.lists(st.booleans(), min_size=48, max_size=48))
def test_step_ranges_give_back_the_converging_steps(flags):
    """Read back, the pieces cover exactly the converging grid points, in order, and a
    failing step separates each piece from the next (a contiguous set is one piece)."""
    ok = np.asarray(flags)
    text = report_v4.step_ranges(ok, RATES)
    index = {f"{r:.3g}": i for i, r in enumerate(RATES)}
    pieces = [] if text == "none" else [piece.split("-") for piece in text.split(" / ")]
    ends = [(index[p[0]], index[p[-1]]) for p in pieces]
    assert [i for a, b in ends for i in range(a, b + 1)] == list(np.flatnonzero(ok))
    assert all(b + 1 < c for (_, b), (c, _) in zip(ends, ends[1:], strict=False))


def test_theory_block_and_figure(tmp_path, monkeypatch):
    """SGD's converging steps stop just below its closed-form limit, and the table says so."""
    rates = np.geomspace(0.01, 3.0, 16)
    monkeypatch.setattr(report_v4, "THEORY_LAGS", (0, 2))
    monkeypatch.setattr(report_v4, "THEORY_RATES", rates)
    monkeypatch.setattr(
        report_v4,
        "THEORY_CHAINS",
        {"sgd": (optax.sgd, "SGD"), "adam": (optax.adam, "Adam")},
    )
    problem = DelayedQuadratic(steps=300)
    block = report_v4.theory(tmp_path, problem)["v4_theory"]
    sgd = next(line for line in block.splitlines() if line.startswith("| sgd | SGD |"))
    index = {f"{r:.3g}": i for i, r in enumerate(rates)}
    for lag, cell in zip((0, 2), sgd.strip("| ").split(" | ")[2:], strict=True):
        top = index[cell.split("-")[-1]]  # Within two grid steps below the closed form.
        assert rates[top] < sgd_stability_limit(lag, problem.curvature[1]) < rates[top + 2]
    assert "| sgd, closed form |" in block and "< 0.618" in block
    assert (tmp_path / "v4_theory.png").stat().st_size > 1000
