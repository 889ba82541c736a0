"""Sweeps: the collapse rule, run summaries against NumPy, resumable runs, aggregation."""

import json
import math

import numpy as np
import pytest

from gac_jax.train import get_preset
from gac_jax.train.metrics import MetricWriter
from gac_jax.train.sweeps import (
    METHODS,
    CollapseRule,
    RunSpec,
    aggregate,
    collapse_step,
    load_summaries,
    markdown_table,
    run_spec,
    shard,
    summarize_run,
)
from gac_jax.transforms import ESSConfig


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


def _fake_train(calls):
    def train(config, out_dir, *, resume):
        calls.append((config.seed, resume))
        with MetricWriter(out_dir) as writer:
            for t in range(config.steps):
                writer.write(t, {"reward": 0.25, "loss": 0.0, "grad_norm": 1.0, "ess_ratio": 1.0})

    return train


def test_run_spec_writes_a_summary_once_and_refuses_another_config(tmp_path):
    base = get_preset("countdown_sweep")
    spec = RunSpec("gac/k8", ("rollout.lag=8", *METHODS["gac"]), seed=3)
    calls = []
    first = run_spec(spec, base, tmp_path, train_fn=_fake_train(calls))
    again = run_spec(spec, base, tmp_path, train_fn=_fake_train(calls))
    assert calls == [(3, True)]  # The second call read the summary.
    assert json.dumps(first) == json.dumps(again)
    assert first["label"] == "gac/k8" and first["steps"] == base.steps
    assert json.loads((tmp_path / "gac/k8/seed3/summary.json").read_text())["seed"] == 3
    other = RunSpec("gac/k8", ("rollout.lag=4",), seed=3)
    with pytest.raises(ValueError, match="written by another config"):
        run_spec(other, base, tmp_path, train_fn=_fake_train(calls))
    assert [s["label"] for s in load_summaries(tmp_path)] == ["gac/k8"]


def test_shard_partitions_and_rejects_bad_indices():
    specs = [RunSpec(f"r{i}", (), 0) for i in range(5)]
    parts = [shard(specs, i, 2) for i in range(2)]
    assert sorted(s.label for p in parts for s in p) == [s.label for s in specs]
    with pytest.raises(ValueError, match="shard index 2"):
        shard(specs, 2, 2)


def test_methods_are_valid_overrides_of_the_sweep_preset():
    base = get_preset("countdown_sweep")
    configs = {name: RunSpec(name, o, 0).config(base) for name, o in METHODS.items()}
    assert configs["naive"] == base
    assert base.gac.monitor_only and base.ess is None
    assert not configs["gac"].gac.monitor_only and configs["gac"].ess is None
    assert configs["vcpo"].ess == ESSConfig() and configs["vcpo"].loss.advantage == "vcpo"
    assert configs["gac_vcpo"].ess == ESSConfig() and not configs["gac_vcpo"].gac.monitor_only
    assert configs["seq_tis"].loss.correction_kwargs == {"level": "sequence", "cap": 2.0}
    assert len({str(c) for c in configs.values()}) == len(METHODS)  # All distinct.


def test_aggregate_and_table():
    summaries = [
        {"label": "a", "seed": 0, "collapsed": False, "final_accuracy": 0.2},
        {"label": "a", "seed": 1, "collapsed": True, "final_accuracy": 0.4},
        {"label": "b", "seed": 0, "collapsed": False, "final_accuracy": 0.1},
    ]
    rows = aggregate(summaries, ["final_accuracy"])
    assert [r["label"] for r in rows] == ["a", "b"]
    np.testing.assert_allclose(rows[0]["final_accuracy"], 0.3)
    np.testing.assert_allclose(rows[0]["final_accuracy_std"], np.std([0.2, 0.4], ddof=1))
    assert rows[0]["collapsed"] == 1 and rows[1]["final_accuracy_std"] == 0.0
    table = markdown_table(rows, {"label": "method", "final_accuracy": "accuracy"}, digits=2)
    assert table.splitlines()[2] == "| a | 0.30 ± 0.14 |"
