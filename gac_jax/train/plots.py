"""PNG plots of the metrics runs wrote (`gac_jax.train.metrics.MetricWriter`): one run's
panels (`plot_run`, drawn at the end of training) and several runs compared (`plot_runs`).

Figures are drawn with matplotlib's object API and its Agg renderer, never through pyplot,
so plotting neither needs a display nor changes the backend of a notebook that imports this.
Held-out evaluations sit where the training curves show the same policy: the record of step
s holds the batch trained on after s updates and the evaluation that followed update s + 1,
so an evaluation is drawn at s + 1 and the one before training (``eval_start/``) at 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gac_jax.train.metrics import metric_series, read_metrics

DEFAULT_KEYS = ("reward", "ess_ratio", "gac_cosine")
COMPARE_KEYS = ("eval/pass@1", "reward", "ess_ratio")  # `plot_runs`' default.

#: The axis labels of the metrics people plot most; others read as their name, with
#: ``eval/`` as "held-out" and spaces for underscores.
LABELS = {
    "reward": "batch reward",
    "accuracy": "batch accuracy",
    "ess_ratio": "ESS ratio (ESS / batch)",
    "gac_cosine": "GAC cosine c_t",
    "grad_norm": "gradient norm",
    "kl_k3": "KL(behaviour || current)",
}


def readable(key: str) -> str:
    """The label a person reads for metric `key` (`LABELS`, else its name spelt out)."""
    if key in LABELS:
        return LABELS[key]
    name = key.removeprefix("eval/").replace("_", " ")
    return f"held-out {name}" if key.startswith("eval/") else name


def _figure(num_panels: int):
    """A figure of `num_panels` panels one above the other (sharing the x axis), and them."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 2.4 * num_panels + 0.8), layout="constrained")
    return fig, fig.subplots(num_panels, 1, sharex=True, squeeze=False)[:, 0]


def _save(fig, png_path: str | os.PathLike) -> Path:
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png", dpi=100)
    return png_path


#: Held-out evaluations drawn as markers on the training curve they compare with: the
#: sampled reward and greedy accuracy against the batch reward, pass@1 against its accuracy.
EVAL_MARKERS: Mapping[str, tuple[str, ...]] = {
    "reward": ("eval/sampled_reward", "eval/greedy_accuracy"),
    "accuracy": ("eval/pass@1", "eval/greedy_accuracy"),
}

#: Weight of the exponential moving average `plot_run` draws (about a 10-step window).
DEFAULT_SMOOTHING = 0.9


def smoothing_weight(window: float) -> float:
    """The `ema_smooth` weight of a window of about `window` steps, ``1 - 1 / window``
    (1: no smoothing). Raises ValueError below 1."""
    if not window >= 1:
        raise ValueError(f"smooth={window!r} must be a window of at least 1 step.")
    return 1.0 - 1.0 / window


