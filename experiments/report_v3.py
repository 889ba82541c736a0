"""Laboratory v3's tables and figures (issue #32), from the runs of `lab.py --only cell`.

Called by experiments/report.py (its ``--v3-root``). Every number comes from the runs'
summaries and metric records; intervals are 95% Student-t intervals over seeds.

- ``v3_cell``: every method of the cell against synchronous training at the same step
  size and against naive asynchrony, each cure beside the step-size control whose median
  per-step KL is nearest its own (the matched control).
- ``v3_gac``: how much GAC acted: the fraction of steps it projected and skipped, and
  the mean fraction of the gradient's norm it removed.
- ``v3_diagnostics``: c_t along training (sync, naive, GAC), and VCPO's predictor: how
  often an ESS drop or a gradient-norm spike preceded a collapse, and how often either
  fired in a run that did not collapse.
"""

from __future__ import annotations

import math
from pathlib import Path

import lab
import numpy as np
from report_tables import ci_cell, eval_curves_figure, figure, interval, median_cell, values_of

from gac_jax.train.metrics import markdown_table, read_metrics


def runs_by_method(runs: dict, names, tag: str = "v3") -> dict[str, list[dict]]:
    """A cell's runs by method name (labels ``<tag>/<name>/k<lag>``), in `names`' order."""
    found = {}
    for name in names:
        for label, seeds in runs.items():
            if label.startswith(f"{tag}/{name}/k"):
                found[name] = seeds
    return found


def _prefix(runs: dict) -> dict[str, list[dict]]:
    """Laboratory v3's runs by method name."""
    return runs_by_method(runs, lab.CELL)


def _evals_at(root: Path, label: str, seeds: list[dict]) -> dict[int, list[float]]:
    """Held-out pass@1 by number of updates (0: before training), one value a seed."""
    out: dict[int, list[float]] = {}
    for s in seeds:
        for r in read_metrics(root / label / f"seed{s['seed']}"):
            if "eval_start/pass@1" in r:
                out.setdefault(0, []).append(r["eval_start/pass@1"])
            if "eval/pass@1" in r:
                out.setdefault(r["step"] + 1, []).append(r["eval/pass@1"])
    return out


def _separation(values, other) -> str:
    """'above' / 'below' when the 95% intervals of the means do not overlap, else 'overlap'."""
    (m1, h1), (m2, h2) = interval(values), interval(other)
    if math.isnan(h1) or math.isnan(h2):
        return "-"
    if m1 - h1 > m2 + h2:
        return "above"
    if m1 + h1 < m2 - h2:
        return "below"
    return "overlap"


def _matched_control(cure: list[dict], controls: dict[str, list[dict]]) -> str | None:
    """The control whose median per-step KL is nearest the cure's (in log space)."""
    kl = np.median(values_of(cure, "policy_kl_median"))
    best, distance = None, math.inf
    for name, seeds in controls.items():
        other = np.median(values_of(seeds, "policy_kl_median"))
        if kl > 0 and other > 0 and abs(math.log(kl / other)) < distance:
            best, distance = name, abs(math.log(kl / other))
    return best


def comparisons(name, seeds, methods, controls, baselines=()) -> tuple[str, str, str]:
    """The last three cells of a cell's row: whether the final pass@1 of `name` separates
    from synchronous training's, from naive asynchrony's, and from its matched control's
    (the control whose per-step KL is nearest; `baselines` and the controls get none)."""
    final = values_of(seeds, "final_accuracy")
    matched = "-"
    if name not in ("sync", "naive", *baselines) and name not in controls:
        control = _matched_control(seeds, controls)
        if control is not None:
            verdict = _separation(final, values_of(controls[control], "final_accuracy"))
            matched = f"{control}: {verdict}"
    return (
        "-" if name == "sync" else _separation(final, values_of(methods["sync"], "final_accuracy")),
        "-"
        if name in ("sync", "naive")
        else _separation(final, values_of(methods["naive"], "final_accuracy")),
        matched,
    )


