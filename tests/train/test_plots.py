"""Tests of the PNG plots of run metrics."""

import pytest

from gac_jax.train.metrics import MetricWriter
from gac_jax.train.plots import (
    plot_distributions,
    plot_grouped_bars,
    plot_run,
    plot_runs,
    plot_seed_curves,
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


def test_sweep_plots_write_pngs_and_reject_empty_input(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    box = plot_distributions(
        {"k0": rng.normal(size=50), "k8": rng.normal(0.3, size=50)},
        tmp_path / "box.png",
        ylabel="c_t",
    )
    curves = plot_seed_curves(
        {"sync": [rng.random(40), rng.random(38)], "k=8": [rng.random(40)]},
        tmp_path / "curves.png",
        ylabel="reward",
        smooth=5,
    )
    bars = plot_grouped_bars(
        {"k=8": {"naive": (0.2, 0.01), "gac": (0.25, 0.02)}, "k=16": {"naive": (0.1, 0.03)}},
        tmp_path / "bars.png",
        ylabel="pass@1",
        reference=("sync", 0.22),
    )
    for path in (box, curves, bars):
        assert _png_size(path)[0] > 100
    with pytest.raises(ValueError, match=r"\['empty'\] have no values"):
        plot_distributions({"empty": []}, tmp_path / "x.png", ylabel="y")
    with pytest.raises(ValueError, match="at least one series"):
        plot_seed_curves({"a": []}, tmp_path / "x.png", ylabel="y")
    with pytest.raises(ValueError, match="at least one group"):
        plot_grouped_bars({}, tmp_path / "x.png", ylabel="y")
