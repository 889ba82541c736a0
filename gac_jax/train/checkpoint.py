"""Orbax checkpoints: a pytree of arrays plus a JSON metadata dict, one directory of steps.

Layout (an `orbax.checkpoint.CheckpointManager` with two items)::

    <directory>/<step>/state/...              the arrays (OCDBT, one file set per save)
    <directory>/<step>/metadata/metadata      the metadata dict, as JSON

A save writes into ``<step>.orbax-checkpoint-tmp-<time>/`` and renames it to
``<step>/`` only once everything is on disk (on object stores without atomic rename,
orbax relies on a ``commit_success.txt`` marker written last instead). Orbax lists only
finalised steps, so a save interrupted at any point leaves nothing that `latest_step` or
`restore` would pick.

Flax NNX models are saved as the pure dict of their parameters (`model_params`) and
restored onto a model of the same architecture (`restore_model`), which also restores
each parameter onto that model's own sharding::

    with CheckpointManager("/ckpt/run", max_to_keep=2) as checkpoints:
        checkpoints.save(step, {"params": model_params(model), "opt": opt_state},
                         {"step": step, "config_hash": h})
    restored = restore_model("/ckpt/run", model)   # latest step, in place
    restored.metadata["config_hash"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from gac_jax._quiet import absl_records_dropped
from gac_jax._validation import check_int

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "abstract_tree",
    "latest_step",
    "load_model_params",
    "model_params",
    "read_metadata",
    "restore_checkpoint",
    "restore_model",
    "save_checkpoint",
]

STATE_ITEM = "state"
METADATA_ITEM = "metadata"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One restored checkpoint."""

    step: int
    state: Any  # The pytree of arrays, as saved (or shaped like the restore target).
    metadata: dict[str, Any]  # The JSON metadata saved with it ({} if none was).


def _check_jsonable(metadata: dict[str, Any]) -> None:
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}.")
    for key, value in metadata.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"metadata[{key!r}] is not JSON-serialisable ({error}); convert arrays and "
                "numpy scalars to lists and Python numbers."
            ) from error


def abstract_tree(tree, shardings=None):
    """A `jax.ShapeDtypeStruct` for every leaf of `tree`, with a sharding on each.

    Args:
      tree: a pytree of arrays, `jax.ShapeDtypeStruct`s or orbax array metadata (anything
        with `.shape` and `.dtype`).
      shardings: a pytree of `jax.sharding.Sharding` with the structure of `tree`, or
        one sharding for every leaf, or None. Leaves without one keep their own
        sharding (a `jax.Array`'s, or a `ShapeDtypeStruct`'s) or get the first local
        device.

    Returns:
      The pytree of `jax.ShapeDtypeStruct`, a restore target.
    """

    def own_sharding(leaf):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding):
            return sharding
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    if shardings is None:
        shardings = jax.tree.map(own_sharding, tree)
    elif isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        tree,
        shardings,
    )


def _read_only_notice(record: logging.LogRecord) -> bool:
    """orbax's "Given directory is read only" record, which it logs as a warning for every
    read-only manager: reading a checkpoint (the shipped warm start, ``eval``) is the
    intended use, not a problem to report."""
    return record.getMessage().startswith("Given directory is read only")


