"""Per-step metrics on disk (JSON lines and TensorBoard) and a one-line progress display.

`MetricWriter(out_dir)` appends one JSON object per `write(step, metrics)` to
``out_dir/metrics.jsonl``, flushed at once so a crash loses nothing already written, and
writes the numeric values as TensorBoard scalars under ``out_dir/tensorboard/`` and, given a
Weights & Biases run (`start_wandb`, `run_writer`), to W&B too; `write_table` adds a table
(a TensorBoard markdown text and a ``wandb.Table``).
Non-finite floats are stored as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (the file is
always strict JSON); `read_metrics` turns them back into floats.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from gac_jax._closing import Closing
from gac_jax.transforms.alignment import MAX_CONSECUTIVE_SKIPS

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def to_json_scalar(value: Any, key: str = "value") -> bool | int | float | str | None:
    """A Python/NumPy/JAX scalar as a strict-JSON value; non-finite floats become strings."""
    if value is None or isinstance(value, bool | str):
        return value
    if hasattr(value, "ndim") and hasattr(value, "item"):  # NumPy and JAX arrays.
        if value.ndim != 0:
            raise TypeError(f"Metric '{key}' must be a scalar, got shape {value.shape}.")
        value = value.item()
    if isinstance(value, bool | int):
        return value
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"Metric '{key}' must be a scalar, got {value!r}.") from None
    return value if math.isfinite(value) else str(value)  # "nan", "inf" or "-inf".


def _from_json_value(value: Any) -> Any:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (or of the run directory holding one), in order.

    Each record is ``{"step": int, **metrics}``, with non-finite floats restored. A last line
    cut short by a crash is skipped; a bad line elsewhere is an error.
    """
    path = Path(path)
    path = path / METRICS_FILE if path.is_dir() else path
    lines = path.read_text().splitlines(keepends=True)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # The write of this line was interrupted.
            raise ValueError(f"{path}:{i + 1} is not valid JSON: {line[:80]!r}") from None
        records.append({k: _from_json_value(v) for k, v in record.items()})
    return records


def _cleaned(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: to_json_scalar(v, k) for k, v in record.items()}


def _json_line(record: Mapping[str, Any]) -> str:
    return json.dumps(_cleaned(record), allow_nan=False) + "\n"


def keep_before(path: Path, start_step: int) -> None:
    """Drops the records of steps >= `start_step` from a JSON-lines file (atomically): a
    resumed run writes them again."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(_json_line(r) for r in read_metrics(path) if r["step"] < start_step))
    os.replace(tmp, path)


def markdown_table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], *, escape: bool = True
) -> str:
    """A Markdown table (no final newline): the headers `columns`, then one line per row;
    a cell that is not a string is written as the progress line writes a metric. `escape`
    escapes Markdown's special characters and writes newlines as ``<br>``, so free text (a
    completion's ``|`` or newlines) neither breaks nor restyles the table; False for cells
    that are Markdown already."""

    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else _format_value(to_json_scalar(value))
        if escape:
            for char in "\\`*_[]<>#|":
                text = text.replace(char, "\\" + char)
            text = text.replace("\r", "").replace("\n", "<br>") or " "
        return text

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def start_wandb(project: str, *, mode: str, out_dir: str | os.PathLike, config: Mapping):
    """A Weights & Biases run logging under `out_dir` (its ``wandb/`` folder), with `config`
    as the run's config; a one-line ImportError when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        raise ImportError(
            f"wandb_project={project!r} needs the wandb package: pip install 'gac_jax[wandb]'."
        ) from None
    out_dir, quiet = Path(out_dir), wandb.Settings(quiet=True)
    where = dict(dir=str(out_dir), name=out_dir.resolve().name)
    return wandb.init(project=project, mode=mode, **where, config=dict(config), settings=quiet)


def run_writer(config, out_dir: str | os.PathLike, *, start_step: int | None) -> MetricWriter:
    """The writer of a training run of `config` (a `TrainConfig`): metrics.jsonl,
    TensorBoard and, when `config.wandb_project` is set, W&B."""
    wandb_run = None
    if config.wandb_project is not None:
        from gac_jax.train.config_io import config_to_dict

        settings, mode = config_to_dict(config), config.wandb_mode
        wandb_run = start_wandb(config.wandb_project, mode=mode, out_dir=out_dir, config=settings)
    updates = config.learner.updates_per_batch
    return MetricWriter(
        out_dir, start_step=start_step, wandb_run=wandb_run, updates_per_step=updates
    )


