"""Where rollouts are sampled: the rollout devices, and each published version moved there.

Three layouts (DESIGN.md, "Scale"):

- **Shared** (`placement.devices=0`, one process): the sampler runs on the learner's mesh.
  Publishing copies the params (the learner donates its own to the next step).
- **Split** (`placement.devices=N`): every process gives the last N of its local devices to
  sampling, the learner's mesh the rest (`split_devices`). The sampler's own mesh is
  ``("data", "fsdp", "tensor")`` with fsdp 1 (params over `tensor`, prompts over `data`).
  Publishing is one asynchronous `jax.device_put` between the two meshes' shardings, so
  the learner's next step starts while it lands.
- **Many processes** (`jax.distributed`): a sampler never launches a program spanning
  processes (threads on different hosts would order them differently: gloo's "collective
  mismatch"), so its mesh is process-local, and publishing first replicates the params
  over the learner's mesh (one all-gather, from the learner's thread in every process),
  then places each process's local replica on its mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gac_jax._validation import check_int
from gac_jax.models.sharding import (
    MeshConfig,
    ShardingRules,
    abstract_with_shardings,
    make_mesh,
    state_shardings,
)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Which devices sample (`RolloutPlacement.from_config`).

    Attributes:
      devices: local devices each process gives to sampling, the learner keeping the rest
        (`split_devices`); 0 shares the learner's devices (CPU laptops).
      tensor_parallel: devices per model replica on the sampler's mesh (split layout, and
        each Ray actor's own devices).
    """

    devices: int = 0
    tensor_parallel: int = 1

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        check_int("devices", self.devices, 0)
        check_int("tensor_parallel", self.tensor_parallel, 1)
        if self.devices and self.devices % self.tensor_parallel:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} must divide devices={self.devices}."
            )