class CheckpointManager:
    """A directory of step checkpoints, each a pytree of arrays plus JSON metadata.

    A thin layer over `orbax.checkpoint.CheckpointManager` that fixes the layout (the
    items "state" and "metadata"), keeps the last `max_to_keep` steps, and restores onto
    given shardings (or, without a target, onto the first local device, so a checkpoint
    written on one mesh loads on any machine).

    Attributes:
      directory: the absolute checkpoint directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = False,
        read_only: bool = False,
    ):
        """Opens (and, unless `read_only`, creates) the checkpoint directory.

        Args:
          directory: where the step directories live.
          max_to_keep: keep only the newest this many steps (None keeps all).
          async_save: write in a background thread (`save` returns once the arrays are
            copied to host); call `wait_until_finished` before depending on a save.
          read_only: never write or delete anything (e.g. the shipped warm start inside
            an installed package).
        """
        check_int("max_to_keep", max_to_keep, 1, allow_none=True)
        self.directory = Path(directory).expanduser().resolve()
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"No checkpoint directory at {str(self.directory)!r}.")
        options = ocp.CheckpointManagerOptions(
            # A reader is given the settings orbax would force for read_only itself, so it
            # has nothing to warn about (it logs each one it overrides).
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            read_only=read_only,
            create=not read_only,
            # Leftovers of an interrupted save are never listed as steps; a writer also
            # deletes them on opening (a reader never touches the directory).
            cleanup_tmp_directories=not read_only,
        )
        with absl_records_dropped(_read_only_notice) if read_only else contextlib.nullcontext():
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    STATE_ITEM: ocp.StandardCheckpointHandler(),
                    METADATA_ITEM: ocp.JsonCheckpointHandler(),
                },
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Waits for any pending save, then releases orbax's resources."""
        self._manager.close()

    def wait_until_finished(self) -> None:
        """Blocks until a pending asynchronous save is finalised."""
        self._manager.wait_until_finished()

    def steps(self) -> tuple[int, ...]:
        """The finalised steps on disk, ascending."""
        self._manager.reload()  # Another process may have saved or deleted steps.
        return tuple(sorted(self._manager.all_steps()))

    def latest_step(self) -> int | None:
        """The newest finalised step, or None if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, metadata: dict[str, Any] | None = None) -> None:
        """Saves `state` (a pytree of arrays) and `metadata` (a JSON-able dict) as `step`.

        Then deletes the oldest steps beyond `max_to_keep`.

        Raises:
          ValueError: if `step` is negative or already saved, or `metadata` is not
            JSON-serialisable.
        """
        check_int("step", step, 0)
        metadata = {} if metadata is None else metadata
        _check_jsonable(metadata)
        if step in self.steps():
            raise ValueError(f"Step {step} is already saved in {str(self.directory)!r}.")
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave(state),
                    METADATA_ITEM: ocp.args.JsonSave(metadata),
                }
            ),
            force=True,
        )

    def _resolve_step(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"No finalised checkpoint in {str(self.directory)!r}.")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"No checkpoint for step {step} in {str(self.directory)!r}; steps: {steps}."
            )
        return step

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata dict of `step` (the latest by default), without reading arrays."""
        step = self._resolve_step(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
        )
        return dict(restored[METADATA_ITEM] or {})

    def state_metadata(self, step: int | None = None):
        """The saved tree of array metadata (`.shape`, `.dtype`) of `step`.

        Dict keys come back as strings (orbax stores paths), e.g. a list index 0 as "0".
        """
        step = self._resolve_step(step)
        return self._manager.item_metadata(step)[STATE_ITEM].tree

    def restore(self, step: int | None = None, *, target=None, shardings=None) -> Checkpoint:
        """Restores `step` (the latest finalised one by default).

        Args:
          step: which step.
          target: a pytree of `jax.ShapeDtypeStruct`s or arrays with the saved structure,
            shapes and dtypes; the arrays are restored onto its shardings. Without a
            target, the saved structure is used (dict keys as strings, see
            `state_metadata`).
          shardings: a pytree of shardings (structure of `target`, or of the saved tree
            if there is no target) or one sharding for all leaves; overrides the
            target's. Leaves with neither go to the first local device.

        Returns:
          The `Checkpoint`.

        Raises:
          FileNotFoundError: if there is no such finalised step.
        """
        step = self._resolve_step(step)
        if target is None:
            target = self.state_metadata(step)
        target = abstract_tree(target, shardings)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardRestore(target),
                    METADATA_ITEM: ocp.args.JsonRestore(),
                }
            ),
        )
        return Checkpoint(
            step=step,
            state=restored[STATE_ITEM],
            metadata=dict(restored[METADATA_ITEM] or {}),
        )


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state,
    metadata: dict[str, Any] | None = None,
    *,
    max_to_keep: int | None = None,
) -> Path:
    """Saves one step synchronously (see `CheckpointManager.save`); returns its directory."""
    with CheckpointManager(directory, max_to_keep=max_to_keep) as checkpoints:
        checkpoints.save(step, state, metadata)
        return checkpoints.directory / str(step)


def restore_checkpoint(
    directory: str | os.PathLike, step: int | None = None, *, target=None, shardings=None
) -> Checkpoint:
    """Restores `step` (the latest by default) read-only; see `CheckpointManager.restore`."""
    with CheckpointManager(directory, read_only=True) as checkpoints:
        return checkpoints.restore(step, target=target, shardings=shardings)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest finalised step in `directory`, or None (also if it does not exist)."""
    if not Path(directory).is_dir():
        return None
    with CheckpointManager(directory, read_only=True) as checkpoints:
        return checkpoints.latest_step()


def read_metadata(directory: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """The metadata dict of `step` (the latest by default), read-only."""
    with CheckpointManager(directory, read_only=True) as checkpoints:
        return checkpoints.read_metadata(step)


def model_params(model: nnx.Module) -> dict:
    """The model's `nnx.Param`s as a pure nested dict of arrays (what is checkpointed)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_model_params(model: nnx.Module, params: dict) -> nnx.Module:
    """Writes a pure dict from `model_params` into `model`, in place; returns `model`."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def restore_model(
    directory: str | os.PathLike,
    model: nnx.Module,
    step: int | None = None,
    *,
    params_key: str | None = None,
) -> Checkpoint:
    """Restores saved parameters into `model` in place, each onto the sharding its
    parameter has now (so a model built with `gac_jax.models.create_sharded` is filled
    shard by shard).

    Args:
      directory: the checkpoint directory.
      model: a model of the saved architecture (its current values are overwritten).
      step: which step; the latest by default.
      params_key: if the saved state is a dict holding the params under this key (e.g.
        "params" next to an optimizer state), restore only that entry.

    Returns:
      The `Checkpoint`, whose `state` is the restored pure dict of parameters.
    """
    target = abstract_tree(model_params(model))
    with CheckpointManager(directory, read_only=True) as checkpoints:
        if params_key is None:
            restored = checkpoints.restore(step, target=target)
            params = restored.state
        else:
            saved = checkpoints.state_metadata(step)
            full = abstract_tree(saved)
            full[params_key] = target
            restored = checkpoints.restore(step, target=full)
            params = restored.state[params_key]
    load_model_params(model, params)
    return dataclasses.replace(restored, state=params)
