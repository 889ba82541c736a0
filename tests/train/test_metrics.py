"""Tests of the metrics files and the progress line."""

import io
import json
import math
import struct
import subprocess
import sys

import numpy as np
import pytest

from gac_jax.train.metrics import (
    MetricWriter,
    ProgressLine,
    markdown_table,
    metric_series,
    read_metrics,
    to_json_scalar,
)


def _read_events(tb_dir):
    """Every `Event` proto of the TensorBoard event files of `tb_dir`, in order.

    Event files are TFRecords (u64 length, u32 crc, data, u32 crc) of `Event` protos.
    """
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    events = []
    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert files
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
    return events


def _read_scalars(tb_dir):
    """(tag, step, value) of every scalar in the TensorBoard event files of `tb_dir`."""
    return [
        (value.tag, event.step, value.simple_value)
        for event in _read_events(tb_dir)
        for value in event.summary.value
    ]


def test_jsonl_round_trip_with_nonfinite_values(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"reward": 0.5, "ess_ratio": np.float32(0.25), "n": np.int64(3)})
        writer.write(2, {"reward": float("nan"), "loss": float("inf"), "g": -math.inf})
        writer.write(3, {"reward": np.array(1.5), "ok": True, "note": "x", "none": None})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    for line in lines:  # Strict JSON: no bare NaN or Infinity.
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0] == {"step": 1, "reward": 0.5, "ess_ratio": 0.25, "n": 3}
    assert type(records[0]["n"]) is int
    assert math.isnan(records[1]["reward"])
    assert records[1]["loss"] == math.inf and records[1]["g"] == -math.inf
    assert records[2] == {"step": 3, "reward": 1.5, "ok": True, "note": "x", "none": None}
    # A run directory may be given instead of the file.
    assert len(read_metrics(tmp_path)) == 3

    steps, values = metric_series(records, "reward")
    assert steps == [1, 2, 3] and values[0] == 0.5 and math.isnan(values[1])


