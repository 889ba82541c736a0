"""Sweeps: resumable runs, shards, aggregation and its table, the code version of each run
and the refusal of stale runs and mixed tables."""

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import flax
import jax
import optax
import pytest

import gac_jax
from gac_jax.lab.provenance import check_one_version, code_version, runs_by_version
from gac_jax.lab.sweeps import (
    METHODS,
    RunSpec,
    StaleRunError,
    SweepProcesses,
    add_sweep_arguments,
    load_summaries,
    run_spec,
    run_sweep,
    shard,
    stale_setting,
)
from gac_jax.train import get_preset
from gac_jax.train.metrics import MetricWriter
from gac_jax.transforms import ESSConfig


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


def _git_head() -> str | None:
    """HEAD of the checkout holding the package, or None (no git, or not a checkout)."""
    root = Path(gac_jax.__file__).resolve().parent.parent
    if shutil.which("git") is None:
        return None
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True
    )
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        return None
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return head.stdout.strip()


def test_a_summary_records_the_code_that_made_it(tmp_path):
    summary = run_spec(
        RunSpec("naive/k0", (), 0),
        get_preset("countdown_sweep"),
        tmp_path,
        train_fn=_fake_train([]),
    )
    code = summary["code"]
    assert (code["jax"], code["flax"], code["optax"]) == (
        jax.__version__,
        flax.__version__,
        optax.__version__,
    )
    head = _git_head()
    assert code["commit"] == head
    if head is None:
        assert code["dirty"] is None and code["tree"] is None
    else:
        assert isinstance(code["dirty"], bool)
        assert (code["diff"] is None) == (not code["dirty"])
        assert isinstance(code["tree"], str) and len(code["tree"]) == 16
    written = json.loads((tmp_path / "naive/k0/seed0/summary.json").read_text())
    assert written["code"] == code


def _make_stale(root, spec, code):
    path = spec.directory(root) / "summary.json"
    summary = json.loads(path.read_text())
    if code is None:
        del summary["code"]
    else:
        summary["code"] = code
    path.write_text(json.dumps(summary))


def test_a_stale_run_is_refused_unless_retrained_or_reused(tmp_path):
    base = get_preset("countdown_sweep")
    spec = RunSpec("naive/k8", ("rollout.lag=8",), seed=1)
    calls = []
    run_spec(spec, base, tmp_path, train_fn=_fake_train(calls))
    old = {**code_version(), "tree": "0123456789ab", "dirty": False, "diff": None}
    _make_stale(tmp_path, spec, old)
    with pytest.raises(StaleRunError, match=r"naive/k8 seed 1 \[code 0123456789ab, jax") as e:
        run_spec(spec, base, tmp_path, train_fn=_fake_train(calls))
    assert "--rerun-stale" in str(e.value) and "\n" not in str(e.value)
    assert calls == [(1, True)]  # Refused without training.
    reused = run_spec(spec, base, tmp_path, train_fn=_fake_train(calls), stale="reuse")
    assert reused["code"] == old and calls == [(1, True)]
    (spec.directory(tmp_path) / "stray").write_text("from the old run")
    again = run_spec(spec, base, tmp_path, train_fn=_fake_train(calls), stale="rerun")
    assert calls == [(1, True), (1, True)]  # Trained again...
    assert not again["resumed"] and not (spec.directory(tmp_path) / "stray").exists()  # ...anew.
    assert again["code"] == code_version() and again["steps"] == base.steps
    fresh = run_spec(spec, base, tmp_path, train_fn=_fake_train(calls))  # Read, not trained.
    assert json.dumps(fresh) == json.dumps(again) and len(calls) == 2
    with pytest.raises(ValueError, match=r"stale='keep' is unknown; expected one of \['refuse'"):
        run_spec(spec, base, tmp_path, stale="keep")


def test_a_sweep_names_every_stale_run_and_a_summary_without_a_version_is_stale(tmp_path):
    base = get_preset("countdown_sweep")
    specs = [RunSpec("naive/k0", (), 0), RunSpec("naive/k0", (), 1), RunSpec("gac/k0", (), 0)]
    for spec in specs:
        run_spec(spec, base, tmp_path, train_fn=_fake_train([]))
    other = {**code_version(), "optax": "0.0.1"}
    _make_stale(tmp_path, specs[0], other)
    _make_stale(tmp_path, specs[1], other)
    _make_stale(tmp_path, specs[2], None)  # Written before versions were recorded.
    with pytest.raises(StaleRunError) as e:
        run_sweep(specs, base, tmp_path, processes=SweepProcesses("unused.py"))
    message = str(e.value)
    assert message.startswith(f"3 finished run(s) under {tmp_path}")
    assert "naive/k0 seeds 0, 1 [" in message and "optax 0.0.1]" in message
    assert "gac/k0 seed 0 [no recorded version]" in message
    # Everything finished, so no child process starts; the stale summaries come back.
    reused = run_sweep(specs, base, tmp_path, processes=SweepProcesses("unused.py"), stale="reuse")
    assert [s["code"].get("optax") if "code" in s else None for s in reused] == [
        "0.0.1",
        "0.0.1",
        None,
    ]


def test_the_scripts_take_rerun_stale_or_allow_stale_not_both():
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser, default_root="runs/x", default_seeds=(0,))
    args = parser.parse_args([])
    assert not args.rerun_stale and not args.allow_stale
    assert stale_setting(args) == "refuse"
    assert parser.parse_args(["--rerun-stale"]).rerun_stale
    assert stale_setting(parser.parse_args(["--rerun-stale"])) == "rerun"
    assert parser.parse_args(["--allow-stale"]).allow_stale
    assert stale_setting(parser.parse_args(["--allow-stale"])) == "reuse"
    with pytest.raises(SystemExit):
        parser.parse_args(["--rerun-stale", "--allow-stale"])


def test_a_report_refuses_two_code_versions_unless_allowed():
    # What experiments/report.py checks before it makes a table of the summaries.
    new = {"commit": "b" * 40, "dirty": False, "diff": None, "jax": "1", "flax": "2", "optax": "3"}
    old = {**new, "commit": "a" * 40}
    summaries = [
        {"label": "a", "seed": 0, "code": new},
        {"label": "a", "seed": 1, "code": old},
        {"label": "b", "seed": 0, "code": new},
    ]
    with pytest.raises(ValueError, match="2 code versions") as e:
        check_one_version(runs_by_version(summaries), allow_mixed=False)
    assert f"[commit {'b' * 12}, jax 1, flax 2, optax 3]: a seed 0; b seed 0" in str(e.value)
    assert f"[commit {'a' * 12}, jax 1, flax 2, optax 3]: a seed 1" in str(e.value)
    check_one_version(runs_by_version(summaries), allow_mixed=True)
    check_one_version(runs_by_version([summaries[0], summaries[2]]), allow_mixed=False)
