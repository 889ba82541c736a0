"""Laboratory v4's tables and figure (issue #41), from the runs of `lab.py --only v4 v4map`.

    python experiments/report_v4.py [--root experiments/runs/lab/lagged]
        [--out experiments/results] [--results-md experiments/RESULTS.md]

- ``v4_cell``: every method of the cell (stale rollouts trained as on-policy at k=16, 128
  prompts a step): held-out pass@1 at each evaluation (mean of the seeds, 95% Student-t
  interval), collapses, the median per-step KL (how far an update moves the policy), the
  median `c_t` over the run and over its first 40 steps (the paper's predictor, before
  any collapse), the median cosine of consecutive applied updates, and whether the final
  pass@1 separates from sync's, naive's and the matched control's (the naive run at the
  step size or momentum whose per-step KL is nearest the method's). Figure:
  ``v4_cell.png``.
- ``v4_gac``: what each GAC variant did: steps projected and skipped, the median share of
  the norm removed on the steps it acted on, both cosines before and after.
- ``v4_map``: naive asynchrony at each batch size and lag, with the gradient noise scale:
  the final pass@1 against its sync's, and the three candidate signals (`c_t`, the
  per-step KL, the ESS ratio) over the run and over its first 40 steps, before the loss.
- ``v4_theory`` (``--theory`` alone: computed, no runs; the run blocks are left as they
  are): delayed gradient descent on a noisy quadratic (`gac_jax.toys.delayed_quadratic`),
  the steps of a 48-point grid that converge at each staleness, as ``low-high`` (pieces
  joined by `` / `` where the converging steps have gaps), for SGD, Adam, Adam with less
  momentum and each GAC variant (as v4 ran them, skips unbounded, and with the default
  bound of 8). Figure: ``v4_theory.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# ruff: noqa: E402  (experiments/ is importable first)
import lab
import optax
from report import by_label, publish
from report_tables import ci_cell, eval_curves_figure, median_cell, values_of
from report_v3 import _evals_at, _separation, comparisons, runs_by_method

from gac_jax.lab.sweeps import load_summaries
from gac_jax.toys.delayed_quadratic import (
    DelayedQuadratic,
    converged,
    delayed_losses,
    sgd_stability_limit,
)
from gac_jax.train.metrics import markdown_table, read_metrics
from gac_jax.transforms import alignment_controlled, gradient_alignment_control

EARLY_STEPS = 40  # The pilot's naive runs had not yet collapsed by step 40.


def _methods(runs: dict) -> dict[str, list[dict]]:
    """The cell's runs by method name (labels ``v4/<name>/k<lag>``), in the cell's order."""
    return runs_by_method(runs, lab.V4_ORDER, "v4")


def _early(root: Path, seeds: list[dict], key: str = "gac_cosine") -> float:
    """The median of metric `key` over steps 1 to `EARLY_STEPS` of the seeds' runs (for
    `c_t`, the steps with a gradient: a step without one has no direction)."""
    values = [
        r[key]
        for s in seeds
        for r in read_metrics(root / s["label"] / f"seed{s['seed']}")[1 : EARLY_STEPS + 1]
        if key in r and (key != "gac_cosine" or r.get("grad_norm", 0.0) > 0)
    ]
    return float(np.median(values)) if values else float("nan")


def cell(runs: dict, root: Path, out: Path) -> dict[str, str]:
    methods = _methods(runs)
    if "sync" not in methods or "naive" not in methods:
        return {"v4_cell": "No run of the cell has finished yet (sync and naive first)."}
    evals = {n: _evals_at(root, s[0]["label"], s) for n, s in methods.items()}
    steps = sorted(evals["sync"])
    controls = {n: s for n, s in methods.items() if n.startswith("naive_")}
    rows = []
    for name, seeds in methods.items():
        rows.append(
            (
                name,
                len(seeds),
                *(ci_cell(evals[name][s]) if evals[name].get(s) else "-" for s in steps),
                sum(bool(s["collapsed"]) for s in seeds),
                median_cell(seeds, "policy_kl_median"),
                median_cell(seeds, "c_t_median"),
                f"{_early(root, seeds):.3g}",
                median_cell(seeds, "update_cosine_median"),
                median_cell(seeds, "ess_ratio_median"),
                *comparisons(name, seeds, methods, controls),
            )
        )
    header = (
        "method",
        "seeds",
        *(f"pass@1 after {s}" for s in steps),
        "collapsed",
        "per-step KL",
        "c_t",
        f"c_t, steps 1-{EARLY_STEPS}",
        "applied-update cosine",
        "ESS ratio",
        "final vs sync",
        "final vs naive",
        "vs matched control",
    )
    eval_curves_figure(evals, out / "v4_cell.png", "Laboratory v4")
    return {"v4_cell": markdown_table(header, rows, escape=False)}


def gac(runs: dict) -> dict[str, str]:
    rows = [
        (
            name,
            len(seeds),
            ci_cell(values_of(seeds, "project_fraction")),
            ci_cell(values_of(seeds, "skip_fraction")),
            median_cell(seeds, "removed_fraction_median"),
            median_cell(seeds, "c_t_median"),
            median_cell(seeds, "c_after_median"),
            median_cell(seeds, "update_cosine_median"),
        )
        for name, seeds in _methods(runs).items()
        if name.startswith("gac")
    ]
    if not rows:
        return {"v4_gac": "No GAC run of the cell has finished yet."}
    header = (
        "method",
        "seeds",
        "steps projected",
        "steps skipped",
        "norm removed (acting steps)",
        "median c_t",
        "median c_t after",
        "median applied-update cosine",
    )
    return {"v4_gac": markdown_table(header, rows, escape=False)}


def alignment_map(runs: dict, root: Path) -> dict[str, str]:
    cells = {}  # (prompts a step, lag) -> seeds, from the labels v4map/g<groups>/k<lag>.
    for label, seeds in runs.items():
        if label.startswith("v4map/"):
            groups, lag = label.split("/")[1:]
            cells[int(groups.removeprefix("g")), int(lag.removeprefix("k"))] = seeds
    rows = []
    for (groups, lag), seeds in sorted(cells.items()):
        sync = cells.get((groups, 0), [])
        final = values_of(seeds, "final_accuracy")
        versus = (
            "-" if lag == 0 or not sync else _separation(final, values_of(sync, "final_accuracy"))
        )
        rows.append(
            (
                groups,
                lag,
                len(seeds),
                ci_cell(final),
                versus,
                median_cell(seeds, "c_t_median"),
                f"{_early(root, seeds):.3g}",
                median_cell(seeds, "policy_kl_median"),
                f"{_early(root, seeds, 'policy_change/kl'):.3g}",
                median_cell(seeds, "ess_ratio_median"),
                f"{_early(root, seeds, 'ess_ratio'):.3g}",
                median_cell(seeds, "b_simple"),
            )
        )
    if not rows:
        return {"v4_map": "No run of the map has finished yet."}
    header = (
        "prompts a step",
        "k",
        "seeds",
        "final pass@1",
        "vs its sync",
        "c_t",
        "c_t, steps 1-40",
        "per-step KL",
        "KL, steps 1-40",
        "ESS ratio",
        "ESS, steps 1-40",
        "B_simple (tokens)",
    )
    return {"v4_map": markdown_table(header, rows, escape=False)}


THEORY_LAGS = (0, 1, 2, 4, 8, 16)
THEORY_RATES = np.geomspace(1e-3, 3.0, 48)


def _gac(acts_on="gradient", **control):
    """Adam under GAC; `control`: `gradient_alignment_control`'s arguments."""
    return lambda lr: alignment_controlled(
        optax.adam(lr), gradient_alignment_control(**control), acts_on=acts_on
    )


