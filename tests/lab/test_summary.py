"""Run summaries: the collapse rule and the reported statistics against NumPy."""

import math

import numpy as np
import pytest

from gac_jax.lab.summary import CollapseRule, collapse_step, summarize_run


def _records(rewards, **series):
    out = []
    for t, reward in enumerate(rewards):
        r = {"step": t, "reward": float(reward), "loss": 0.1, "grad_norm": 1.0}
        for key, values in series.items():
            if values[t] is not None:
                r[key] = values[t]
        out.append(r)
    return out


def test_collapse_is_the_first_step_whose_trailing_mean_falls_below_the_fraction():
    rule = CollapseRule(window=4, fraction=0.5)
    rewards = [0.4] * 10 + [0.0] * 10  # Trailing mean of 4 first < 0.2 at step 12.
    assert collapse_step(_records(rewards), rule) == 12
    assert collapse_step(_records([0.4] * 20), rule) is None
    # Falls early but the rule only looks from step 2 * window - 1 on.
    early = [0.4] * 4 + [0.0] * 4 + [0.4] * 12
    assert collapse_step(_records(early), rule) == 7
    assert collapse_step(_records([0.4] * 5), rule) is None  # Too short to judge.


def test_a_non_finite_loss_or_gradient_is_a_collapse_at_that_step():
    records = _records([0.4] * 20)
    records[6]["grad_norm"] = math.inf
    records[9]["loss"] = math.nan
    assert collapse_step(records, CollapseRule(window=4)) == 6


def test_summary_statistics_match_numpy():
    rng = np.random.default_rng(0)
    n = 60
    cos = rng.uniform(-1, 1, n)
    grad = rng.uniform(0.5, 2.0, n)
    grad[[5, 17]] = 0.0  # No gradient: left out of the cosine statistics.
    ess = rng.uniform(0.1, 1.0, n)
    evals = [None] * n
    evals[29] = 0.2
    evals[59] = 0.15
    records = _records(
        rng.uniform(0, 1, n),
        gac_cosine=list(cos),
        gac_cosine_after=list(np.minimum(cos, 0.2)),
        ess_ratio=list(ess),
        version_gap_mean=[4.0] * n,
        version_gap_max=[8.0] * n,
        gac_regime=[0] * 50 + [1] * 8 + [2] * 2,
    )
    for r, g in zip(records, grad, strict=True):
        r["grad_norm"] = float(g)
    for t in (29, 59):
        records[t].update(
            {"eval/pass@1": evals[t], "eval/greedy_accuracy": 0.3, "eval/pass@8": 0.6}
        )
    s = summarize_run(records, CollapseRule(window=10))
    used = np.array([t for t in range(1, n) if grad[t] > 0])
    np.testing.assert_allclose(
        [s["c_t_q25"], s["c_t_median"], s["c_t_q75"]], np.percentile(cos[used], [25, 50, 75])
    )
    np.testing.assert_allclose(s["c_after_median"], np.median(np.minimum(cos, 0.2)[used]))
    np.testing.assert_allclose(s["zero_grad_fraction"], 2 / (n - 1))
    np.testing.assert_allclose(s["ess_ratio_median"], np.median(ess))
    assert s["final_accuracy"] == 0.15 and s["best_accuracy"] == 0.2
    assert s["staleness_mean"] == 4.0 and s["staleness_max"] == 8.0
    np.testing.assert_allclose([s["project_fraction"], s["skip_fraction"]], [8 / n, 2 / n])
    with pytest.raises(ValueError, match="at least one metric record"):
        summarize_run([])


def test_lab_statistics_match_numpy():
    rng = np.random.default_rng(1)
    n = 30
    trace, grad_sq = rng.uniform(100, 900, n), rng.uniform(0.5, 2.0, n)
    kl, clip = rng.uniform(0, 1e-3, n), rng.uniform(0, 0.1, n)
    ess = np.linspace(1.0, 0.3, n)  # Below 0.5 from step 22 on.
    grad = np.ones(n)
    grad[17] = 3.5  # Above 3x the median of the first 10 steps (1.0).
    records = _records(
        rng.uniform(0, 1, n),
        ess_ratio=list(ess),
        **{"noise/trace": list(trace), "noise/grad_sq": list(grad_sq)},
        **{"policy_change/kl": list(kl), "loss/clip_fraction": list(clip)},
        **{"noise/batch_size": [700.0] * n},
    )
    for r, g in zip(records, grad, strict=True):
        r["grad_norm"] = float(g)
    # As with several optimizer steps a batch: the evaluation before training sits in a
    # later record of step 0, not the first one.
    records[1]["eval_start/pass@1"] = 0.05
    records[-1].update({"eval/pass@1": 0.2, "eval/greedy_accuracy": 0.3})
    s = summarize_run(records, CollapseRule(window=10))
    assert s["start_accuracy"] == 0.05 and s["gain"] == pytest.approx(0.15)
    np.testing.assert_allclose(s["b_simple"], trace.mean() / grad_sq.mean())
    np.testing.assert_allclose(
        s["b_simple_thirds"],
        [trace[i : i + 10].mean() / grad_sq[i : i + 10].mean() for i in (0, 10, 20)],
    )
    np.testing.assert_allclose(
        [s["policy_kl_median"], s["clip_fraction_median"], s["noise_batch_size"]],
        [np.median(kl), np.median(clip), 700.0],
    )
    assert s["ess_drop_step"] == int(np.argmax(ess < 0.5)) and s["grad_spike_step"] == 17
    bare = summarize_run(_records([0.5] * 5))  # No evaluations, no noise scale.
    assert (
        math.isnan(bare["gain"]) and math.isnan(bare["b_simple"]) and bare["ess_drop_step"] is None
    )
