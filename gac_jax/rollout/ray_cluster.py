"""The Ray side of a run: its settings (`RayConfig`), and a local cluster started from a
clean interpreter (`LocalRayCluster`).

`ray.init()` with no cluster starts Ray's daemons through a Python `preexec_fn`, Python in a
forked child: in a process where JAX has started its threads, the fork-without-exec JAX
warns about (a likely deadlock). Here `ray start --head --block` runs in a fresh
interpreter launched without a `preexec_fn` (fork and exec at once), the caller joins it
with `connect`, and ending the `LocalRayCluster` stops its whole process group.

Ray's token authentication is on, as `ray.init()` would have it: both sides read the token
from Ray's default place (`RAY_AUTH_MODE` tells the joining process). `ray start` does not
create a missing token, so the cluster first runs `ray get-auth-token --generate` (Ray 2.5x
and later; older Rays have no token authentication).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from gac_jax._validation import check_choice

AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
ON_ACTOR_FAILURE = ("replace", "stop")
_RAY_COMMAND = (sys.executable, "-m", "ray.scripts.scripts")  # The `ray` CLI of this Python.


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """The rollout actors of `rollout.backend=ray` (`RayRolloutPool`).

    Attributes:
      on_actor_failure: "replace" a dead actor and retry its groups, or "stop" the run with
        an error naming it.
      actor_gpus: GPUs each actor asks Ray for (0: the actors' JAX runs on whatever Ray
        leaves them, the CPU on a GPU node).
    """

    on_actor_failure: str = "replace"
    actor_gpus: float = 0.0

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        check_choice("on_actor_failure", self.on_actor_failure, ON_ACTOR_FAILURE)
        if isinstance(self.actor_gpus, bool) or not self.actor_gpus >= 0:
            raise ValueError(f"actor_gpus={self.actor_gpus!r} must be a number >= 0.")


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ensure_auth_token(env: dict[str, str]) -> None:
    """Creates Ray's authentication token where Ray looks for it, unless one exists (the
    command keeps an existing token, so clusters already running keep theirs). A Ray
    without token authentication has no such command: its failure is ignored."""
    subprocess.run(
        [*_RAY_COMMAND, "get-auth-token", "--generate"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,  # The token is printed: keep it off the terminal.
        timeout=120,
        check=False,
    )


class LocalRayCluster:
    """A one-node Ray cluster of this machine, in its own process group.

    Its ports are drawn free (not the GCS's and dashboard agent's fixed defaults), so
    several can run at once.

    Example::

        with LocalRayCluster(num_cpus=4) as cluster:
            cluster.connect()
            ...
            ray.shutdown()
    """

    def __init__(self, num_cpus: int | None = None, *, start_timeout: float = 120.0):
        self.num_cpus = num_cpus
        self.start_timeout = start_timeout
        self.address: str | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    def start(self) -> LocalRayCluster:
        port = _free_port()
        command = [
            *_RAY_COMMAND,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus}")
        env = {**os.environ, AUTH_MODE_VARIABLE: os.environ.get(AUTH_MODE_VARIABLE, "token")}
        if env[AUTH_MODE_VARIABLE].lower() == "token":
            _ensure_auth_token(env)
        self._log = tempfile.NamedTemporaryFile(prefix="gac_jax_ray_", suffix=".log", delete=False)
        self._process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Its own process group, stopped as one in `stop`.
        )
        deadline = time.monotonic() + self.start_timeout
        while not _port_open(port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                with open(self._log.name, errors="replace") as f:
                    tail = f.read()[-2000:]
                self.stop()
                raise RuntimeError(f"the local Ray cluster did not start; its log ends:\n{tail}")
            time.sleep(0.2)
        self.address = f"127.0.0.1:{port}"
        return self

    def connect(self, **init_kwargs) -> None:
        """`ray.init` on this cluster (keyword arguments go to `ray.init`)."""
        import ray
        from ray._raylet import Config

        if self.address is None:
            raise RuntimeError("the local Ray cluster is not started; call start() first")
        os.environ.setdefault(AUTH_MODE_VARIABLE, "token")
        # Ray caches the mode when it is imported, possibly before the line above: re-read
        # it, as `ray.init` does for a cluster it starts itself.
        Config.initialize("")
        ray.init(address=self.address, **init_kwargs)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            for sig, timeout in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=timeout)
                    break
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
