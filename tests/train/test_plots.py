"""Tests of the PNG plots of run metrics."""

import numpy as np
import pytest

from gac_jax.train.metrics import MetricWriter
from gac_jax.train.plots import (
    ema_smooth,
    plot_run,
    plot_runs,
    run_figure,
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
    png = plot_runs(runs, tmp_path / "cmp.png", "reward")
    width, height = _png_size(png)
    assert width >= 300 and height >= 200
    with pytest.raises(ValueError, match="'gac_cosine'"):
        plot_runs(runs, tmp_path / "none.png", "gac_cosine")


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
    np.testing.assert_allclose(_line_data(raw)[1], rewards)
    np.testing.assert_allclose(_line_data(smoothed)[1], _ema_reference(rewards, 0.8), rtol=1e-12)
    assert raw.get_alpha() < 1 and smoothed.get_alpha() is None
    steps = sorted(evals)
    for line, column in ((sampled, 0), (greedy, 1)):
        assert line.get_linestyle() == "None" and line.get_marker() in ("o", "s")
        x, y = _line_data(line)
        np.testing.assert_array_equal(x, steps)
        np.testing.assert_allclose(y, [evals[s][column] for s in steps])
    labels = [t.get_text() for t in reward_ax.get_legend().get_texts()]
    assert labels == ["held-out sampled_reward", "held-out greedy_accuracy"]
    assert len(ess_ax.get_lines()) == 2 and ess_ax.get_legend() is None  # No evaluation.
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