def cell(runs: dict, root: Path, out: Path) -> dict[str, str]:
    methods = _prefix(runs)
    if "sync" not in methods or "naive" not in methods:
        return {"v3_cell": "No run of the cell has finished yet."}
    labels = {name: seeds[0]["label"] for name, seeds in methods.items()}
    evals = {n: _evals_at(root, labels[n], s) for n, s in methods.items()}
    steps = sorted(evals["sync"])
    controls = {n: s for n, s in methods.items() if n.startswith("naive_lr")}
    rows = []
    for name, seeds in methods.items():
        rows.append(
            (
                name,
                len(seeds),
                *(
                    ci_cell(evals[name].get(step, [])) if evals[name].get(step) else "-"
                    for step in steps
                ),
                sum(bool(s["collapsed"]) for s in seeds),
                median_cell(seeds, "policy_kl_median"),
                median_cell(seeds, "ess_ratio_median"),
                median_cell(seeds, "c_t_median"),
                *comparisons(name, seeds, methods, controls, baselines=("naive_cap8",)),
            )
        )
    header = (
        "method",
        "seeds",
        *(f"pass@1 after {s}" for s in steps),
        "collapsed",
        "per-step KL",
        "ESS ratio",
        "c_t",
        "final vs sync",
        "final vs naive",
        "vs matched control",
    )
    eval_curves_figure(evals, out / "v3_cell.png", "Laboratory v3")
    text = markdown_table(header, rows, escape=False)
    return {"v3_cell": text}


def removed_fraction(records) -> float:
    """The mean, over steps with a gradient, of the fraction of the gradient's norm GAC
    removed: 1 at a skip; at a projection along the reference (global scope), the part
    orthogonal to it is kept, so |g'| / |g| = sqrt((1 - c^2) / (1 - c'^2)) with c and c'
    the cosines with the reference before and after."""
    removed = []
    for r in records[1:]:
        if r.get("grad_norm", 0.0) <= 0.0 or "gac_regime" not in r:
            continue
        regime, c, c_after = r["gac_regime"], r["gac_cosine"], r["gac_cosine_after"]
        if regime == 2:
            removed.append(1.0)
        elif regime == 1:
            removed.append(1.0 - math.sqrt((1 - c * c) / max(1 - c_after * c_after, 1e-12)))
        else:
            removed.append(0.0)
    return float(np.mean(removed)) if removed else math.nan


def gac(runs: dict, root: Path) -> dict[str, str]:
    rows = []
    for name, seeds in _prefix(runs).items():
        if not name.startswith("gac"):
            continue
        label = seeds[0]["label"]
        removed = [removed_fraction(read_metrics(root / label / f"seed{s['seed']}")) for s in seeds]
        rows.append(
            (
                name,
                len(seeds),
                ci_cell(values_of(seeds, "project_fraction")),
                ci_cell(values_of(seeds, "skip_fraction")),
                ci_cell(removed),
                median_cell(seeds, "c_t_median"),
                median_cell(seeds, "c_after_median"),
            )
        )
    if not rows:
        return {"v3_gac": "No GAC run of the cell has finished yet."}
    header = (
        "method",
        "seeds",
        "steps projected",
        "steps skipped",
        "norm removed",
        "median c_t",
        "median c_t after",
    )
    return {"v3_gac": markdown_table(header, rows, escape=False)}


ONSET_WINDOW = 10


def collapse_onset(records) -> int:
    """Where a collapsed run's reward started to fall: the last step of the first
    `ONSET_WINDOW`-step window whose mean batch reward is below half the first window's.
    The summary's collapse rule (25-step windows) cannot fire before step 49, after most
    of these runs' rewards had already fallen, so warnings are timed against this onset."""
    reward = np.array([r.get("reward", math.nan) for r in records], dtype=np.float64)
    w = ONSET_WINDOW
    start = np.nanmean(reward[:w])
    trailing = np.convolve(reward, np.ones(w) / w, mode="valid")
    below = np.nonzero(trailing[w:] < 0.5 * start)[0]
    return int(records[below[0] + 2 * w - 1]["step"]) if len(below) else int(records[-1]["step"])