def split_devices(
    rollout_devices: int, devices: Sequence[jax.Device] | None = None
) -> tuple[list[jax.Device], list[jax.Device]]:
    """(learner devices, this process's rollout devices).

    Each process gives the last `rollout_devices` of its local devices (by id) to sampling;
    the learner gets every other device of every process, so all processes agree on the
    learner's mesh. 0 gives the learner everything and returns no rollout devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_int("placement.devices", rollout_devices, 0)
    if rollout_devices == 0:
        return devices, []
    by_process: dict[int, list[jax.Device]] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    taken: dict[int, list[jax.Device]] = {}
    for process, local in by_process.items():
        if not 0 < rollout_devices < len(local):
            raise ValueError(
                f"placement.devices={rollout_devices} must leave the learner at least one of "
                f"the {len(local)} devices of process {process} (0 shares them)."
            )
        taken[process] = sorted(local, key=lambda d: d.id)[-rollout_devices:]
    rollout = {d.id for ds in taken.values() for d in ds}
    learner = [d for d in devices if d.id not in rollout]
    return learner, taken.get(jax.process_index(), [])


def rollout_mesh(devices: Sequence[jax.Device], tensor_parallel: int = 1) -> Mesh:
    """The sampler's mesh: ``(data, fsdp=1, tensor)`` with `tensor_parallel` devices per
    model replica and `len(devices) // tensor_parallel` replicas."""
    if len(devices) % tensor_parallel:
        raise ValueError(
            f"placement.tensor_parallel={tensor_parallel} must divide the "
            f"{len(devices)} rollout devices."
        )
    return make_mesh(len(devices) // tensor_parallel, 1, tensor_parallel, devices=devices)


class RolloutPlacement:
    """Moves each published version to where the sampler runs (see the module docstring).

    Args:
      learner_mesh: the learner's mesh.
      mesh: the sampler's own mesh (`rollout_mesh`), or None to sample on the learner's
        (shared layout, one process only; with several processes the local devices are used).
      rules: the logical-to-mesh rules that place params on `mesh`.
    """

    @classmethod
    def from_config(cls, config: PlacementConfig, mesh: MeshConfig) -> RolloutPlacement:
        """The placement of `config`: the learner's mesh of `mesh` on every device but this
        process's rollout devices, and the sampler's own mesh on those (shared if none)."""
        learner_devices, devices = split_devices(config.devices)
        sampler_mesh = rollout_mesh(devices, config.tensor_parallel) if devices else None
        return cls(mesh.make(learner_devices), sampler_mesh)

    @classmethod
    def local(cls, config: PlacementConfig) -> RolloutPlacement:
        """A placement on this process's local devices alone (a Ray rollout actor's)."""
        mesh = rollout_mesh(jax.local_devices(), config.tensor_parallel)
        return cls(mesh, mesh)

    def __init__(
        self,
        learner_mesh: Mesh,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
    ):
        self.learner_mesh = learner_mesh
        if mesh is None and jax.process_count() > 1:
            mesh = rollout_mesh(jax.local_devices())
        self.mesh = mesh
        self._rules = ShardingRules() if rules is None else rules
        self._shardings = None  # Built from the first params published.

    @property
    def shared(self) -> bool:
        """True when the sampler runs on the learner's own mesh."""
        return self.mesh is None

    @property
    def devices(self) -> list[jax.Device]:
        """The devices the sampler runs on."""
        mesh = self.learner_mesh if self.mesh is None else self.mesh
        return list(mesh.devices.flat)

    def to_rollout(self, params):
        """A copy of `params` (an `nnx.State`) on the sampler's devices.

        Shared: a device copy. Split: an asynchronous device-to-device `device_put`. Many
        processes: every process must call this in the same order (it all-gathers).
        """
        if self.mesh is None:
            return jax.tree.map(jnp.copy, params)
        if self._shardings is None:
            self._shardings = state_shardings(params, self.mesh, self._rules)
        if jax.process_count() > 1:
            params = self._local_replica(params)
        return jax.device_put(params, self._shardings)

    def abstract_rollout(self, params):
        """`params` (arrays or `jax.ShapeDtypeStruct`s) as `ShapeDtypeStruct`s with the
        shardings `to_rollout` would give them: what a sampler is lowered on (`plan`)."""
        if self.mesh is None:
            shardings = jax.tree.map(lambda x: x.sharding, params)
        else:
            shardings = state_shardings(params, self.mesh, self._rules)
        return abstract_with_shardings(params, shardings)

    def to_learner(self, params, like):
        """Published `params` back on the learner's shardings (those of `like`): what a
        checkpoint stores of the store's history. Many processes: every process calls it
        with its own (identical) replica."""
        if self.mesh is None:
            return params
        shardings = jax.tree.map(lambda x: x.sharding, like)
        if jax.process_count() == 1:
            return jax.device_put(params, shardings)

        def global_array(x, sharding):
            host = np.asarray(jax.device_get(x))
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(global_array, params, shardings)

    def _local_replica(self, params):
        """Each leaf in full on one of this process's devices (an all-gather over the
        learner's mesh, then the local shard of the replicated result)."""
        replicated = NamedSharding(self.learner_mesh, PartitionSpec())
        gathered = jax.jit(lambda tree: tree, out_shardings=replicated)(params)
        return jax.tree.map(lambda x: x.addressable_shards[0].data, gathered)

    def input_sharding(self, rows: int) -> NamedSharding | None:
        """Where a sampler batch of `rows` prompts goes: split over the rollout mesh's
        `data` axis when it divides the rows, else replicated; None in the shared layout
        (the jit places the uncommitted inputs with the params)."""
        if self.mesh is None:
            return None
        data = self.mesh.shape["data"]
        spec = PartitionSpec("data") if rows % data == 0 else PartitionSpec()
        return NamedSharding(self.mesh, spec)

    def place_inputs(self, *arrays: np.ndarray) -> tuple[Any, ...]:
        """`arrays` (a sampler call's [rows, ...] inputs) on the rollout mesh."""
        if self.mesh is None:
            return arrays
        sharding = self.input_sharding(arrays[0].shape[0])
        return tuple(jax.device_put(np.asarray(a), sharding) for a in arrays)