_UPDATE = dict(tau_low=0.9, tau_high=0.97, reference="update", acts_on="update")
THEORY_CHAINS = {  # name -> (make_tx(lr), what it is); v4's GAC rows skip without bound.
    "sgd": (lambda lr: optax.sgd(lr), "SGD"),
    "sgd_momentum": (lambda lr: optax.sgd(lr, momentum=0.9), "SGD, momentum 0.9"),
    "adam": (lambda lr: optax.adam(lr), "Adam (b1 0.9)"),
    "adam_b1_0.5": (lambda lr: optax.adam(lr, b1=0.5), "Adam, b1 0.5"),
    "adam_b1_0": (lambda lr: optax.adam(lr, b1=0.0), "Adam, b1 0 (RMSProp-like)"),
    "gac": (
        _gac(tau_low=0.2, tau_high=0.8, max_consecutive_skips=None),
        "Adam + GAC on gradients, 0.2 / 0.8, skips unbounded (as v4 ran)",
    ),
    "gac_project": (
        _gac(tau_low=0.2, tau_high=1.0, projection="full", skip=False),
        "Adam + GAC on gradients, full projection above 0.2, no skip",
    ),
    "gac_update": (
        _gac(**_UPDATE, max_consecutive_skips=None),
        "Adam + GAC on applied updates, 0.9 / 0.97, skips unbounded (as v4 ran)",
    ),
    "gac, skips <= 8": (
        _gac(tau_low=0.2, tau_high=0.8),
        "`gac` with at most 8 skips in a row (the default now)",
    ),
    "gac_update, skips <= 8": (
        _gac(**_UPDATE),
        "`gac_update` with at most 8 skips in a row (the default now)",
    ),
}