def metric_series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a numeric `key` (non-finite values kept)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported without torch where torch is not imported
    yet: tensorboardX imports torch, when installed, only to accept torch tensors (the
    writer gets floats), and that import cost every run's start-up 1.1 s here. torch is
    hidden for this import only; a later ``import torch`` works as usual."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile.
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricWriter(Closing):
    """Writes each step's flat dict of scalars to ``metrics.jsonl`` and TensorBoard.

    Args:
      out_dir: the run directory; created if missing.
      start_step: None starts a new ``metrics.jsonl``; an int continues a resumed run,
        dropping the records of steps >= `start_step` (from TensorBoard too, by
        ``purge_step``), which will be written again.
      tensorboard: also write TensorBoard events (needs ``tensorboardX``).
      wandb_run: a W&B run (`start_wandb`) that gets the metrics and tables; `close` ends it.
      updates_per_step: optimizer steps per step; the charts count optimizer steps (a
        record's ``optimizer_step``).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        start_step: int | None = None,
        tensorboard: bool = True,
        wandb_run: Any = None,
        updates_per_step: int = 1,
    ):
        self.updates_per_step = updates_per_step
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        if start_step is not None and self.path.exists():
            keep_before(self.path, start_step)
        self._wandb = wandb_run
        self._file = self.path.open("a" if start_step is not None else "w")
        self._tb = None
        if tensorboard:
            purge = (start_step or 0) * updates_per_step or None
            writer = _summary_writer_class()
            self._tb = writer(logdir=str(self.out_dir / TENSORBOARD_DIR), purge_step=purge)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records `metrics` (name -> scalar) at `step`; flushed before returning."""
        if self._file is None:
            raise RuntimeError("MetricWriter is closed.")
        step = int(step)
        if "step" in metrics and int(metrics["step"]) != step:
            raise ValueError(f"metrics['step']={metrics['step']} differs from step={step}.")
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        clean = _cleaned(record)  # Converts (and checks) every value before writing any.
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        values = {k: _from_json_value(v) for k, v in clean.items() if k != "step"}
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        x = int(numbers.get("optimizer_step", step * self.updates_per_step))
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, global_step=x)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=x)

    def write_table(
        self, step: int, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """Records a table at `step`: TensorBoard text `tag` (markdown) and W&B table `tag`."""
        if self._file is None:
            raise RuntimeError("MetricWriter is closed.")
        x = (int(step) + 1) * self.updates_per_step - 1  # The step's last optimizer step.
        if self._tb is not None:
            self._tb.add_text(tag, markdown_table(columns, rows), global_step=x)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(columns), data=[list(row) for row in rows])
            self._wandb.log({tag: table}, step=x)

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


class NullMetricWriter(Closing):
    """`MetricWriter`'s interface, writing nothing: what the other processes of a
    multi-process run use (process 0 writes the run's metrics)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        del step, metrics

    def write_table(self, step, tag, columns, rows) -> None:
        del step, tag, columns, rows

    def close(self) -> None:
        pass


# Display label -> metric names tried in order; the first present is shown.
DEFAULT_PROGRESS_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "reward_mean")),
    ("ess", ("ess_ratio",)),
    ("cos", ("gac_cosine", "cosine")),
    ("tok/s", ("tokens_per_s", "generate_tokens_per_s", "train_tokens_per_s")),
    # Only in runs with their own reward (`reward=`): its failed and timed-out calls.
    ("reward-fail", ("reward/failures",)),
    ("reward-timeout", ("reward/timeouts",)),
)


def _format_value(value: Any) -> str:
    if not isinstance(value, float):  # An int, a bool, a string or None as it is.
        return str(value)
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.4g}" if abs(value) < 100 else f"{value:.0f}"


class ProgressLine(Closing):
    """A one-line progress display: step/total and a few metrics.

    On a terminal this is a tqdm bar whose postfix holds the metrics. Elsewhere (a log file,
    CI) redrawing with ``\\r`` would pile every update onto one line, so a full line is
    printed at most every `min_interval` seconds, and always for the last step.

    `quiet` shows nothing (`last_line` is still kept); `stream` defaults to stderr;
    `fields` are (label, metric names) pairs (`DEFAULT_PROGRESS_FIELDS`).
    """

    def __init__(
        self,
        total: int,
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        fields: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PROGRESS_FIELDS,
        min_interval: float = 10.0,
    ):
        self.total = int(total)
        self.quiet = quiet
        self.stream = sys.stderr if stream is None else stream
        self.fields = tuple((label, tuple(names)) for label, names in fields)
        self.min_interval = min_interval
        self.last_line = ""
        self._last_print = -math.inf
        self._bar = None
        isatty = getattr(self.stream, "isatty", None)
        if not quiet and isatty is not None and isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, file=self.stream, dynamic_ncols=True, leave=True)

    def format(self, step: int, metrics: Mapping[str, Any]) -> str:
        """The metrics part of the line, e.g. ``reward 0.41 ess 0.93 cos 0.71 tok/s 1200``."""
        parts = []
        for label, names in self.fields:
            for name in names:
                if name in metrics and metrics[name] is not None:
                    parts.append(f"{label} {_format_value(to_json_scalar(metrics[name]))}")
                    break
        return " ".join(parts)

    def note(self, text: str) -> None:
        """Says at once what the run does before a step ends (a compile): on a terminal the
        bar's description until the next `update`, elsewhere a line."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Shows `step` (the number of steps done, up to `total`) and its metrics."""
        step = int(step)
        postfix = self.format(step, metrics)
        self.last_line = f"step {step}/{self.total} {postfix}".rstrip()
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.set_description_str("", refresh=False)
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(max(0, min(step, self.total) - self._bar.n))
            return
        now = time.monotonic()
        if step >= self.total or now - self._last_print >= self.min_interval:
            self.stream.write(self.last_line + "\n")
            self.stream.flush()
            self._last_print = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def skip_streak_warning(gac, say: Callable[[str], None]) -> Callable[[int, Mapping], None]:
    """`warn(step, metrics)`, which `say`s once when GAC's skips first streak to
    `gac.max_consecutive_skips` (the default where None): a skip repeats itself, and a run
    that skips on does not train."""
    said = [gac.monitor_only]  # A monitor never skips.

    def warn(step: int, metrics: Mapping[str, Any]) -> None:
        longest = int(metrics.get("gac_skip_streak_longest", 0))
        if not said[0] and longest >= (gac.max_consecutive_skips or MAX_CONSECUTIVE_SKIPS):
            said[0] = True
            say(
                f"warning: GAC skipped {longest} steps in a row by step {step} (gac."
                f"max_consecutive_skips={gac.max_consecutive_skips}); thresholds below the "
                "run's own cosines (gac_cosine, gac_update_cosine) skip most steps."
            )

    return warn