def ema_smooth(values: Sequence[float], weight: float = DEFAULT_SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average of the finite values.

    ``s_n = (1 - w) * sum_{i<=n} w^(n-i) x_i / (1 - w^n)`` over the first n finite values,
    so the first point is the first value rather than a pull towards zero. A non-finite
    value stays as it is (a gap) and does not enter the average. ValueError unless
    `weight` is in [0, 1).
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


def series(records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in a run's records; a held-out metric (``eval/...``) at
    the updates it followed, with the evaluation before training (``eval_start/``) at 0."""
    if not key.startswith("eval/"):
        return metric_series(records, key)
    start = metric_series(records, key.replace("eval/", "eval_start/", 1))[1]
    steps, values = metric_series(records, key)
    return [0] * len(start) + [s + 1 for s in steps], start + values


def _eval_points(records, key: str) -> dict[str, tuple[list[int], list[float]]]:
    """The held-out evaluations drawn on `key`'s panel, by metric (those present only);
    the reward panel also gets pass@k (k > 1) where it was logged."""
    names = list(EVAL_MARKERS.get(key, ()))
    if key == "reward":
        logged = {k for r in records for k in r if k.startswith("eval/pass@")}
        names += sorted(logged - {"eval/pass@1"})
    points = {name: series(records, name) for name in names}
    return {name: points for name, points in points.items() if points[0]}


def _finish(ax, key: str) -> None:
    """A legend, labels, a light grid, plain numbers on the y axis (no "1e-7+1" offset for
    a metric that barely moves, such as an ESS ratio of 1) and whole steps on the x axis."""
    from matplotlib.ticker import MaxNLocator

    ax.legend(fontsize="small")
    ax.set_ylabel(readable(key))
    ax.grid(True, alpha=0.3)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _curve(ax, key: str, points, smoothing: float, **style) -> None:
    """A held-out metric point by point (markers); a training metric smoothed."""
    steps, values = points
    if key.startswith("eval/"):
        ax.plot(steps, values, marker="o", linewidth=1.2, **style)
    else:
        ax.plot(steps, ema_smooth(values, smoothing), linewidth=1.5, **style)


def _window(smoothing: float) -> str:
    return f"smoothed over ~{round(1 / (1 - smoothing))} steps"


def _draw_panel(ax, key: str, points, evals, smoothing: float, lines=()) -> None:
    # Reference levels, e.g. GAC's thresholds on the cosine: each its own style, so that
    # two of them can be told apart.
    for (value, label), style in zip(lines, ("--", ":", "-.", (0, (5, 5))), strict=False):
        ax.axhline(value, color="grey", linestyle=style, linewidth=1.0, label=label)
    if not key.startswith("eval/") and smoothing > 0:  # The raw values under the average.
        (raw,) = ax.plot(*points, linewidth=0.8, alpha=0.3, label="per step")
        _curve(ax, key, points, smoothing, color=raw.get_color(), label=_window(smoothing))
    else:
        _curve(ax, key, points, smoothing, label=readable(key))
    for (name, (eval_steps, eval_values)), marker in zip(evals.items(), "os^", strict=False):
        ax.plot(eval_steps, eval_values, linestyle="none", marker=marker, label=readable(name))
    _finish(ax, key)


def describe_config(config) -> str:
    """One line of what a run trained: its method, its staleness and its learning rate,
    e.g. ``reinforce, tis (sequence), vcpo advantage, ESS step scale | lagged k=16 | lr 0.0005``."""
    loss, rollout = config.loss, config.rollout
    method = [loss.policy_loss]
    if loss.correction is not None:
        level = loss.correction_kwargs.get("level")
        method.append(loss.correction + (f" ({level})" if level else ""))
    if loss.advantage != "grpo":
        method.append(f"{loss.advantage} advantage")
    if config.ess is not None:
        method.append("ESS step scale")
    if not config.gac.monitor_only:
        gac = config.gac
        fixed = f"{gac.tau_low:g}/{gac.tau_high:g}" if gac.thresholds == "fixed" else "adaptive"
        method.append(f"GAC {fixed} on the {gac.acts_on}")
    staleness = {
        "sync": "synchronous",
        "lagged": f"lagged k={rollout.lag}",
        "async": f"async, staleness <= {config.buffer.max_staleness}",
    }[rollout.mode]
    return f"{', '.join(method)} | {staleness} | lr {config.optimizer.learning_rate:g}"


def _run_config(metrics_path: Path):
    """The config.json of the run that wrote `metrics_path`, or None (also when this
    version cannot read it)."""
    from gac_jax.train.config_io import load_config

    saved = (metrics_path if metrics_path.is_dir() else metrics_path.parent) / "config.json"
    try:
        return load_config(str(saved)) if saved.is_file() else None
    except ValueError:  # Written by another version of the config: no title, no levels.
        return None


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
    (value, label) reference levels drawn on its panel, each in its own grey line style
    (None: GAC's thresholds, `threshold_lines`, of the run's config.json). The title is
    `title` over `describe_config` of the run's config.json, where the run has one.
    ValueError if none of `keys` has a numeric value in the run, listing the keys it has.
    """
    records = read_metrics(metrics_jsonl_path)
    panels = {key: series(records, key) for key in keys}
    panels = {key: points for key, points in panels.items() if points[0]}
    if not panels:
        raise ValueError(
            f"None of the keys {list(keys)} is in {str(metrics_jsonl_path)!r}; "
            f"it has {sorted({k for r in records for k in r if k != 'step'})}."
        )
    config = _run_config(Path(metrics_jsonl_path))
    if lines is None:
        lines = threshold_lines(config.gac) if config is not None else {}
    fig, axes = _figure(len(panels))
    for ax, (key, points) in zip(axes, panels.items(), strict=True):
        _draw_panel(ax, key, points, _eval_points(records, key), smoothing, lines.get(key, ()))
    axes[-1].set_xlabel("step")
    heading = [title, describe_config(config) if config is not None else None]
    if any(heading):
        fig.suptitle("\n".join(h for h in heading if h))
    return fig


def threshold_lines(gac) -> dict[str, list[tuple[float, str]]]:
    """GAC's thresholds for the cosine panel of a run with GAC config `gac`: drawn when
    GAC acts with fixed thresholds (adaptive ones move; a monitor has none)."""
    if gac.monitor_only or gac.thresholds != "fixed":
        return {}
    return {"gac_cosine": [(gac.tau_low, "tau_low"), (gac.tau_high, "tau_high")]}


def plot_run(metrics_jsonl_path, png_path: str | os.PathLike, keys=DEFAULT_KEYS, **options):
    """Saves `run_figure` (each of `keys` against step, one panel each; keys absent from
    the run skipped, non-finite values left as gaps; `options` as there) as a PNG and
    returns its path. Raises ValueError as `run_figure` does."""
    return _save(run_figure(metrics_jsonl_path, keys, **options), png_path)


def run_labels(paths: Sequence[str | os.PathLike]) -> dict[str, Path]:
    """Runs (directories or their metrics.jsonl) by their paths below the directory they
    share, e.g. ``naive/seed0`` and ``vcpo/seed0`` for two runs of one sweep."""
    directories = [Path(p) if Path(p).is_dir() else Path(p).parent for p in paths]
    common = Path(os.path.commonpath([d.resolve() for d in directories]))
    labels = [str(d.resolve().relative_to(common)) for d in directories]
    return {
        label if label != "." else d.name: Path(p)
        for label, d, p in zip(labels, directories, paths, strict=True)
    }


def runs_figure(
    runs: Mapping[str, str | os.PathLike],
    keys: Sequence[str] = COMPARE_KEYS,
    *,
    smoothing: float = DEFAULT_SMOOTHING,
    title: str | None = None,
):
    """The figure `plot_runs` saves: one panel per key that some run has, one line per run
    that has it (each run its own colour in every panel, named in each panel's legend).

    Training metrics are smoothed with `ema_smooth` (weight `smoothing`) over their faint
    per-step values; held-out ones are drawn point by point with markers, from the
    evaluation before training on. ValueError if no run has any of `keys`.
    """
    records = {label: read_metrics(path) for label, path in runs.items()}
    panels = {key: {label: series(r, key) for label, r in records.items()} for key in keys}
    panels = {k: {run: p for run, p in curves.items() if p[0]} for k, curves in panels.items()}
    panels = {key: curves for key, curves in panels.items() if curves}
    if not panels:
        raise ValueError(f"No run of {sorted(runs)} has any of the metrics {list(keys)}.")
    fig, axes = _figure(len(panels))
    colours = {label: f"C{i}" for i, label in enumerate(runs)}
    for ax, (key, curves) in zip(axes, panels.items(), strict=True):
        smoothed = not key.startswith("eval/") and smoothing > 0
        for label, points in curves.items():
            if smoothed:  # Faint, and in no legend: the legend's line is its average.
                ax.plot(*points, color=colours[label], linewidth=0.6, alpha=0.25, label="_raw")
            _curve(ax, key, points, smoothing, color=colours[label], label=label)
        _finish(ax, key)
        if smoothed:
            ax.set_title(f"{_window(smoothing)} (faint: per step)", fontsize="small", loc="right")
    axes[-1].set_xlabel("step")
    if title is not None:
        fig.suptitle(title)
    return fig


def plot_runs(runs: Mapping[str, str | os.PathLike], png_path, keys=COMPARE_KEYS, **options):
    """Saves `runs_figure` (runs by label -> run directory or metrics path; `options` as
    there) as a PNG and returns its path; ValueError as `runs_figure`."""
    return _save(runs_figure(runs, keys, **options), png_path)
