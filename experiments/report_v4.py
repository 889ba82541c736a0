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
- ``v4_theory`` (with ``--theory``; computed, no runs): the stability boundary of delayed
  gradient descent on a noisy quadratic (`gac_jax.toys.delayed_quadratic`), the largest
  step that still converges at each staleness, for SGD, Adam, Adam with less momentum and
  each GAC variant. Figure: ``v4_theory.png``.
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
from report_tables import ci_cell, eval_curves_figure, figure, median_cell, values_of
from report_v3 import _evals_at, _separation, comparisons, runs_by_method

from gac_jax.lab.sweeps import load_summaries
from gac_jax.toys.delayed_quadratic import DelayedQuadratic, sgd_stability_limit, stability_boundary
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


def _gac(control, acts_on="gradient"):
    return lambda lr: alignment_controlled(optax.adam(lr), control, acts_on=acts_on)


THEORY_CHAINS = {  # name -> (make_tx(lr), what it is)
    "sgd": (lambda lr: optax.sgd(lr), "SGD"),
    "sgd_momentum": (lambda lr: optax.sgd(lr, momentum=0.9), "SGD, momentum 0.9"),
    "adam": (lambda lr: optax.adam(lr), "Adam (b1 0.9)"),
    "adam_b1_0.5": (lambda lr: optax.adam(lr, b1=0.5), "Adam, b1 0.5"),
    "adam_b1_0": (lambda lr: optax.adam(lr, b1=0.0), "Adam, b1 0 (RMSProp-like)"),
    "gac": (_gac(gradient_alignment_control(0.2, 0.8)), "Adam + GAC on gradients, 0.2 / 0.8"),
    "gac_project": (
        _gac(gradient_alignment_control(0.2, 1.0, projection="full", skip=False)),
        "Adam + GAC on gradients, full projection above 0.2, no skip",
    ),
    "gac_update": (
        _gac(gradient_alignment_control(0.9, 0.97, reference="update"), "update"),
        "Adam + GAC on applied updates, 0.9 / 0.97",
    ),
}


def theory(out: Path, problem: DelayedQuadratic | None = None) -> dict[str, str]:
    """The largest converging step at each staleness for every chain of `THEORY_CHAINS`."""
    problem = DelayedQuadratic() if problem is None else problem
    bounds = {
        name: stability_boundary(make, THEORY_LAGS, THEORY_RATES, problem)
        for name, (make, _) in THEORY_CHAINS.items()
    }
    fmt = lambda x: "none" if np.isnan(x) else f"{x:.3g}"  # noqa: E731
    rows = [
        (name, what, *(fmt(bounds[name][k]) for k in THEORY_LAGS))
        for name, (_, what) in THEORY_CHAINS.items()
    ]
    h_max = problem.curvature[1]
    rows.append(
        (
            "sgd, closed form",
            "2 sin(pi / (2 (2k + 1))) / h_max",
            *(f"{sgd_stability_limit(k, h_max):.3g}" for k in THEORY_LAGS),
        )
    )
    header = ("chain", "what", *(f"k={k}" for k in THEORY_LAGS))
    fig, (ax,) = figure(1, width=8.0)
    lags = np.asarray(THEORY_LAGS[1:])
    for name in THEORY_CHAINS:
        ax.plot(lags, [bounds[name][k] for k in lags], "-o", label=name)
    ax.plot(lags, [sgd_stability_limit(k, h_max) for k in lags], "k--", label="sgd, closed form")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="staleness k",
        ylabel="largest step that converges",
        title="Delayed gradient descent on a noisy quadratic",
    )
    ax.legend(fontsize="small", ncol=2)
    fig.savefig(out / "v4_theory.png", dpi=100)
    return {"v4_theory": markdown_table(header, rows, escape=False)}


def main(argv=None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="experiments/runs/lab/lagged", type=Path)
    parser.add_argument("--out", default="experiments/results", type=Path)
    parser.add_argument("--results-md", default="experiments/RESULTS.md")
    parser.add_argument(
        "--theory", action="store_true", help="also compute the delayed quadratic's boundaries"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    if args.root.exists():
        found = [s for s in load_summaries(args.root) if s["label"].startswith("v4")]
        runs = by_label(found)
    blocks = {**cell(runs, args.root, args.out), **gac(runs), **alignment_map(runs, args.root)}
    if args.theory:
        blocks.update(theory(args.out))
    publish(blocks, args.results_md)
    return blocks


if __name__ == "__main__":
    main()
