"""PNG plots of the metrics a run wrote (`gac_jax.train.metrics.MetricWriter`).

Figures are drawn with matplotlib's object API and its Agg renderer, never through pyplot,
so plotting neither needs a display nor changes the backend of a notebook that imports this.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gac_jax.train.metrics import metric_series, read_metrics

DEFAULT_KEYS = ("reward", "ess_ratio", "gac_cosine")


def _figure(num_panels: int):
    """A figure of `num_panels` panels one above the other (sharing the x axis), and them."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 2.4 * num_panels + 0.6), layout="constrained")
    return fig, fig.subplots(num_panels, 1, sharex=True, squeeze=False)[:, 0]


def _save(fig, png_path: str | os.PathLike, ax=None, ylabel=None, title=None) -> Path:
    """Saves `fig`; with `ax`, a one-panel plot's, labelled `ylabel` and `title` (if given),
    under a light grid."""
    if ax is not None:
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if title is not None:
            ax.set_title(title)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png", dpi=100)
    return png_path


#: Held-out evaluations (`gac_jax.train.run.Run.evaluate`, every ``eval_every`` steps)
#: drawn as markers on the training curve they are comparable with: the sampled reward
#: and greedy accuracy on test problems against the batch reward, pass@1 against the batch
#: accuracy.
EVAL_MARKERS: Mapping[str, tuple[str, ...]] = {
    "reward": ("eval/sampled_reward", "eval/greedy_accuracy"),
    "accuracy": ("eval/pass@1", "eval/greedy_accuracy"),
}

#: Weight of the exponential moving average `plot_run` draws (about a 10-step window).
DEFAULT_SMOOTHING = 0.9


