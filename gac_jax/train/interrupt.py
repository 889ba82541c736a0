"""Stopping a run cleanly: SIGINT (Ctrl-C) and SIGTERM (a preempted VM) finish the current
step, write a checkpoint and end the run with `RunInterrupted`, whose message says how to
resume. A second Ctrl-C stops at once (Python's default behaviour)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(RuntimeError):
    """The run stopped on a signal after checkpointing step `next_step`."""

    def __init__(self, out_dir: Path, next_step: int, signum: int):
        self.out_dir, self.next_step, self.signum = Path(out_dir), next_step, signum
        name = signal.Signals(signum).name
        super().__init__(
            f"{name}: stopped after step {next_step} and saved a checkpoint; resume with "
            f"`gac-jax train --out {self.out_dir} --resume`."
        )

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


class StopSignals:
    """While active, the first SIGINT or SIGTERM is recorded in `signum` instead of
    stopping the process; the previous handlers come back on exit. Outside the main
    thread (where Python cannot install handlers) it records nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Asked twice: stop now.
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
