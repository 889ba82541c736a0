"""Tests of the PNG plots of run metrics."""

import numpy as np
import pytest

from gac_jax.train.config import get_preset
from gac_jax.train.config_io import apply_overrides, save_config
from gac_jax.train.metrics import MetricWriter
from gac_jax.train.plots import (
    describe_config,
    ema_smooth,
    plot_run,
    plot_runs,
    run_figure,
    run_labels,
    runs_figure,
    smoothing_weight,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    """(width, height) from the IHDR chunk that follows the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _run(directory, scale, keys=("reward", "ess_ratio")):
    with MetricWriter(directory, tensorboard=False) as writer:
        for step in range(20):
            value = float("nan") if step == 7 else scale * step / 20
            writer.write(step, {key: value for key in keys})
    return directory / "metrics.jsonl"


def test_plot_run_one_panel_per_present_key(tmp_path):
    metrics = _run(tmp_path / "run", 1.0)
    # gac_cosine is absent: two panels, not three.
    two = plot_run(metrics, tmp_path / "out" / "two.png")
    one = plot_run(metrics, tmp_path / "one.png", keys=("reward",), title="run")
    assert two == tmp_path / "out" / "two.png"
    (w2, h2), (w1, h1) = _png_size(two), _png_size(one)
    assert w2 == w1 >= 300
    assert h2 > h1 >= 200
    assert two.stat().st_size > 5000


def test_plot_run_without_any_key_is_an_error(tmp_path):
    metrics = _run(tmp_path, 1.0, keys=("loss",))
    with pytest.raises(ValueError, match=r"reward.*\['loss'\]"):
        plot_run(metrics, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_runs_overlays(tmp_path):
    runs = {
        "sync": _run(tmp_path / "a", 1.0),
        "async": tmp_path / "b",  # A run directory works too.
        "no reward": _run(tmp_path / "c", 1.0, keys=("loss",)),
    }
    _run(tmp_path / "b", 2.0)
    png = plot_runs(runs, tmp_path / "cmp.png", ["reward"])
    width, height = _png_size(png)
    assert width >= 300 and height >= 200
    with pytest.raises(ValueError, match="'gac_cosine'"):
        plot_runs(runs, tmp_path / "none.png", ["gac_cosine"])
    assert not (tmp_path / "none.png").exists()


def _evaluated_run(directory, rewards, passes):
    """A run whose step-0 record holds the evaluation before training and whose steps 4 and
    9 hold the evaluations after 5 and 10 updates (as `gac_jax.train.loop` logs them)."""
    with MetricWriter(directory, tensorboard=False) as writer:
        for step, reward in enumerate(rewards):
            record = {"reward": float(reward)}
            if step == 0:
                record["eval_start/pass@1"] = passes[0]
            if step in (4, 9):
                record["eval/pass@1"] = passes[1 if step == 4 else 2]
            writer.write(step, record)
    return directory


def test_two_runs_two_keys_one_panel_each_one_line_per_run(tmp_path):
    rng = np.random.default_rng(3)
    rewards = {"naive": rng.random(10), "vcpo": rng.random(10)}
    passes = {"naive": (0.2, 0.05, 0.0), "vcpo": (0.2, 0.22, 0.25)}
    runs = {k: _evaluated_run(tmp_path / k / "seed0", rewards[k], passes[k]) for k in rewards}
    fig = runs_figure(runs, ["eval/pass@1", "reward", "no_such_key"], smoothing=0.7)
    pass_ax, reward_ax = fig.axes  # The key no run has draws no panel.
    assert [pass_ax.get_ylabel(), reward_ax.get_ylabel()] == ["held-out pass@1", "batch reward"]
    assert reward_ax.get_xlabel() == "step"
    for ax in (pass_ax, reward_ax):  # A legend entry for every run, in the run's colour.
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["naive", "vcpo"]
    colours = [h.get_color() for h in pass_ax.get_legend().legend_handles]
    assert colours == [h.get_color() for h in reward_ax.get_legend().legend_handles]
    assert colours[0] != colours[1]
    for label, line in zip(("naive", "vcpo"), pass_ax.get_lines(), strict=True):
        x, y = _line_data(line)  # Markers after 0, 5 and 10 updates.
        assert line.get_marker() == "o"
        np.testing.assert_array_equal(x, [0, 5, 10])
        np.testing.assert_allclose(y, passes[label])
    drawn = [ln for ln in reward_ax.get_lines() if not ln.get_label().startswith("_")]
    for label, line in zip(("naive", "vcpo"), drawn, strict=True):
        np.testing.assert_allclose(_line_data(line)[1], _ema_reference(rewards[label], 0.7))
    faint = [ln for ln in reward_ax.get_lines() if ln.get_label().startswith("_")]
    assert len(faint) == 2 and all(ln.get_alpha() < 0.5 for ln in faint)
    assert "~3 steps" in reward_ax.get_title(loc="right")  # 0.7: a window of ~3 steps.
    # Named by their paths below the directory they share.
    assert list(run_labels([runs["naive"], runs["vcpo"] / "metrics.jsonl"])) == [
        "naive/seed0",
        "vcpo/seed0",
    ]
    assert _png_size(plot_runs(runs, tmp_path / "cmp.png"))[1] > 300


@pytest.mark.parametrize(("window", "weight"), [(1, 0.0), (10, 0.9), (4, 0.75)])
def test_a_smoothing_window_in_steps_is_an_ema_weight(window, weight):
    assert smoothing_weight(window) == pytest.approx(weight)
    with pytest.raises(ValueError, match=r"smooth=0\.5 must be a window of at least 1 step"):
        smoothing_weight(0.5)


def test_the_run_plot_is_titled_with_its_config(tmp_path):
    config = apply_overrides(
        get_preset("calculator"),
        ["rollout.mode=lagged", "rollout.lag=16", "optimizer.learning_rate=5e-4"]
        + ["loss.policy_loss=reinforce", "loss.correction=tis"]
        + ["loss.correction_kwargs.level=sequence", "ess={}", "loss.advantage=vcpo"],
    )
    line = "reinforce, tis (sequence), vcpo advantage, ESS step scale | lagged k=16 | lr 0.0005"
    assert describe_config(config) == line
    demo = get_preset("demo")  # Async GRPO with GAC acting at its fixed thresholds.
    assert describe_config(demo) == (
        f"ppo, GAC {demo.gac.tau_low:g}/{demo.gac.tau_high:g} on the gradient | "
        f"async, staleness <= {demo.buffer.max_staleness} | lr 0.0002"
    )
    _run(tmp_path, 1.0, keys=("reward", "gac_cosine"))
    save_config(demo, tmp_path / "config.json")
    fig = run_figure(tmp_path / "metrics.jsonl", title="my_run")
    assert fig._suptitle.get_text() == f"my_run\n{describe_config(demo)}"
    levels = {ln.get_label(): _line_data(ln)[1][0] for ln in fig.axes[1].get_lines()}
    assert levels["tau_low"] == demo.gac.tau_low and levels["tau_high"] == demo.gac.tau_high
    (tmp_path / "config.json").write_text('{"no_such_field": 1}')  # Unreadable: no title.
    assert run_figure(tmp_path / "metrics.jsonl")._suptitle is None


def _ema_reference(values, weight):
    """Debiased EMA of the finite values as one weighted sum each (float64), NaN/inf kept."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    x = values[finite]
    out = values.copy()
    smoothed = []
    for n in range(1, len(x) + 1):
        powers = weight ** np.arange(n - 1, -1, -1, dtype=np.float64)
        smoothed.append((1 - weight) * np.dot(powers, x[:n]) / (1 - weight**n))
    out[finite] = smoothed
    return out


@pytest.mark.parametrize("weight", [0.0, 0.6, 0.9, 0.99])
def test_ema_smooth_matches_a_numpy_reference(weight):
    rng = np.random.default_rng(1)
    values = rng.normal(size=60)
    values[[0, 7, 8, 30]] = [np.nan, np.nan, np.inf, np.nan]
    got = np.asarray(ema_smooth(values.tolist(), weight))
    np.testing.assert_allclose(got, _ema_reference(values, weight), rtol=1e-12, equal_nan=True)
    assert np.isnan(got[[0, 7, 30]]).all() and got[8] == np.inf
    assert got[1] == pytest.approx(values[1], rel=1e-12)  # Debiased: no pull towards 0.
    with pytest.raises(ValueError, match=r"smoothing=1\.0 must be in \[0, 1\)"):
        ema_smooth([1.0], 1.0)


def _run_with_evals(directory):
    rng = np.random.default_rng(2)
    rewards = rng.random(20)
    evals = {4: (0.3, 0.25), 9: (0.4, 0.5), 19: (0.6, 0.75)}
    with MetricWriter(directory, tensorboard=False) as writer:
        for step in range(20):
            metrics = {"reward": float(rewards[step]), "ess_ratio": 1.0}
            if step in evals:
                metrics["eval/sampled_reward"], metrics["eval/greedy_accuracy"] = evals[step]
            writer.write(step, metrics)
    return directory / "metrics.jsonl", rewards, evals


def _line_data(line):
    return np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)


