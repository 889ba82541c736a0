"""The numbers and figures every laboratory report shares: 95% intervals over seeds, table
cells, a figure of stacked panels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t interval); half-width nan for one value."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return float(x.mean()), math.nan
    return float(x.mean()), float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / len(x) ** 0.5)


def ci_cell(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± half-width`` (`interval`), or the mean alone for one value."""
    mean, half = interval(values)
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def values_of(runs, key) -> list[float]:
    return [float(r[key]) for r in runs if r.get(key) is not None]


def median_cell(runs, key, digits=3) -> str:
    values = [v for v in values_of(runs, key) if math.isfinite(v)]
    return f"{np.median(values):.{digits}g}" if values else "-"


def figure(panels: int, width: float = 7.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 2.6 * panels + 0.4), layout="constrained")
    return fig, [fig.add_subplot(panels, 1, i + 1) for i in range(panels)]


def eval_curves_figure(curves: dict, path, title: str) -> None:
    """Held-out pass@1 (mean of the seeds) against updates, one line per method.

    `curves` maps a method's label to ``{updates: [pass@1 of each seed]}``."""
    fig, (ax,) = figure(1, width=8.0)
    for label, evals in curves.items():
        xs = sorted(s for s in evals if evals[s])
        ax.plot(xs, [np.mean(evals[s]) for s in xs], "-o", label=label)
    ax.set(xlabel="updates", ylabel="held-out pass@1 (mean of the seeds)", title=title)
    ax.legend(fontsize="small", ncol=2)
    fig.savefig(path, dpi=100)
