"""Several learner processes under `jax.distributed`: who writes, and what they share.

A run over P processes is one SPMD program per step, fed by P rollout sources (each makes
its own share of the batch). Files that are not arrays (metrics, TensorBoard, plots,
config.json) are written by process 0 only; checkpoints are written by orbax, which has
every process save its own shards. The little that differs per process and must be
checkpointed (each source's group numbering) is gathered to every process as JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

# `gac-jax train` reads these when a flag is not given.
ENV_COORDINATOR = "GAC_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "GAC_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "GAC_JAX_PROCESS_ID"


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts `jax.distributed` from the arguments or the ``GAC_JAX_*`` variables; returns
    whether it was started (a single-process run starts nothing).

    With none of them given, nothing is started: one process. A coordinator address
    ("host:port") with the process count and this process's id starts a cluster by hand;
    `num_processes=-1` alone leaves everything to `jax.distributed.initialize()`'s own
    detection of the cluster it runs in (SLURM, Open MPI, Kubernetes, TPU pods).
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if num_processes == -1:
        jax.distributed.initialize()
        return True
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == len(given):
        return False
    if missing:
        raise ValueError(
            f"a multi-process run needs coordinator, num_processes and process_id; "
            f"{', '.join(missing)} missing (flags or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, "
            f"{ENV_PROCESS_ID})."
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes}).")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True


def is_primary() -> bool:
    """True on the process that writes the run's non-array files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, in process order (one process: [value])."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.asarray([data.size], np.int32))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[: data.size] = data
    everything = multihost_utils.process_allgather(padded)
    return [
        json.loads(bytes(row[: int(n)]).decode())
        for row, n in zip(everything, np.ravel(lengths), strict=True)
    ]