def test_plot_run_smooths_and_marks_the_held_out_evaluations(tmp_path):
    metrics, rewards, evals = _run_with_evals(tmp_path / "run")
    fig = run_figure(metrics, smoothing=0.8)
    reward_ax, ess_ax = fig.axes
    raw, smoothed, sampled, greedy = reward_ax.get_lines()
    assert reward_ax.get_ylabel() == "batch reward" and raw.get_label() == "per step"
    np.testing.assert_allclose(_line_data(raw)[1], rewards)
    np.testing.assert_allclose(_line_data(smoothed)[1], _ema_reference(rewards, 0.8), rtol=1e-12)
    assert raw.get_alpha() < 1 and smoothed.get_alpha() is None
    steps = sorted(evals)
    for line, column in ((sampled, 0), (greedy, 1)):
        assert line.get_linestyle() == "None" and line.get_marker() in ("o", "s")
        x, y = _line_data(line)  # Drawn after the update that preceded them.
        np.testing.assert_array_equal(x, [s + 1 for s in steps])
        np.testing.assert_allclose(y, [evals[s][column] for s in steps])
    labels = [t.get_text() for t in reward_ax.get_legend().get_texts()]
    assert labels == [
        "per step",
        "smoothed over ~5 steps",
        "held-out sampled reward",
        "held-out greedy accuracy",
    ]
    assert len(ess_ax.get_lines()) == 2 and len(ess_ax.get_legend().get_texts()) == 2
    # An evaluation metric asked for by name is its own panel, drawn point by point.
    (eval_line,) = run_figure(metrics, keys=("eval/greedy_accuracy",)).axes[0].get_lines()
    np.testing.assert_allclose(_line_data(eval_line)[1], [evals[s][1] for s in steps])
    png = plot_run(metrics, tmp_path / "plot.png")
    assert _png_size(png)[0] >= 300


