"""PNG plots of the metrics a run wrote (`gac_jax.train.metrics.MetricWriter`).

Figures are drawn with matplotlib's object API and its Agg renderer, never through pyplot,
so plotting neither needs a display nor changes the backend of a notebook that imports this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gac_jax.train.metrics import metric_series, read_metrics

DEFAULT_KEYS = ("reward", "ess_ratio", "gac_cosine")


def _figure(num_panels: int):
    from matplotlib.figure import Figure

    return Figure(figsize=(7.0, 2.4 * num_panels + 0.6), layout="constrained")


def _save(fig, png_path: str | os.PathLike) -> Path:
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png", dpi=100)
    return png_path


def _available(records) -> list[str]:
    return sorted({k for r in records for k in r if k != "step"})


def plot_run(
    metrics_jsonl_path: str | os.PathLike,
    png_path: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_KEYS,
    *,
    title: str | None = None,
) -> Path:
    """Plots each of `keys` against step, one panel each; returns the PNG's path.

    Keys absent from the run are skipped (non-finite values leave gaps).

    Raises:
      ValueError: if none of `keys` has a numeric value in the run, listing the keys it has.
    """
    records = read_metrics(metrics_jsonl_path)
    series = {key: metric_series(records, key) for key in keys}
    series = {key: s for key, s in series.items() if s[0]}
    if not series:
        raise ValueError(
            f"None of the keys {list(keys)} is in {str(metrics_jsonl_path)!r}; "
            f"it has {_available(records)}."
        )
    fig = _figure(len(series))
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, (steps, values)) in zip(axes, series.items(), strict=True):
        ax.plot(steps, values, linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if title is not None:
        fig.suptitle(title)
    return _save(fig, png_path)


def plot_runs(
    runs: Mapping[str, str | os.PathLike],
    png_path: str | os.PathLike,
    key: str,
    *,
    title: str | None = None,
) -> Path:
    """Overlays `key` against step for several runs (label -> metrics path); returns the PNG.

    Runs without `key` are left out of the plot.

    Raises:
      ValueError: if no run has `key`.
    """
    curves = {}
    for label, path in runs.items():
        steps, values = metric_series(read_metrics(path), key)
        if steps:
            curves[label] = (steps, values)
    if not curves:
        raise ValueError(f"No run of {sorted(runs)} has the metric {key!r}.")
    fig = _figure(1)
    ax = fig.subplots()
    for label, (steps, values) in curves.items():
        ax.plot(steps, values, linewidth=1.2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title if title is not None else key)
    return _save(fig, png_path)
