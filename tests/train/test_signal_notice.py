"""Ctrl-C is acknowledged at once (issue #42: during start-up it was said 22 s later): a
real process inside one long native call (an SVD, as an XLA compile would be) prints the
notice while the call still runs, and Python's own KeyboardInterrupt comes after it."""

import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import process_env

CHILD = """
import sys, time, numpy as np
from gac_jax.train.loop import SignalNotice
a = np.random.default_rng(0).standard_normal((1200, 1200))
with SignalNotice("stopping once the current work returns"):
    print("ready", flush=True)
    started = time.monotonic()
    try:
        np.linalg.svd(a)  # One native call: no Python handler runs inside it.
    except KeyboardInterrupt:
        pass
    print(f"returned {time.monotonic() - started:.3f}", flush=True)
"""


def test_a_signal_is_acknowledged_while_the_main_thread_is_in_native_code():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=process_env(1),
        # SIGINT as a shell gives it: an xdist worker may ignore it, and an ignored signal
        # stays ignored across exec (Python then installs no handler and writes nothing).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # Inside the SVD.
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    notice = child.stderr.readline().strip()
    noticed = time.monotonic() - sent
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert notice == "SIGINT: stopping once the current work returns"
    ran = float(out.split()[-1])  # The call's whole time, from before the signal.
    assert noticed < ran - 0.2, (noticed, ran)  # Said while the call was still running.


FORKING = """
import os, signal, time
from gac_jax.train.loop import SignalNotice
with SignalNotice("x"):
    pid = os.fork()  # A child holds a copy of the notice's pipe (a user's process pool).
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    started = time.monotonic()
print(f"left {time.monotonic() - started:.3f}", flush=True)
os.kill(pid, signal.SIGKILL)
"""


def test_leaving_does_not_wait_on_a_forked_childs_copy_of_the_pipe():
    done = subprocess.run(
        [sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=60,
        env=process_env(1),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 2.0  # Not the child's 60 s, nor the 5 s timeout.


STEP = """
import time
from gac_jax.train.loop import InterruptedAtOnce, SignalNotice, StopSignals
with SignalNotice("finishing the step") as notice, StopSignals() as stop:
    print("ready", flush=True)
    try:
        while stop.signum is None:
            time.sleep(0.001)
        end = time.monotonic() + 3  # The rest of the step, in Python: handlers run at once.
        while time.monotonic() < end:
            time.sleep(0.001)
        print("finished the step", flush=True)
    except InterruptedAtOnce:
        print("stopped at once", flush=True)
"""


@pytest.mark.parametrize(
    ("gap", "out", "said"),
    [
        # `timeout -s INT` signals the process, then its group: one request, said once.
        (0.05, "finished the step", ["SIGINT: finishing the step"]),
        (1.5, "stopped at once", ["SIGINT: finishing the step", "SIGINT: stopping at once"]),
    ],
)
def test_a_second_sigint_stops_at_once_only_when_it_is_a_second_request(gap, out, said):
    child = subprocess.Popen(
        [sys.executable, "-c", STEP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=process_env(1),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGINT)
    time.sleep(gap)
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    assert stdout.strip() == out
    assert stderr.strip().splitlines() == said