def ema_smooth(values: Sequence[float], weight: float = DEFAULT_SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average of the finite values.

    ``s_n = (1 - w) * sum_{i<=n} w^(n-i) x_i / (1 - w^n)`` over the first n finite values,
    so the first point is the first value rather than a pull towards zero. A non-finite
    value stays as it is (a gap) and does not enter the average.

    Raises:
      ValueError: if `weight` is not in [0, 1).
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing={weight!r} must be in [0, 1).")
    average, count, smoothed = 0.0, 0, []
    for value in values:
        if not math.isfinite(value):
            smoothed.append(value)
            continue
        average = weight * average + (1.0 - weight) * value
        count += 1
        smoothed.append(average / (1.0 - weight**count))
    return smoothed


def _eval_points(records, key: str) -> dict[str, tuple[list[int], list[float]]]:
    """The held-out evaluations drawn on `key`'s panel, by metric (those present only);
    the reward panel also gets pass@k (k > 1) where it was logged."""
    names = list(EVAL_MARKERS.get(key, ()))
    if key == "reward":
        logged = {k for r in records for k in r if k.startswith("eval/pass@")}
        names += sorted(logged - {"eval/pass@1"})
    points = {name: metric_series(records, name) for name in names}
    return {name: series for name, series in points.items() if series[0]}


def _plain_axes(ax) -> None:
    """Plain numbers on the y axis (no "1e-7+1" offset for a metric that barely moves,
    such as an ESS ratio of 1) and whole steps on the x axis."""
    from matplotlib.ticker import MaxNLocator

    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_panel(ax, key: str, series, evals, smoothing: float, lines=()) -> None:
    steps, values = series
    # Reference levels, e.g. GAC's thresholds on the cosine: each its own style, so that
    # two of them can be told apart.
    for (value, label), style in zip(lines, ("--", ":", "-.", (0, (5, 5))), strict=False):
        ax.axhline(value, color="grey", linestyle=style, linewidth=1.0, label=label)
    if key.startswith("eval/"):  # Already sparse: every point is an evaluation.
        ax.plot(steps, values, marker="o", linewidth=1.2)
    else:
        (raw,) = ax.plot(steps, values, linewidth=0.8, alpha=0.3)
        ax.plot(steps, ema_smooth(values, smoothing), color=raw.get_color(), linewidth=1.5)
    for (name, (eval_steps, eval_values)), marker in zip(evals.items(), "os^", strict=False):
        label = f"held-out {name.removeprefix('eval/')}"
        ax.plot(eval_steps, eval_values, linestyle="none", marker=marker, label=label)
    if evals or lines:
        ax.legend(fontsize="small")
    ax.set_ylabel(key)
    ax.grid(True, alpha=0.3)
    _plain_axes(ax)


def run_figure(
    metrics_jsonl_path: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_KEYS,
    *,
    smoothing: float = DEFAULT_SMOOTHING,
    title: str | None = None,
    lines: Mapping[str, Sequence[tuple[float, str]]] | None = None,
):
    """The figure `plot_run` saves (a matplotlib ``Figure``, one panel per present key).

    Each training metric is drawn raw (faint) and smoothed with `ema_smooth`; the held-out
    evaluations of `EVAL_MARKERS` are markers on their panel; `lines` maps a key to
    (value, label) reference levels drawn on its panel, each in its own grey line style.

    Raises:
      ValueError: if none of `keys` has a numeric value in the run, listing the keys it has.
    """
    records = read_metrics(metrics_jsonl_path)
    series = {key: metric_series(records, key) for key in keys}
    series = {key: s for key, s in series.items() if s[0]}
    if not series:
        raise ValueError(
            f"None of the keys {list(keys)} is in {str(metrics_jsonl_path)!r}; "
            f"it has {sorted({k for r in records for k in r if k != 'step'})}."
        )
    fig, axes = _figure(len(series))
    for ax, (key, steps_values) in zip(axes, series.items(), strict=True):
        levels = (lines or {}).get(key, ())
        _draw_panel(ax, key, steps_values, _eval_points(records, key), smoothing, levels)
    axes[-1].set_xlabel("step")
    if title is not None:
        fig.suptitle(title)
    return fig


def threshold_lines(gac) -> dict[str, list[tuple[float, str]]]:
    """GAC's thresholds for the cosine panel of a run with GAC config `gac`: drawn when
    GAC acts with fixed thresholds (adaptive ones move; a monitor has none)."""
    if gac.monitor_only or gac.thresholds != "fixed":
        return {}
    return {"gac_cosine": [(gac.tau_low, "tau_low"), (gac.tau_high, "tau_high")]}


def plot_run(
    metrics_jsonl_path: str | os.PathLike,
    png_path: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_KEYS,
    *,
    smoothing: float = DEFAULT_SMOOTHING,
    title: str | None = None,
    lines: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> Path:
    """Saves `run_figure` (each of `keys` against step, one panel each; keys absent from
    the run skipped, non-finite values left as gaps) as a PNG; returns its path. Raises
    ValueError as `run_figure` does."""
    fig = run_figure(metrics_jsonl_path, keys, smoothing=smoothing, title=title, lines=lines)
    return _save(fig, png_path)


def plot_runs(
    runs: Mapping[str, str | os.PathLike],
    png_path: str | os.PathLike,
    key: str,
    *,
    title: str | None = None,
) -> Path:
    """Overlays `key` against step for several runs (label -> metrics path); returns the PNG.
    Runs without `key` are left out of the plot (ValueError if none has it)."""
    curves = {label: metric_series(read_metrics(path), key) for label, path in runs.items()}
    curves = {label: curve for label, curve in curves.items() if curve[0]}
    if not curves:
        raise ValueError(f"No run of {sorted(runs)} has the metric {key!r}.")
    fig, (ax,) = _figure(1)
    for label, (steps, values) in curves.items():
        ax.plot(steps, values, linewidth=1.2, label=label)
    ax.set_xlabel("step")
    _plain_axes(ax)
    ax.legend()
    return _save(fig, png_path, ax, key, title if title is not None else key)
