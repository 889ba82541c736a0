"""A run's checkpoints: what `train` saves at a step and restores on `--resume`.

Saved: the learner's params and optimizer state (a LoRA run's adapters only: its frozen
base is rebuilt from `init` as the run first built it), the ParamStore's history (the
policies the sampler ran, merged in a LoRA run, on the learner's shardings, whatever
devices the sampler uses), and JSON metadata: the next step, the config hash, and each
learner process's rollout source state (group numbering, buffer accounting). Never saved
from non-finite state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from gac_jax.train import config_io, processes
from gac_jax.train.checkpoint import CheckpointManager
from gac_jax.train.config_io import RESUMABLE_FIELDS, resume_hash

if TYPE_CHECKING:
    from gac_jax.train.loop import Run


def _checkpoint_state(run: Run) -> dict[str, Any]:
    store, params, like = run.store, run.learner.params, run.policy.like()
    history = {str(v): run.placement.to_learner(store.get(v), like) for v in store.versions()}
    return {"params": params, "opt_state": run.learner.opt_state, "history": history}


def _all_finite(tree) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    # One program (one set of collectives on every process, not one per leaf).
    finite = jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves)
    # Replicated on every device; read this process's copy (multi-process safe).
    return bool(np.asarray(finite.addressable_shards[0].data))


def save_run(run: Run, checkpoints: CheckpointManager, next_step: int, source) -> None:
    """Saves what resuming at `next_step` needs: params, optimizer, the store's history,
    the rollout source's state (group numbering, buffer accounting). Never from
    non-finite state: that would poison every resume."""
    state = _checkpoint_state(run)
    if not _all_finite(state):
        raise FloatingPointError(
            f"step {next_step}: params or optimizer state are not finite; no checkpoint "
            "written (the last one is kept)."
        )
    metadata = {
        "next_step": next_step,
        "seed": run.config.seed,
        "config_hash": resume_hash(run.config),
        "store_versions": run.store.versions(),
        "data_position": next_step * run.config.rollout.groups_per_batch,
        # One state per learner process (each has its own group numbering).
        "rollout_states": processes.allgather_json(source.state()),
    }
    checkpoints.save(next_step, state, metadata)


def _check_resumable(run: Run, metadata: dict, out_dir: Path) -> None:
    if metadata.get("config_hash") == resume_hash(run.config):
        return
    saved = out_dir / "config.json"
    changed = []
    if saved.is_file():
        old = json.loads(saved.read_text())
        changed = [k for k, _, _ in config_io.config_diff(old, run.config)]
        changed = [k for k in changed if k.split(".")[0] not in RESUMABLE_FIELDS]
    fields = f" ({', '.join(changed)} changed)" if changed else ""
    raise ValueError(
        f"the checkpoint in {str(out_dir)!r} was written by a different config{fields}; "
        f"only {', '.join(RESUMABLE_FIELDS)} may change on resume."
    )


def restore_run(run: Run, checkpoints: CheckpointManager, out_dir: Path) -> tuple[int, dict]:
    """Restores params, optimizer and the store's history; returns the next step and the
    rollout source's recorded state (None for checkpoints that predate it)."""
    metadata = checkpoints.read_metadata()
    _check_resumable(run, metadata, out_dir)
    versions = metadata["store_versions"]
    target = {
        "params": run.learner.params,
        "opt_state": run.learner.opt_state,
        "history": {str(v): run.policy.like() for v in versions},
    }
    restored = checkpoints.restore(target=target).state
    run.learner.params = restored["params"]
    run.learner.opt_state = restored["opt_state"]
    for v in versions:
        run.store.publish(run.placement.to_rollout(restored["history"][str(v)]), v)
    return int(metadata["next_step"]), _own_rollout_state(metadata)


def _own_rollout_state(metadata: dict) -> dict | None:
    """This process's rollout source state in a checkpoint's metadata (None in
    checkpoints that predate it)."""
    states = metadata.get("rollout_states")
    if states is None:
        return metadata.get("rollout_state")  # Written before multi-process runs.
    if len(states) != jax.process_count():
        raise ValueError(
            f"the checkpoint was written by {len(states)} learner processes; resume it with "
            f"as many, not {jax.process_count()}."
        )
    return states[jax.process_index()]