def test_plot_run_draws_reference_lines_pass_at_k_and_the_title(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        for step in range(10):
            record = {"reward": step / 10, "gac_cosine": 0.1 * (step % 3)}
            if step in (4, 9):
                record.update({"eval/sampled_reward": 0.3, "eval/pass@8": 0.5 + step / 100})
            writer.write(step, record)
    lines = {"gac_cosine": [(0.2, "tau_low"), (0.8, "tau_high")]}
    fig = run_figure(tmp_path / "metrics.jsonl", title="my_run", lines=lines)
    reward_ax, cosine_ax = fig.axes
    assert fig._suptitle.get_text() == "my_run"
    pass_at_k = [ln for ln in reward_ax.get_lines() if ln.get_label() == "held-out pass@8"]
    np.testing.assert_array_equal(_line_data(pass_at_k[0])[0], [5, 10])
    np.testing.assert_allclose(_line_data(pass_at_k[0])[1], [0.54, 0.59])
    levels = {ln.get_label(): _line_data(ln)[1][0] for ln in cosine_ax.get_lines()}
    assert levels["tau_low"] == 0.2 and levels["tau_high"] == 0.8
    assert reward_ax.get_legend() is not None and cosine_ax.get_legend() is not None


def test_the_run_plot_reads_plainly(tmp_path):
    # An ESS ratio that barely moves would get a "1e-7+1" offset; four steps, half-step ticks.
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        for step in range(4):
            writer.write(step, {"ess_ratio": 1.0 - 1e-7 * step, "gac_cosine": 0.1 * step})
    lines = {"gac_cosine": [(0.2, "tau_low"), (0.8, "tau_high")]}
    fig = run_figure(tmp_path / "metrics.jsonl", lines=lines)
    fig.canvas.draw()
    ess_ax, cosine_ax = fig.axes
    assert ess_ax.yaxis.get_offset_text().get_text() == ""
    assert all(float(t).is_integer() for t in ess_ax.get_xticks())
    styles = {ln.get_label(): ln.get_linestyle() for ln in cosine_ax.get_lines()}
    assert styles["tau_low"] != styles["tau_high"]
