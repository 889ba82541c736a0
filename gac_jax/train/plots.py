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


def _save(fig, png_path: str | os.PathLike, ax=None, ylabel=None, title=None, grid="both") -> Path:
    """Saves `fig`; with `ax`, a one-panel plot's, labelled `ylabel` and `title` (if given),
    under a light grid on `grid`'s axes."""
    if ax is not None:
        ax.set_ylabel(ylabel)
        ax.grid(True, axis=grid, alpha=0.3)
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


def plot_distributions(
    groups: Mapping[str, Sequence[float]],
    png_path: str | os.PathLike,
    *,
    ylabel: str,
    title: str | None = None,
) -> Path:
    """Box plots (quartile box, 5th-95th percentile whiskers, no fliers) of each group's
    values, in the mapping's order; returns the PNG's path. ValueError if `groups` is empty
    or a group has no values."""
    if not groups:
        raise ValueError("plot_distributions needs at least one group.")
    empty = [label for label, values in groups.items() if len(values) == 0]
    if empty:
        raise ValueError(f"groups {empty} have no values.")
    fig, (ax,) = _figure(1)
    ax.boxplot(
        [list(v) for v in groups.values()],
        tick_labels=list(groups),
        whis=(5, 95),
        showfliers=False,
        medianprops={"color": "black"},
    )
    ax.axhline(0.0, color="gray", linewidth=0.8)
    return _save(fig, png_path, ax, ylabel, title, grid="y")


def _smooth(values, window: int):
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    if window <= 1 or len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_seed_curves(
    curves: Mapping[str, Sequence[Sequence[float]]],
    png_path: str | os.PathLike,
    *,
    ylabel: str,
    smooth: int = 1,
    title: str | None = None,
) -> Path:
    """For each label, the mean over seeds of a per-step series (trailing `smooth`-step
    mean), with the seeds' range shaded; series are cut to the shortest of their label.
    ValueError if `curves` is empty or a label has no series."""
    import numpy as np

    if not curves or any(len(series) == 0 for series in curves.values()):
        raise ValueError(f"plot_seed_curves needs at least one series per label; got {curves}.")
    fig, (ax,) = _figure(1)
    for label, series in curves.items():
        n = min(len(s) for s in series)
        stacked = np.stack([_smooth(s[:n], smooth) for s in series])
        steps = np.arange(stacked.shape[1]) + (smooth - 1 if n >= smooth else 0)
        (line,) = ax.plot(steps, stacked.mean(axis=0), linewidth=1.3, label=label)
        if len(series) > 1:
            ax.fill_between(
                steps, stacked.min(axis=0), stacked.max(axis=0), color=line.get_color(), alpha=0.15
            )
    ax.set_xlabel("step")
    ax.legend()
    return _save(fig, png_path, ax, ylabel, title)


def plot_grouped_bars(
    values: Mapping[str, Mapping[str, tuple[float, float]]],
    png_path: str | os.PathLike,
    *,
    ylabel: str,
    reference: tuple[str, float] | None = None,
    title: str | None = None,
) -> Path:
    """Bars of ``values[group][category] = (mean, std)``: one cluster per category, one bar
    per group, with std error bars; `reference` = (label, value) draws a horizontal line.
    ValueError if `values` is empty."""
    import numpy as np

    if not values:
        raise ValueError("plot_grouped_bars needs at least one group.")
    categories = list(dict.fromkeys(c for group in values.values() for c in group))
    width = 0.8 / len(values)
    fig, (ax,) = _figure(1)
    x = np.arange(len(categories))
    for i, (group, by_category) in enumerate(values.items()):
        means = [by_category.get(c, (np.nan, 0.0))[0] for c in categories]
        stds = [by_category.get(c, (np.nan, 0.0))[1] for c in categories]
        ax.bar(
            x + (i - (len(values) - 1) / 2) * width, means, width, yerr=stds, label=group, capsize=2
        )
    if reference is not None:
        ax.axhline(reference[1], color="black", linestyle="--", linewidth=1.0, label=reference[0])
    ax.set_xticks(x, categories)
    # Beside the axes, so it never hides a bar (constrained layout makes room for it).
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, png_path, ax, ylabel, title, grid="y")
