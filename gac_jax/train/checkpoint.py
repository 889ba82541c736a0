"""Orbax checkpoints: a pytree of arrays plus a JSON metadata dict, one directory of steps.

Layout (an `orbax.checkpoint.CheckpointManager` with two items)::

    <directory>/<step>/state/...              the arrays (OCDBT, one file set per save)
    <directory>/<step>/metadata/metadata      the metadata dict, as JSON

A save writes into ``<step>.orbax-checkpoint-tmp-<time>/`` and renames it to
``<step>/`` only once everything is on disk (on object stores without atomic rename,
orbax relies on a ``commit_success.txt`` marker written last instead). Orbax lists only
finalised steps, so a save interrupted at any point leaves nothing that `latest_step` or
`restore` would pick.

A step that cannot be read back raises `DamagedCheckpointError` (one line naming the step
and the cause), which `restore_newest` skips; old steps are deleted by rename first
(`_prune`: ``.deleting-<step>-<id>``), so a killed deletion leaves no half-deleted step.

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
import errno
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from gac_jax._closing import Closing
from gac_jax._quiet import absl_records_dropped
from gac_jax._validation import check_int
from gac_jax.models.decoder import saved_per_layer, stack_layers, unstack_layers
from gac_jax.models.sharding import abstract_with_shardings
from gac_jax.train.checkpoint_faults import (
    DamagedCheckpointError,
    disk_errno,
    failed_write_record,
    short_cause,
)

__all__ = ["Checkpoint", "CheckpointManager", "DamagedCheckpointError", "abstract_tree",
           "latest_step", "load_model_params", "model_params", "read_metadata",
           "restore_checkpoint", "restore_model", "save_checkpoint"]  # fmt: skip

STATE_ITEM = "state"
METADATA_ITEM = "metadata"
# An old step being deleted: renamed to this prefix first (never listed as a step), then
# removed; leftovers of a killed deletion are removed when a writer opens the directory.
DELETING_PREFIX = ".deleting-"
SAVE_MARGIN_BYTES = 1 << 20  # Orbax's own files (metadata, manifests) beside the arrays.
DAMAGED_PREFIX = ".damaged-"  # A damaged step set aside by a resume (`set_aside`).


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
    """A `jax.ShapeDtypeStruct` for every leaf of `tree` (anything with `.shape` and
    `.dtype`), a restore target. `shardings`: a pytree of them shaped like `tree`, one for
    every leaf, or None: each leaf keeps its own sharding, else the first local device."""

    def own_sharding(leaf):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding):
            return sharding
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    if shardings is None:
        shardings = jax.tree.map(own_sharding, tree)
    elif isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return abstract_with_shardings(tree, shardings)


def _read_only_notice(record: logging.LogRecord) -> bool:
    """orbax's "Given directory is read only" record, which it logs as a warning for every
    read-only manager: reading a checkpoint (the shipped warm start, ``eval``) is the
    intended use, not a problem to report."""
    return record.getMessage().startswith("Given directory is read only")


class CheckpointManager(Closing):
    """A directory of step checkpoints, each a pytree of arrays plus JSON metadata.

    Over `orbax.checkpoint.CheckpointManager`: the layout fixed, the last `max_to_keep`
    steps kept, restores onto given shardings (without a target onto the first local
    device, so a checkpoint written on one mesh loads anywhere). `directory` is absolute.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = False,
        read_only: bool = False,
    ):
        """Opens (and, unless `read_only`, creates) the directory. `async_save` writes in a
        background thread (`save` returns once the arrays are on host; `wait_until_finished`
        before depending on it); `read_only` never writes or deletes anything."""
        check_int("max_to_keep", max_to_keep, 1, allow_none=True)
        self.directory = Path(directory).expanduser().resolve()
        self.max_to_keep = None if read_only else max_to_keep
        self._async_save = async_save
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"No checkpoint directory at {str(self.directory)!r}.")
        options = ocp.CheckpointManagerOptions(
            # Old steps are deleted here, by rename first (`_prune`), not by orbax, whose
            # deletion killed midway leaves a step listed with half its files. A reader is
            # given the settings orbax would force for read_only itself, so it has nothing
            # to warn about (it logs each one it overrides).
            max_to_keep=None,
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
        if not read_only and jax.process_index() == 0:
            for leftover in self.directory.glob(DELETING_PREFIX + "*"):
                shutil.rmtree(leftover, ignore_errors=True)

    def close(self) -> None:
        """Waits for any pending save (and its pruning), then releases orbax's resources."""
        if self._async_save:
            self.wait_until_finished()
        self._manager.close()

    def wait_until_finished(self) -> None:
        """Blocks until a pending asynchronous save is finalised (then deletes the steps
        beyond `max_to_keep`)."""
        self._manager.wait_until_finished()
        self._prune()

    def _prune(self) -> None:
        """Deletes the oldest finalised steps beyond `max_to_keep`, each renamed out of the
        step listing first (`DELETING_PREFIX`); process 0 deletes, as orbax does."""
        if self.max_to_keep is None or jax.process_index() != 0:
            return
        for step in self.steps()[: -self.max_to_keep]:
            doomed = self.directory / f"{DELETING_PREFIX}{step}-{uuid.uuid4().hex[:8]}"
            os.replace(self.directory / str(step), doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        self._manager.reload()

    def steps(self) -> tuple[int, ...]:
        """The finalised steps on disk, ascending."""
        self._manager.reload()  # Another process may have saved or deleted steps.
        return tuple(sorted(self._manager.all_steps()))

    def latest_step(self) -> int | None:
        """The newest finalised step, or None if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, metadata: dict[str, Any] | None = None) -> None:
        """Saves `state` (a pytree of arrays) and `metadata` (a JSON-able dict) as `step`,
        then deletes the oldest steps beyond `max_to_keep`. ValueError if `step` is negative
        or already saved, or `metadata` is not JSON-serialisable."""
        check_int("step", step, 0)
        metadata = {} if metadata is None else metadata
        _check_jsonable(metadata)
        if step in self.steps():
            raise ValueError(f"Step {step} is already saved in {str(self.directory)!r}.")
        self._check_space(step, state)
        try:
            with absl_records_dropped(failed_write_record):
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
        except Exception as error:
            code = disk_errno(error)
            if code is None:
                raise
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)  # Free what the failed save took.
            raise OSError(
                code,
                f"{os.strerror(code)} (checkpoint step {step} not written)",
                str(self.directory),
            ) from error
        if not self._async_save:  # An asynchronous save prunes once it is finalised.
            self._prune()

    def set_aside(self, step: int) -> Path:
        """Moves a (damaged) step out of the listing, to ``.damaged-<step>-<id>`` beside
        the steps, so that the step can be saved again; returns where it went. Process 0
        moves it; the files are kept for a person to inspect."""
        aside = self.directory / f"{DAMAGED_PREFIX}{step}-{uuid.uuid4().hex[:8]}"
        if jax.process_index() == 0:
            os.replace(self.directory / str(step), aside)
        self._manager.reload()
        return aside

    def _check_space(self, step: int, state) -> None:
        """Refuses a save the disk has no room for before orbax writes a byte: a save that
        runs out of space midway fails in orbax's writer threads, which print pages of
        tracebacks before the error reaches the caller."""
        needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        needed = needed // jax.process_count() + SAVE_MARGIN_BYTES
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"No space left on device: checkpoint step {step} needs about "
                f"{needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free",
                str(self.directory),
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
        with self._reading(step):
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
            )
            metadata = restored[METADATA_ITEM]
            if not isinstance(metadata, dict | None):
                raise TypeError(f"the metadata is a {type(metadata).__name__}, not a dict")
        return dict(metadata or {})

    def state_metadata(self, step: int | None = None):
        """The saved tree of array metadata (`.shape`, `.dtype`) of `step`; dict keys come
        back as strings (orbax stores paths), e.g. a list index 0 as "0"."""
        step = self._resolve_step(step)
        with self._reading(step):
            return self._manager.item_metadata(step)[STATE_ITEM].tree

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Turns any failure to read `step`'s files into `DamagedCheckpointError`."""
        try:
            yield
        except DamagedCheckpointError:
            raise
        except Exception as error:  # Orbax and tensorstore raise anything, even Exception.
            raise DamagedCheckpointError(self.directory, step, error) from error

    def restore(self, step: int | None = None, *, target=None, shardings=None) -> Checkpoint:
        """Restores `step` (the latest finalised one by default) onto the shardings of
        `target` (a pytree of `ShapeDtypeStruct`s or arrays with the saved structure; None:
        the saved structure, see `state_metadata`), or of `shardings` (as `abstract_tree`'s).
        FileNotFoundError if there is no such step, DamagedCheckpointError if unreadable.
        """
        step = self._resolve_step(step)
        return self._restore(step, self.read_metadata(step), target, shardings)

    def _restore(self, step: int, metadata: dict[str, Any], target, shardings) -> Checkpoint:
        """`restore` of a step whose metadata is already read."""
        saved = self.state_metadata(step)
        target = abstract_tree(saved if target is None else target, shardings)
        # A decoder's params saved per layer, before its scan: read so, then stacked.
        per_layer = saved_per_layer(saved) and not saved_per_layer(target)
        read = unstack_layers(target) if per_layer else target
        with self._reading(step):
            state = self._manager.restore(
                step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(read)})
            )[STATE_ITEM]
        if per_layer:  # Both trees' leaves in the order of their sorted keys.
            leaves = jax.tree.leaves(stack_layers(state))
            state = jax.tree.unflatten(jax.tree.structure(target), leaves)
            state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, target))
        return Checkpoint(step=step, state=state, metadata=metadata)

    def restore_newest(
        self,
        target_of: Callable[[dict[str, Any]], Any],
        *,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[Checkpoint, list[DamagedCheckpointError]]:
        """Restores the newest step that reads back intact onto `target_of(metadata)`;
        returns it and the errors of the newer steps skipped, newest first. `check` sees
        each step's metadata first; what it raises propagates. FileNotFoundError if no step
        reads back intact (naming each and why)."""
        skipped: list[DamagedCheckpointError] = []
        for step in reversed(self.steps()):
            try:
                metadata = self.read_metadata(step)
                if check is not None:
                    check(metadata)
                return self._restore(step, metadata, target_of(metadata), None), skipped
            except DamagedCheckpointError as error:
                skipped.append(error)
        if not skipped:
            raise FileNotFoundError(f"No finalised checkpoint in {str(self.directory)!r}.")
        causes = "; ".join(f"step {e.step}: {short_cause(e.cause)}" for e in skipped)
        raise FileNotFoundError(
            f"no intact checkpoint in {str(self.directory)!r}, every step is damaged ({causes})"
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
    """Restores saved parameters into `model` (of the saved architecture) in place, each
    onto the sharding its parameter has now (a `create_sharded` model is filled shard by
    shard). `params_key`: restore only that entry of a saved dict (e.g. "params" next to an
    optimizer state). Returns the `Checkpoint`, `state` the restored pure dict of params.
    """
    target = abstract_tree(model_params(model))
    with CheckpointManager(directory, read_only=True) as checkpoints:
        if params_key is None:
            restored = checkpoints.restore(step, target=target)
        else:
            full = abstract_tree(checkpoints.state_metadata(step))
            restored = checkpoints.restore(step, target={**full, params_key: target})
    params = restored.state if params_key is None else restored.state[params_key]
    load_model_params(model, params)
    return dataclasses.replace(restored, state=params)