def diagnostics(runs: dict, root: Path, out: Path) -> dict[str, str]:
    methods = _prefix(runs)
    if not methods:
        return {"v3_diagnostics": "No run of the cell has finished yet."}
    fig, axes = figure(3, width=8.0)
    for name in ("sync", "naive", "gac", "gac_adaptive"):
        if name not in methods:
            continue
        seeds = methods[name]
        series = [
            [
                r.get("gac_cosine", math.nan)
                for r in read_metrics(root / seeds[0]["label"] / f"seed{s['seed']}")
            ]
            for s in seeds
        ]
        length = min(len(x) for x in series)
        mean = np.nanmean([x[:length] for x in series], axis=0)
        smooth = np.convolve(mean, np.ones(5) / 5, mode="valid")
        axes[0].plot(np.arange(len(smooth)) + 2, smooth, label=name)
    axes[0].set(
        xlabel="step", ylabel="c_t (mean of seeds, 5-step mean)", title="c_t along training"
    )
    axes[0].legend(fontsize="small")
    fired = {"ess": [0, 0], "spike": [0, 0]}  # [before a collapse, in a run without one]
    collapsed_runs = kept_runs = 0
    for seeds in methods.values():
        for s in seeds:
            records = read_metrics(root / s["label"] / f"seed{s['seed']}")
            if s["collapse_step"] is None:
                kept_runs += 1
                fired["ess"][1] += s["ess_drop_step"] is not None
                fired["spike"][1] += s["grad_spike_step"] is not None
                continue
            collapsed_runs += 1
            onset = collapse_onset(records)
            fired["ess"][0] += s["ess_drop_step"] is not None and s["ess_drop_step"] < onset
            fired["spike"][0] += s["grad_spike_step"] is not None and s["grad_spike_step"] < onset
            at = [r["step"] - onset for r in records]
            axes[1].plot(at, [r.get("ess_ratio", math.nan) for r in records], lw=0.8)
            axes[2].plot(at, [r.get("grad_norm", math.nan) for r in records], lw=0.8)
    axes[1].set(ylabel="ESS ratio", title="Around each collapse (step 0: its onset)")
    axes[2].set(xlabel="steps from the onset of the collapse", ylabel="gradient norm", yscale="log")
    fig.savefig(out / "v3_diagnostics.png", dpi=100)
    rows = [
        ("ESS ratio below 0.5", *fired["ess"]),
        ("gradient norm above 3x its early median", *fired["spike"]),
    ]
    header = (
        "warning",
        f"fired before the collapse ({collapsed_runs} collapsed runs)",
        f"fired in a run that did not collapse ({kept_runs} runs)",
    )
    return {"v3_diagnostics": markdown_table(header, rows, escape=False)}


def _filtered_per_step(root: Path, seeds: list[dict]) -> str:
    """Dynamic sampling's mean groups discarded a step (its metric `groups_filtered`)."""
    values = [
        r["groups_filtered"]
        for s in seeds
        for r in read_metrics(root / s["label"] / f"seed{s['seed']}")
        if "groups_filtered" in r
    ]
    return f"{np.mean(values):.1f}" if values else "-"


def staleness_map(runs: dict, root: Path) -> dict[str, str]:
    """Each naive loss at each staleness: final pass@1, collapses, and whether its interval
    separates from the same loss trained synchronously (k=0)."""
    rows = []
    for loss in lab.MAP_LOSSES:
        found = {}
        for label, seeds in runs.items():
            for k in sorted({*lab.MAP_LAGS, *lab.QUICK["lags"]}):
                if label in (lab.map_label(loss, k), f"v3map/{loss}/k{k}"):
                    found[k] = seeds
        sync = values_of(found[0], "final_accuracy") if 0 in found else []
        for k, seeds in sorted(found.items()):
            final = values_of(seeds, "final_accuracy")
            rows.append(
                (
                    loss,
                    k,
                    len(seeds),
                    ci_cell(final),
                    f"{sum(bool(s['collapsed']) for s in seeds)}/{len(seeds)}",
                    median_cell(seeds, "ess_ratio_median"),
                    median_cell(seeds, "c_t_median"),
                    _filtered_per_step(root, seeds),
                    "-" if k == 0 or not sync else _separation(final, sync),
                )
            )
    if not rows:
        return {"v3_map": "No run of the map has finished yet."}
    header = (
        "loss",
        "k",
        "seeds",
        "final pass@1",
        "collapsed",
        "ESS ratio",
        "c_t",
        "groups filtered a step",
        "vs its sync",
    )
    return {"v3_map": markdown_table(header, rows, escape=False)}


def blocks(runs: dict, root: Path, out: Path) -> dict[str, str]:
    """Every v3 block of RESULTS.md."""
    return {
        **staleness_map(runs, root),
        **cell(runs, root, out),
        **gac(runs, root),
        **diagnostics(runs, root, out),
    }