def test_each_write_is_flushed_and_a_cut_last_line_is_skipped(tmp_path):
    writer = MetricWriter(tmp_path, tensorboard=False)
    writer.write(0, {"reward": 1.0})
    # Readable before close, as after a crash.
    assert read_metrics(tmp_path) == [{"step": 0, "reward": 1.0}]
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "rew')
    assert read_metrics(tmp_path) == [{"step": 0, "reward": 1.0}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n{}\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_bad_values_are_refused_before_anything_is_written(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(TypeError, match="'vec'"):
            writer.write(0, {"reward": 1.0, "vec": np.zeros(3)})
        with pytest.raises(ValueError, match="differs"):
            writer.write(0, {"step": 4})
    assert read_metrics(tmp_path) == []
    with pytest.raises(RuntimeError):
        writer.write(1, {})


def test_resume_drops_steps_from_start_step_and_new_run_starts_afresh(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        for step in range(1, 6):
            writer.write(step, {"reward": float(step)})
    with MetricWriter(tmp_path, start_step=4, tensorboard=False) as writer:
        writer.write(4, {"reward": 40.0})
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    with MetricWriter(tmp_path, start_step=0, tensorboard=False):
        pass
    assert read_metrics(tmp_path) == []
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"reward": -1.0})
    assert read_metrics(tmp_path) == [{"step": 1, "reward": -1.0}]


def test_tensorboard_scalars(tmp_path):
    with MetricWriter(tmp_path) as writer:
        writer.write(1, {"reward": 0.5, "gac_cosine": 0.75, "note": "skip me"})
        writer.write(2, {"reward": 0.25, "ok": True})
    scalars = _read_scalars(tmp_path / "tensorboard")
    assert ("reward", 1, 0.5) in scalars and ("reward", 2, 0.25) in scalars
    assert ("gac_cosine", 1, 0.75) in scalars and ("ok", 2, 1.0) in scalars
    assert not any(tag in ("note", "step") for tag, _, _ in scalars)

    # Resuming at step 2 marks later events for TensorBoard to purge, and writes step 2 anew.
    with MetricWriter(tmp_path, start_step=2) as writer:
        writer.write(2, {"reward": 0.125})
    assert ("reward", 2, 0.125) in _read_scalars(tmp_path / "tensorboard")
    assert [r["reward"] for r in read_metrics(tmp_path)] == [0.5, 0.125]


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """In a fresh interpreter (torch is installed with the test extra): the writer's
    events are there, torch was not imported for them, and it can be imported after."""
    pytest.importorskip("torch")
    script = (
        "import sys\n"
        "from gac_jax.train.metrics import MetricWriter\n"
        f"with MetricWriter({str(tmp_path)!r}) as w:\n"
        "    w.write(1, {'reward': 0.5})\n"
        "print('torch' in sys.modules)\n"
        "import torch\n"
        "print(torch.ones(2).sum().item())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "2.0"]
    assert ("reward", 1, 0.5) in _read_scalars(tmp_path / "tensorboard")


def test_to_json_scalar():
    assert to_json_scalar(np.bool_(True)) is True
    assert to_json_scalar(np.float64("nan")) == "nan"
    assert to_json_scalar(np.float32(2.0)) == 2.0
    with pytest.raises(TypeError, match="'x'"):
        to_json_scalar(object(), "x")


def test_progress_line_to_a_log(tmp_path):
    stream = io.StringIO()  # Not a terminal: full lines, rate-limited, last step always shown.
    progress = ProgressLine(10, stream=stream, min_interval=3600)
    metrics = {"reward": 0.4123, "ess_ratio": 0.93, "gac_cosine": -0.5, "tokens_per_s": 12345.0}
    progress.update(1, metrics)
    progress.update(2, metrics)
    progress.update(10, {"reward": 1.0})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "step 1/10 reward 0.4123 ess 0.93 cos -0.5 tok/s 1.23e+04",
        "step 10/10 reward 1",
    ]
    assert "\r" not in stream.getvalue()


def test_progress_line_quiet_and_tty():
    quiet_stream = io.StringIO()
    progress = ProgressLine(5, quiet=True, stream=quiet_stream)
    progress.update(3, {"ess_ratio": float("nan"), "other": 1})
    assert progress.last_line == "step 3/5 ess nan"
    assert quiet_stream.getvalue() == ""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    with ProgressLine(5, stream=tty) as progress:
        progress.update(2, {"reward": 0.5})
        progress.update(5, {"reward": 0.75})
    assert "5/5" in tty.getvalue() and "reward 0.75" in tty.getvalue()


def test_a_note_is_said_at_once_and_the_next_update_replaces_it():
    log = io.StringIO()
    progress = ProgressLine(5, stream=log, min_interval=3600)
    progress.note("step 0: compiling the learner step")
    assert log.getvalue() == "step 0: compiling the learner step\n"  # Not rate-limited.
    progress.update(1, {"reward": 0.5})
    assert log.getvalue().splitlines()[-1] == "step 1/5 reward 0.5"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with ProgressLine(5, stream=Terminal()) as progress:
        progress.note("step 0: compiling the sampler")
        assert progress._bar.desc == "step 0: compiling the sampler"
        progress.update(1, {})
        assert progress._bar.desc == ""
    silent = io.StringIO()
    ProgressLine(5, quiet=True, stream=silent).note("x")
    assert silent.getvalue() == ""


def test_several_updates_per_step_chart_optimizer_steps_and_purge_in_them(tmp_path):
    with MetricWriter(tmp_path, updates_per_step=2) as writer:
        for step in range(3):
            for j in range(2):
                writer.write(step, {"loss": float(step), "optimizer_step": 2 * step + j})
    steps = [s for tag, s, _ in _read_scalars(tmp_path / "tensorboard") if tag == "loss"]
    assert steps == [0, 1, 2, 3, 4, 5]
    # Resuming at step 2 purges TensorBoard from optimizer step 4, not 2.
    with MetricWriter(tmp_path, start_step=2, updates_per_step=2):
        pass
    events = _read_events(tmp_path / "tensorboard")
    restarts = [event.step for event in events if event.HasField("session_log")]
    assert 4 in restarts and 2 not in restarts


def test_a_markdown_table_escapes_free_text_unless_its_cells_are_markdown():
    table = markdown_table(["a|b", "n"], [["x_y\nz", 3], ["**", 0.5]])
    assert table.splitlines() == [
        "| a\\|b | n |",
        "|---|---|",
        "| x\\_y<br>z | 3 |",
        "| \\*\\* | 0.5 |",
    ]
    raw = markdown_table(("label", "k"), [("gac_vcpo", 32), ("**0.1**", "-")], escape=False)
    assert raw == "| label | k |\n|---|---|\n| gac_vcpo | 32 |\n| **0.1** | - |"
