"""A run's reported numbers from its metric records: collapse, gradient cosines, held-out
accuracy and its gain, how far a step moves the policy, the gradient noise scale.

`summarize_run` is what a sweep writes into each run's ``summary.json``
(`gac_jax.lab.sweeps.run_spec`); the experiments' tables are made from those summaries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """A run collapsed at the first step where the batch reward's trailing `window`-step mean
    falls below `fraction` of its mean over the run's first `window` steps (checked from step
    `2 * window - 1` on), or where the loss or gradient norm is not finite."""

    window: int = 25
    fraction: float = 0.5

    def describe(self) -> str:
        return (
            f"the trailing {self.window}-step mean batch reward falls below "
            f"{self.fraction:g} x its mean over the first {self.window} steps, or the loss "
            "or gradient norm is not finite"
        )


def _series(records: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) for r in records if key in r], dtype=np.float64)


def collapse_step(records: Sequence[Mapping[str, Any]], rule: CollapseRule) -> int | None:
    """The step at which `rule` says the run collapsed, or None."""
    for r in records:
        if not (math.isfinite(r.get("loss", 0.0)) and math.isfinite(r.get("grad_norm", 0.0))):
            return int(r["step"])
    reward = _series(records, "reward")
    w = rule.window
    if len(reward) < 2 * w:
        return None
    start = reward[:w].mean()
    trailing = np.convolve(reward, np.ones(w) / w, mode="valid")  # trailing[i]: steps i..i+w-1
    # trailing[w:] are the windows after the first one, ending at steps 2w - 1, 2w, ...
    below = np.nonzero(trailing[w:] < rule.fraction * start)[0]
    return int(records[below[0] + 2 * w - 1]["step"]) if len(below) else None


def _percentile(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else math.nan


def cosine_samples(records: Sequence[Mapping[str, Any]], key: str = "gac_cosine") -> np.ndarray:
    """The per-step cosines `key` of the steps after the first whose gradient is non-zero
    (a batch whose groups all share one reward has no gradient and so no direction)."""
    return _series([r for r in records[1:] if r.get("grad_norm", 0.0) > 0.0], key)


def summarize_run(
    records: Sequence[Mapping[str, Any]], rule: CollapseRule = CollapseRule()
) -> dict[str, Any]:
    """The reported numbers of one run from its metric records. ``c_t`` is the raw
    consecutive-gradient cosine, ``c_after`` that of what the controller emitted (both over
    `cosine_samples`); held-out accuracy is the evaluations' sampled pass@1."""
    if not records:
        raise ValueError("summarize_run needs at least one metric record; got none.")
    c_t = cosine_samples(records)
    c_after = cosine_samples(records, "gac_cosine_after")
    with_grad = [r for r in records[1:] if r.get("grad_norm", 0.0) > 0.0]
    evals = [r for r in records if "eval/pass@1" in r]
    accuracy = [float(r["eval/pass@1"]) for r in evals]
    regimes = _series(records, "gac_regime")
    reward = _series(records, "reward")
    gap = _series(records, "version_gap_mean")
    summary = {
        "steps": len(records),
        "final_accuracy": accuracy[-1] if accuracy else math.nan,
        "best_accuracy": max(accuracy) if accuracy else math.nan,
        "final_greedy_accuracy": float(evals[-1]["eval/greedy_accuracy"]) if evals else math.nan,
        "final_pass_at_k": float(evals[-1].get("eval/pass@8", math.nan)) if evals else math.nan,
        "reward_first": float(reward[: rule.window].mean()),
        "reward_last": float(reward[-rule.window :].mean()),
        "collapse_step": collapse_step(records, rule),
        "c_t_q25": _percentile(c_t, 25),
        "c_t_median": _percentile(c_t, 50),
        "c_t_q75": _percentile(c_t, 75),
        "c_after_median": _percentile(c_after, 50),
        "zero_grad_fraction": 1.0 - len(with_grad) / max(len(records) - 1, 1),
        "ess_ratio_median": _median(records, "ess_ratio"),
        "grad_norm_median": _median(records, "grad_norm"),
        "staleness_mean": float(gap.mean()) if len(gap) else math.nan,
        "staleness_max": float(_series(records, "version_gap_max").max()) if len(gap) else math.nan,
        **_control_statistics(records, regimes),
        **_lab_statistics(records, rule),
    }
    summary["collapsed"] = summary["collapse_step"] is not None
    summary["gain"] = summary["final_accuracy"] - summary["start_accuracy"]
    return summary


