"""A run's state as its checkpoints hold it: one record, one save, one restore path.

`RunState` is what resuming at `next_step` needs: the learner's params and optimizer state (a
LoRA run's adapters only: its frozen base is rebuilt from `init`), the ParamStore's history (the
policies the sampler ran, by version, merged in a LoRA run, on the learner's shardings whatever
devices the sampler uses), and each learner process's rollout source state (group numbering,
buffer accounting); the checkpoint's metadata also names the config (`config_hash`: a resume of
another config is refused) and the seed. It is never saved from non-finite arrays. `Run.save`,
`Run.restore` (resume) and `Run.load` (evaluation and export) all go through `save_run_state`
and `restore_run_state`; the orbax I/O itself is `checkpoint.CheckpointManager`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gac_jax.train.checkpoint import CheckpointManager, DamagedCheckpointError


@dataclasses.dataclass
class RunState:
    """What a checkpoint of a run holds (see the module's docstring): `history` maps a
    version to the params the sampler ran at it; `rollout_states` is None in checkpoints
    written before multi-process runs (they held one `rollout_state`); `config_hash` is
    `config_io.resume_hash` of the run's config."""

    next_step: int
    params: Any
    opt_state: Any
    history: dict[int, Any]
    rollout_states: list | None
    config_hash: str
    seed: int

    def arrays(self) -> dict[str, Any]:
        """The pytree a checkpoint stores (its metadata holds the rest)."""
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "history": {str(v): p for v, p in self.history.items()},
        }

    def metadata(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "seed": self.seed,
            "config_hash": self.config_hash,
            "store_versions": list(self.history),
            "rollout_states": self.rollout_states,
        }


def save_run_state(checkpoints: CheckpointManager, state: RunState) -> None:
    """Saves `state` as step `state.next_step`; FloatingPointError (nothing written, the
    last checkpoint kept) when any of its arrays is not finite: that would poison every
    resume."""
    arrays = state.arrays()
    if not _all_finite(arrays):
        raise FloatingPointError(
            f"step {state.next_step}: params or optimizer state are not finite; no checkpoint "
            "written (the last one is kept)."
        )
    checkpoints.save(state.next_step, arrays, state.metadata())


def restore_run_state(
    checkpoints: CheckpointManager,
    template: Callable[[Sequence[int]], dict[str, Any]],
    *,
    step: int | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[RunState, list[DamagedCheckpointError]]:
    """The run state of `step` (a damaged one raises `DamagedCheckpointError`), or with
    None of the newest step that reads back intact, and the damaged newer steps skipped,
    newest first. `template(versions)` is the restore target of a checkpoint holding the
    store's `versions`: a `RunState.arrays()`-shaped tree of arrays or abstract arrays (with
    shardings). `check` is called on the metadata of the step about to be restored (e.g.
    refusing another config's); what it raises propagates."""
    skipped: list[DamagedCheckpointError] = []
    if step is None:
        restored, skipped = checkpoints.restore_newest(
            lambda metadata: template(metadata["store_versions"]), check=check
        )
    else:
        metadata = checkpoints.read_metadata(step)
        if check is not None:
            check(metadata)
        restored = checkpoints.restore(step, target=template(metadata["store_versions"]))
    metadata, arrays = restored.metadata, restored.state
    state = RunState(
        next_step=int(metadata["next_step"]),
        params=arrays["params"],
        opt_state=arrays["opt_state"],
        history={v: arrays["history"][str(v)] for v in metadata["store_versions"]},
        rollout_states=metadata.get("rollout_states"),
        config_hash=metadata.get("config_hash"),
        seed=metadata.get("seed"),
    )
    if state.rollout_states is None and metadata.get("rollout_state") is not None:
        state.rollout_states = [metadata["rollout_state"]]  # Before multi-process runs.
    return state, skipped


@jax.jit
def _finite(leaves) -> jax.Array:
    # One program (one set of collectives on every process, not one per leaf), compiled
    # once per run's layout rather than at every checkpoint.
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _all_finite(tree) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = _finite(leaves)
    # Replicated on every device; read this process's copy (multi-process safe).
    return bool(np.asarray(finite.addressable_shards[0].data))
