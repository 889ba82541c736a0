"""The GRPO training loop: a short driver over a `Run` and its hooks.

`train(config, out_dir)` builds the run (`build_run`), then per step: `run.step` (publish
the params as version `step`, take the step's batch from the rollout source, update) and
the hooks due at that step, in order: evaluation, the metrics record, samples, progress,
checkpoint, the stop check, and at the end the plot. A new periodic job is one more
`Hooks.add(fn, every=n)` (levanter's trainer hooks, nanodo's periodic actions), not an
edit of the loop. `resume=True` continues from the newest checkpoint in
`out_dir/checkpoints`; lagged mode then reproduces an uninterrupted run exactly (the
ParamStore's history is part of the checkpoint). SIGINT (Ctrl-C) and SIGTERM (a
preempted VM) stop a run cleanly: see `train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from gac_jax.train import config_io, processes
from gac_jax.train.checkpoint import CheckpointManager
from gac_jax.train.config import TrainConfig
from gac_jax.train.metrics import skip_streak_warning
from gac_jax.train.run import Run, build_run, evaluation_key

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A SIGINT this soon after the first stop signal is the same request: `timeout -s INT`
# signals the process and then its process group, and both may arrive.
SAME_REQUEST_S = 1.0


def _again(first: float | None, signum: int) -> bool:
    """Whether `signum`, now, asks to stop at once: a SIGINT after an earlier request."""
    late = first is not None and time.monotonic() - first > SAME_REQUEST_S
    return signum == signal.SIGINT and late


class RunInterrupted(RuntimeError):
    """The run stopped on a signal after checkpointing step `next_step`."""

    def __init__(self, out_dir: Path, next_step: int, signum: int):
        self.out_dir, self.next_step, self.signum = Path(out_dir), next_step, signum
        name = signal.Signals(signum).name
        super().__init__(
            f"{name}: stopped after step {next_step} and saved a checkpoint; resume with "
            f"`{command()} train --out {shlex.quote(str(out_dir))} --resume`."
        )

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


def command() -> str:
    """The ``gac-jax`` command as a shell runs it again: the path of the running script
    (a virtual environment's, say), else ``python -m``'s, else ``gac-jax``."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(script) == "gac-jax":
        return shlex.quote(script)
    if script.endswith(os.path.join("gac_jax", "train", "cli.py")):  # python -m
        return f"{shlex.quote(sys.executable)} -m gac_jax.train.cli"
    return "gac-jax"


class InterruptedAtOnce(KeyboardInterrupt):
    """A second SIGINT while a step finished before its checkpoint: stop now, unsaved."""


class StopSignals:
    """While active, the first SIGINT or SIGTERM is recorded in `signum` instead of
    stopping the process, and a later SIGINT (`_again`) raises `InterruptedAtOnce`; the
    previous handlers come back on exit. Outside the main thread (where Python cannot
    install handlers) it records nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._first: float | None = None  # When the first signal came.
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if _again(self._first, signum):
            raise InterruptedAtOnce  # Asked twice: stop now.
        if self.signum is None:
            self.signum, self._first = signum, time.monotonic()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class SignalNotice:
    """Says on stderr the moment SIGINT or SIGTERM arrives what the run will do (`message`,
    which may change while active), also while the main thread is inside a long native call
    (an XLA compile, a data preparation), where Python runs its own handlers only once that
    call returns. A thread reads the signal numbers Python's C-level handler writes to the
    wakeup fd (`signal.set_wakeup_fd`); the previous fd comes back on exit. Only signals
    with a Python handler are written (SIGTERM's default ends the process at once). A
    second SIGINT is said to stop at once (`StopSignals` raises on it), unless it came
    within `SAME_REQUEST_S` of the first. The exit never waits on the pipe's end (a process
    forked meanwhile holds a copy of it): it writes a stop byte and joins with a timeout; a
    forked child drops the wakeup fd. Outside the main thread it does nothing."""

    STOP = 0  # Not a signal number: the watcher's cue to return.

    def __init__(self, message: str):
        self.message = message
        self._fds: tuple[int, int] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalNotice:
        if threading.current_thread() is not threading.main_thread():
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._fds = (read, write)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        _NOTICES.append(self)
        self._thread = threading.Thread(target=self._watch, args=(read,), daemon=True)
        self._thread.start()
        return self

    def _watch(self, read: int) -> None:
        first = None
        while data := os.read(read, 64):
            for signum in data:
                if signum == self.STOP:
                    return
                if signum in SIGNALS and (first is None or _again(first, signum)):
                    name = signal.Signals(signum).name
                    say(f"{name}: {self.message if first is None else 'stopping at once'}")
                    first = first or time.monotonic()

    def __exit__(self, *exc_info) -> None:
        if self._fds is None:
            return
        read, write = self._fds
        self._fds = None
        try:
            signal.set_wakeup_fd(self._previous_fd)
            _NOTICES.remove(self)
            os.write(write, bytes([self.STOP]))
            self._thread.join(timeout=5)
        finally:
            os.close(write)
            if not self._thread.is_alive():  # Else the daemon thread still reads it.
                os.close(read)

    @staticmethod
    def _after_fork_in_child() -> None:
        if _NOTICES:
            _NOTICES.clear()
            with contextlib.suppress(ValueError):  # Not the child's main thread.
                signal.set_wakeup_fd(-1)


_NOTICES: list[SignalNotice] = []  # The active ones (a forked child drops their fd).
os.register_at_fork(after_in_child=SignalNotice._after_fork_in_child)


# What `train` says when a signal comes: before its steps, during them, and after them.
STARTING_NOTICE = "stopping once the current start-up work returns (a compile can take a while)"
STEPPING_NOTICE = "finishing the current step, then saving a checkpoint (Ctrl-C again: at once)"
CLOSING_NOTICE = "stopping once the current work returns"


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step: the step done (0-based), its metrics (a hook may add
    to them before the record is written), its rollouts, and whether it was the last."""

    run: Run
    step: int
    metrics: dict[str, Any]
    rollouts: list
    last: bool


class Hooks:
    """The loop's periodic jobs, run in the order they were added: each `fn(info)` after
    every `every`-th step (0: never by cadence), and after the last step too when `at_end`."""

    def __init__(self):
        self.hooks: list[tuple[Callable[[StepInfo], None], int, bool]] = []

    def add(self, fn: Callable[[StepInfo], None], *, every: int = 1, at_end: bool = False):
        self.hooks.append((fn, every, at_end))

    def __call__(self, info: StepInfo) -> None:
        for fn, every, at_end in self.hooks:
            if (every and (info.step + 1) % every == 0) or (at_end and info.last):
                fn(info)


class RunExistsError(ValueError):
    """`train` without `resume` or `overwrite` into a directory that holds a run."""


# What a run writes into its directory (wandb's own folder is `wandb` under it).
RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.json", "plot.png")
RUN_FILES += ("samples.jsonl", "wandb")


def _prepare_directory(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuses to train over a run unless resuming it or told to overwrite it."""
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if not present or resume:
        return
    if not overwrite:
        raise RunExistsError(
            f"{str(out_dir)!r} already holds a run ({', '.join(present)}): resume it "
            "(`--resume`), overwrite it (`--overwrite`) or choose another directory."
        )
    _remove_run_files(out_dir, directory_too=False, strict=True)


def checkpoint_hooks(
    hooks: Hooks, checkpoints: CheckpointManager, every: int, stop: StopSignals, out_dir: Path
) -> None:
    """Checkpoints every `every` steps and after the last (none if `every` is 0); on a
    signal (to any process) checkpoints the step and raises `RunInterrupted`."""
    saved = {"step": None}

    def save(info: StepInfo) -> None:
        info.run.save(checkpoints, info.step + 1)
        saved["step"] = info.step

    def stop_check(info: StepInfo) -> None:
        # Any process signalled: all of them checkpoint and stop together (a step's
        # collectives need every process).
        if not any(processes.allgather_json(stop.signum is not None)):
            return
        if saved["step"] != info.step:
            save(info)
        if not info.last:
            raise RunInterrupted(out_dir, info.step + 1, stop.signum or 0)

    hooks.add(save, every=every, at_end=bool(every))
    hooks.add(stop_check)


def show_evaluation(when: str, scores: dict) -> None:
    """One console line of an evaluation's scores (their names without the prefix)."""
    shown = " ".join(f"{k.split('/', 1)[-1]} {v:.3f}" for k, v in scores.items())
    say(f"eval {when}: {shown}")


def output_hooks(hooks: Hooks, run: Run, writer, samples, progress) -> None:
    """Evaluation every `eval_every` steps, then the metrics record (one per optimizer
    step: `learner.mini_batches` x `learner.epochs`), samples and the progress line."""
    config = run.config

    def evaluate(info: StepInfo) -> None:
        scores = info.run.evaluate(evaluation_key(config.seed, info.step + 1))
        info.metrics.update(scores)
        # Both numberings: the record's 0-based step, and the updates done, which name the
        # checkpoint `gac-jax eval --step` reads.
        show_evaluation(f"at step {info.step} (after {info.step + 1} updates)", scores)

    def record(info: StepInfo) -> None:
        metrics = dict(info.metrics)
        for update in [*metrics.pop("updates", [])[:-1], metrics]:
            writer.write(info.step, update)

    hooks.add(evaluate, every=config.eval_every)
    warn = skip_streak_warning(config.gac, say)
    hooks.add(lambda info: warn(info.step, info.metrics))
    hooks.add(record)
    hooks.add(lambda info: samples.write(info.step, info.rollouts, info.last))
    hooks.add(lambda info: progress.update(info.step + 1, info.metrics))


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> Path:
    """Runs the training described by `config`, writing everything under `out_dir`.

    Writes `metrics.jsonl`, `tensorboard/`, `checkpoints/`, `config.json` and, at the end,
    `plot.png`. A directory that holds a run is refused unless `resume` (continue from its
    newest checkpoint) or `overwrite` (delete it first). SIGINT or SIGTERM finish the
    current step, checkpoint it and raise `RunInterrupted`; each is acknowledged on stderr
    at once, also during start-up (`SignalNotice`). Returns `out_dir`.

    Under `jax.distributed` every process calls `train` with the same config and
    `out_dir` (shared storage): each makes its share of every batch, process 0 writes the
    files that are not checkpoints, and all of them write their checkpoint shards. A fresh
    run refused, failed or interrupted before its first step leaves nothing behind.
    """
    with SignalNotice(STARTING_NOTICE) as notice:
        return _train(config, Path(out_dir), resume, overwrite, notice)


def _train(config: TrainConfig, out_dir: Path, resume: bool, overwrite: bool, notice) -> Path:
    primary = processes.is_primary()
    if primary:
        _prepare_directory(out_dir, resume=resume, overwrite=overwrite)
    # Built before the run directory is made: a run refused here (bad data, a bad reward
    # path) leaves nothing behind that the next attempt would take for a run.
    run = build_run(config)
    made_directory = primary and not out_dir.exists()
    if primary:
        out_dir.mkdir(parents=True, exist_ok=True)
    stepped: list[int] = []  # Steps done by this call: none means nothing worth keeping.
    try:
        return _train_into(run, config, out_dir, resume, stepped, notice)
    except BaseException:
        # Refused, failed or interrupted before its first step: a fresh run leaves nothing
        # that the next attempt would take for a run (a resumed one keeps what it had).
        if primary and not resume and not stepped:
            _remove_run_files(out_dir, made_directory)
        raise


def _remove_run_files(out_dir: Path, directory_too: bool, strict: bool = False) -> None:
    """Deletes the run's files (`strict`: failing if a directory cannot be deleted)."""
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=not strict)
        elif path.exists():
            path.unlink()
    if directory_too:
        shutil.rmtree(out_dir, ignore_errors=True)


def _train_into(run: Run, config: TrainConfig, out_dir: Path, resume: bool, stepped: list, notice):
    """`train` once its run is built and its directory exists; appends each step done to
    `stepped`."""
    from gac_jax.train.metrics import NullMetricWriter, ProgressLine, run_writer
    from gac_jax.train.samples import sample_logger

    primary = processes.is_primary()
    processes.barrier("gac_jax.train: run directory ready")
    unfinished = sorted((out_dir / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
    checkpoints = CheckpointManager(out_dir / "checkpoints", max_to_keep=config.keep_checkpoints)
    start_step, rollout_state = 0, None
    if resume:
        for path in unfinished:  # Removed by the manager as it opened.
            say(f"resume: discarded the unfinished checkpoint save {path.name}")
        if checkpoints.steps():
            start_step, rollout_state, skipped = run.restore(checkpoints, out_dir)
            for error in skipped:  # Moved out of the way of the steps saved again.
                say(f"resume: {error}; moved to {checkpoints.set_aside(error.step).name}")
            processes.barrier("gac_jax.train: damaged checkpoints set aside")
            say(
                f"resume: continuing from the checkpoint of step {start_step} in "
                f"{checkpoints.directory}"
            )
        else:
            say(f"resume: no checkpoint in {checkpoints.directory}; starting from step 0")
    # Written once the run is known to be this config's (a refused resume leaves it alone).
    if primary:
        config_json = json.dumps(config_io.config_to_dict(run.config), indent=2)
        (out_dir / "config.json").write_text(config_json)
    writer = run_writer(config, out_dir, start_step=start_step) if primary else NullMetricWriter()
    samples = sample_logger(config, out_dir, writer, run.tokenizer, start_step, primary)
    progress = ProgressLine(total=config.steps, quiet=not primary)
    run.start(rollout_state)
    try:
        with StopSignals() as stop, writer, samples:
            notice.message = STEPPING_NOTICE
            hooks = Hooks()
            hooks.add(lambda info: stepped.append(info.step))
            output_hooks(hooks, run, writer, samples, progress)
            checkpoint_hooks(hooks, checkpoints, config.checkpoint_every, stop, out_dir)
            if primary:
                hooks.add(lambda _: _plot(config, out_dir), every=0, at_end=True)
            _drive(run, hooks, start_step, progress.note)
    finally:
        notice.message = CLOSING_NOTICE  # StopSignals is gone: a signal now stops at once.
        run.close()
        checkpoints.close()
        progress.close()
    return out_dir


def _plot(config: TrainConfig, out_dir: Path) -> None:
    """The run's plot, titled with its directory's name, GAC's thresholds on the cosine
    panel when GAC acts (fixed thresholds; adaptive ones move and are not drawn)."""
    from gac_jax.train.plots import plot_run, threshold_lines

    lines = threshold_lines(config.gac)
    plot_run(out_dir / "metrics.jsonl", out_dir / "plot.png", title=out_dir.name, lines=lines)


def say(message: str) -> None:
    """One line on stderr from the primary process: what a run did that a person should
    know (which checkpoint it resumed from, what it skipped)."""
    if processes.is_primary():
        print(message, file=sys.stderr, flush=True)


def _drive(run: Run, hooks: Hooks, start_step: int, note: Callable[[str], None]) -> None:
    """The loop itself: a step, then the hooks due. The policy before any update is
    evaluated first when `eval_at_start` (under `eval_start/`, in step 0's record). What
    the first step compiles is told to `note` as it starts."""
    config = run.config
    for step in range(start_step, config.steps):
        initial = {}
        if step == 0 and config.eval_at_start:
            note("evaluating the initial policy (compiling the sampler for evaluation)")
            initial = run.evaluate(jax.random.key(config.seed + 3), prefix="eval_start/")
            show_evaluation("before the first step", initial)
        metrics, rollouts = run.step(step, note if step == start_step else None)
        info = StepInfo(run, step, {**initial, **metrics}, rollouts, step + 1 == config.steps)
        hooks(info)