def _control_statistics(records: Sequence[Mapping[str, Any]], regimes: np.ndarray) -> dict:
    """What GAC did, at either level: the fractions of steps projected and skipped (a skip
    applies nothing), the median share of the gradient (or update) norm removed on the
    steps it acted on, and the cosine of consecutive applied updates."""
    update_regimes = _series(records, "gac_update_regime")
    projected = regimes == 1
    if len(update_regimes) == len(regimes):
        projected = projected | (update_regimes == 1)
    skipped = _series(records, "gac_skipped")
    if len(skipped) != len(regimes):  # Runs from before the true skip: the regime says.
        skipped = (regimes == 2).astype(float)
    removed = np.concatenate(
        [
            _series([r for r in records if r.get(regime, 0) in (1, 2)], key)
            for regime, key in (
                ("gac_regime", "gac_removed_fraction"),
                ("gac_update_regime", "gac_update_removed_fraction"),
            )
        ]
    )
    applied_cosine = cosine_samples(records, "gac_update_cosine")
    return {
        "project_fraction": float(np.mean(projected & (skipped == 0))) if len(regimes) else 0.0,
        "skip_fraction": float(np.mean(skipped)) if len(skipped) else 0.0,
        "removed_fraction_median": float(np.median(removed)) if len(removed) else math.nan,
        "update_cosine_median": _percentile(applied_cosine, 50),
        "update_cosine_q90": _percentile(applied_cosine, 90),
        "c_t_q90": _percentile(cosine_samples(records), 90),
    }


def _median(records: Sequence[Mapping[str, Any]], key: str) -> float:
    values = _series(records, key)
    return float(np.median(values)) if len(values) else math.nan


def first_step(records: Sequence[Mapping[str, Any]], key: str, test: Callable) -> int | None:
    """The first step whose `key` passes `test`, or None."""
    for r in records:
        if key in r and test(float(r[key])):
            return int(r["step"])
    return None


def noise_scale(records: Sequence[Mapping[str, Any]]) -> float:
    """B_simple over `records`: the mean of ``noise/trace`` over the mean of
    ``noise/grad_sq`` (each step's estimates are unbiased but noisy, so they are averaged
    before the ratio, as McCandlish et al. do); nan without them."""
    trace, grad_sq = _series(records, "noise/trace"), _series(records, "noise/grad_sq")
    if not len(trace) or not grad_sq.mean() > 0:
        return math.nan
    return float(trace.mean() / grad_sq.mean())


def _lab_statistics(records: Sequence[Mapping[str, Any]], rule: CollapseRule) -> dict[str, Any]:
    """Held-out pass@1 before training, how far a step moves the policy, the noise scale,
    and the warnings that may precede a collapse (the first ESS ratio below 0.5, the first
    gradient norm above 3x its median over the first `rule.window` steps)."""
    # Step 0's last record with several optimizer steps a batch (the loop's evaluations).
    start = next((r["eval_start/pass@1"] for r in records if "eval_start/pass@1" in r), math.nan)
    early_grad = _series(records[: rule.window], "grad_norm")
    spike = 3.0 * float(np.median(early_grad)) if len(early_grad) else math.inf
    return {
        "start_accuracy": float(start),
        "policy_kl_median": _median(records, "policy_change/kl"),
        "clip_fraction_median": _median(records, "loss/clip_fraction"),
        "b_simple": noise_scale(records),
        # At three points of training: the thirds of the run.
        "b_simple_thirds": [
            noise_scale(records[len(records) * i // 3 : len(records) * (i + 1) // 3])
            for i in range(3)
        ],
        "noise_batch_size": _median(records, "noise/batch_size"),
        "ess_drop_step": first_step(records, "ess_ratio", lambda x: x < 0.5),
        "grad_spike_step": first_step(records, "grad_norm", lambda x: x > spike),
    }
