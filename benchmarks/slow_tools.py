"""The calculator environment with a slow tool, for `tool_episodes.py`: every step waits a
latency drawn from a log-normal (median `MEDIAN_SECONDS`, sigma `SIGMA`, at most
`MAX_SECONDS`) before it answers, as a remote tool or a sandbox would."""

from __future__ import annotations

import math
import random
import threading
import time

from gac_jax.tasks.calculator import Calculator

MEDIAN_SECONDS, SIGMA, MAX_SECONDS = 0.05, 1.0, 2.0
_rng = random.Random(0)
_lock = threading.Lock()


class SlowCalculator(Calculator):
    """`Calculator` whose steps take a heavy-tailed time; `latency = False` (class-wide)
    turns the wait off (the benchmark's calibration of the generation cost)."""

    latency = True

    def step(self, state, turn):
        if type(self).latency:
            with _lock:
                seconds = _rng.lognormvariate(math.log(MEDIAN_SECONDS), SIGMA)
            time.sleep(min(seconds, MAX_SECONDS))
        return super().step(state, turn)