def step_ranges(ok: np.ndarray, rates: np.ndarray = THEORY_RATES) -> str:
    """The converging steps of a grid (`ok`, bool per rate) as ``low-high``; where they are
    not contiguous, one ``low-high`` per run of converging grid points, joined by `` / ``
    (the steps between two runs fail); "none" where no step converges."""
    hits = np.flatnonzero(ok)
    runs = np.split(hits, np.flatnonzero(np.diff(hits) > 1) + 1) if hits.size else []
    cell = lambda run: "-".join(dict.fromkeys(f"{rates[i]:.3g}" for i in run[[0, -1]]))  # noqa: E731
    return " / ".join(map(cell, runs)) or "none"


def theory(out: Path, problem: DelayedQuadratic | None = None) -> dict[str, str]:
    """Every chain of `THEORY_CHAINS`' converging steps of `THEORY_RATES` at each staleness."""
    problem = DelayedQuadratic() if problem is None else problem
    lags, rates = THEORY_LAGS, THEORY_RATES
    ok = {  # name -> bool [lags, rates]: each grid run once, for the table and the figure.
        name: np.stack([converged(delayed_losses(make, k, rates, problem), problem) for k in lags])
        for name, (make, _) in THEORY_CHAINS.items()
    }
    rows = [
        (n, what, *(step_ranges(o, rates) for o in ok[n])) for n, (_, what) in THEORY_CHAINS.items()
    ]
    h_max = problem.curvature[1]
    limits = [sgd_stability_limit(k, h_max) for k in lags]
    rows.append(
        (
            "sgd, closed form",
            "stable below 2 sin(pi / (2 (2k + 1))) / h_max",
            *(f"< {x:.3g}" for x in limits),
        )
    )
    header = ("chain", "what", *(f"k={k}" for k in lags))
    _theory_figure(ok, lags, rates, limits, out / "v4_theory.png")
    return {"v4_theory": markdown_table(header, rows, escape=False)}


def _theory_figure(ok: dict, lags: tuple, rates: np.ndarray, limits: list, path: Path) -> None:
    """One panel a chain: its converging (k, step) points of the grid over Adam's (grey),
    and SGD's stability limit."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.0, 5.6), layout="constrained")
    axes = fig.subplots(2, (len(ok) + 1) // 2, sharex=True, sharey=True).ravel()
    xs = np.arange(len(lags))
    for ax, (name, grid) in zip(axes, ok.items(), strict=False):
        for points, style in ((ok["adam"], "0.8"), (grid, "tab:blue")):
            k, r = np.nonzero(points)
            ax.plot(xs[k], rates[r], "s", ms=3.5, color=style)
        ax.plot(xs, limits, "k--", lw=1)
        ax.set(title=name, yscale="log", ylim=rates[[0, -1]], xticks=xs)
        ax.set_xticklabels(lags)
        ax.title.set_fontsize("small")
    for ax in axes[len(ok) :]:
        ax.set_axis_off()
    fig.supxlabel("staleness k")
    fig.supylabel("steps that converge")
    fig.suptitle(
        "Delayed gradient descent on a noisy quadratic: the steps of the grid that converge"
        " (blue; grey: Adam's; dashed: SGD's stability limit)"
    )
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="experiments/runs/lab/lagged", type=Path)
    parser.add_argument("--out", default="experiments/results", type=Path)
    parser.add_argument("--results-md", default="experiments/RESULTS.md")
    parser.add_argument(
        "--theory", action="store_true", help="only the delayed quadratic's block (no runs)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.theory:  # Alone, so that it never overwrites the run blocks with "no run yet".
        blocks = theory(args.out)
    else:
        found = load_summaries(args.root) if args.root.exists() else []
        runs = by_label([s for s in found if s["label"].startswith("v4")])
        blocks = {**cell(runs, args.root, args.out), **gac(runs), **alignment_map(runs, args.root)}
    publish(blocks, args.results_md)
    return blocks


if __name__ == "__main__":
    main()
