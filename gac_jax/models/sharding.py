"""Logical-axis sharding for the decoder: rules, PartitionSpecs, meshes and placement.

Every parameter carries the logical names of its dimensions (flax's `out_sharding`
metadata), e.g. `("embed", "heads", "head_dim")` for the query projection. A
`ShardingRules` maps logical names to the mesh axes `data`, `fsdp` and `tensor`:

====================  =================  ======================================
logical name          default mesh axes  meaning
====================  =================  ======================================
``batch``             (data, fsdp)       activations' batch dimension
``sequence``          None               activations' time dimension
``embed``             fsdp               D in parameters (gathered for compute)
``vocab``             tensor             V
``heads``             tensor             N
``kv_heads``          tensor             K
``head_dim``          None               H
``mlp``               tensor             F
``norm``              None               RMSNorm scales
``layers``            None               the decoder's stacked layers (scanned over)
====================  =================  ======================================

A mesh axis missing from the mesh, or one whose size does not divide the dimension, is
dropped from that dimension's spec (it is replicated there instead), so one set of rules
serves every mesh shape. Activation constraints apply whenever a mesh is set with
`jax.set_mesh`; the mesh's axes must be `AxisType.Auto` (`make_mesh` builds one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from gac_jax._validation import check_int

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Mesh axes for each logical axis name, and the activation specs built from them."""

    batch: MeshAxes = ("data", "fsdp")
    sequence: MeshAxes = None
    embed: MeshAxes = "fsdp"
    vocab: MeshAxes = "tensor"
    heads: MeshAxes = "tensor"
    kv_heads: MeshAxes = "tensor"
    head_dim: MeshAxes = None
    mlp: MeshAxes = "tensor"
    norm: MeshAxes = None
    layers: MeshAxes = None

    def mesh_axes(self, logical: str | None) -> MeshAxes:
        """The mesh axes of one logical axis name (None: replicated)."""
        if logical is None:
            return None
        names = [f.name for f in dataclasses.fields(self)]
        if logical not in names:
            raise ValueError(f"Unknown logical axis {logical!r}; known axes: {names}.")
        return getattr(self, logical)

    def spec(self, *logical: str | None) -> PartitionSpec:
        """A PartitionSpec for dimensions with the given logical names."""
        return PartitionSpec(*(self.mesh_axes(name) for name in logical))

    # Activations. Their model dimension is not sharded: FSDP gathers weights, not inputs.
    @property
    def act_btd(self) -> PartitionSpec:
        """Residual stream [B, T, D]."""
        return self.spec("batch", "sequence", None)

    @property
    def act_btnh(self) -> PartitionSpec:
        """Queries and attention outputs [B, T, N, H]."""
        return self.spec("batch", "sequence", "heads", "head_dim")

    @property
    def act_btkh(self) -> PartitionSpec:
        """Keys and values [B, T, K, H]."""
        return self.spec("batch", "sequence", "kv_heads", "head_dim")

    @property
    def act_btf(self) -> PartitionSpec:
        """SwiGLU hidden activations [B, T, F]."""
        return self.spec("batch", "sequence", "mlp")

    @property
    def act_btv(self) -> PartitionSpec:
        """Logits [B, T, V]."""
        return self.spec("batch", "sequence", "vocab")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the ("data", "fsdp", "tensor") mesh; -1 for "the devices the others leave"
    (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        sizes = dataclasses.asdict(self)
        for name, size in sizes.items():
            if size != -1:
                check_int(name, size, 1, note=" or -1 (the devices left)")
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {sizes}.")

    def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The mesh on `devices` (`jax.devices()` by default), a -1 axis taking the rest."""
        self.validate()
        devices = list(jax.devices() if devices is None else devices)
        sizes = dataclasses.asdict(self)
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if len(devices) % fixed:
            raise ValueError(f"mesh {sizes} does not divide the {len(devices)} devices.")
        sizes = {k: (len(devices) // fixed if v == -1 else v) for k, v in sizes.items()}
        return make_mesh(**sizes, devices=devices)


def make_mesh(
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with axes ("data", "fsdp", "tensor"), all `AxisType.Auto`, on the first
    data*fsdp*tensor of `devices` (`jax.devices()` by default). `fsdp` shards parameters'
    D; `tensor` shards heads, MLP width and vocabulary. ValueError for a size that is not
    positive or too few devices.
    """
    for name, size in (("data", data), ("fsdp", fsdp), ("tensor", tensor)):
        check_int(name, size, 1)
    devices = list(jax.devices() if devices is None else devices)
    needed = data * fsdp * tensor
    if len(devices) < needed:
        raise ValueError(
            f"Mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {needed} devices; "
            f"only {len(devices)} available."
        )
    return jax.make_mesh(
        (data, fsdp, tensor),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * 3,
        devices=devices[:needed],
    )


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh) -> PartitionSpec:
    """`spec` with the mesh axes a dimension cannot use removed.

    An axis is removed if the mesh does not have it, if an earlier dimension already used
    it, or if it would not divide the dimension evenly (after the axes kept before it).
    `spec` has at most `len(shape)` entries; `mesh` is a `Mesh` or `AbstractMesh`.
    """
    if len(spec) > len(shape):
        raise ValueError(f"PartitionSpec {spec} has more entries than shape {tuple(shape)}.")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    used: set[str] = set()
    fitted = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = []
        shards = 1
        for axis in axes:
            if axis in sizes and axis not in used and dim % (shards * sizes[axis]) == 0:
                kept.append(axis)
                used.add(axis)
                shards *= sizes[axis]
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while fitted and fitted[-1] is None:
        fitted.pop()
    return PartitionSpec(*fitted)


def constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """`jax.lax.with_sharding_constraint(x, spec)` under the ambient mesh, if one is set.

    Without a mesh (`jax.set_mesh`), `x` is returned unchanged, so the model runs on a
    single device without any sharding setup.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        raise ValueError(
            "gac_jax.models needs a mesh whose axes are AxisType.Auto; got axis_types="
            f"{mesh.axis_types}. Build it with gac_jax.models.make_mesh."
        )
    return jax.lax.with_sharding_constraint(x, fit_spec(spec, x.shape, mesh))


def logical_axes_of(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a parameter was annotated with, or None."""
    return variable.get_metadata().get("out_sharding")


def state_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """A NamedSharding on `mesh` for every variable in `state` (abstract or concrete), from
    its logical axes fitted to its shape (`fit_spec`)."""

    def sharding_of(variable):
        spec = fit_spec(rules.spec(*(logical_axes_of(variable) or ())), variable.shape, mesh)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(sharding_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_with_shardings(tree, shardings):
    """`tree`'s leaves (anything with `.shape` and `.dtype`) as `jax.ShapeDtypeStruct`s on
    `shardings`, a pytree of `tree`'s structure: a target to lower or restore onto."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules | None = None):
    """Moves every variable of `model` onto its NamedSharding, in place; returns `model`."""
    rules = ShardingRules() if rules is None else rules
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def create_sharded(init_fn, mesh: Mesh, rules: ShardingRules | None = None):
    """Builds the module returned by `init_fn()` with every variable born sharded.

    The abstract module comes from `nnx.eval_shape`, its shardings from the logical axes,
    and the real state from `jax.jit(init, out_shardings=...)`, so no full copy of a
    parameter ever lives on one device. `init_fn` takes no arguments; `rules` are
    `ShardingRules()` by default.
    """
    rules = ShardingRules() if rules is None else rules
    abstract = nnx.eval_shape(init_fn)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.state(init_fn()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def describe_shardings(model: nnx.Module) -> dict[str, PartitionSpec]:
    """`{"layers.attn.q_dnh": PartitionSpec(...), ...}` for every placed parameter."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        sharding = getattr(variable.get_value(), "sharding", None)
        key = ".".join(str(p) for p in path)
        out[key] = sharding.spec if isinstance(sharding, NamedSharding) else None
    return out


def host_array(x) -> np.ndarray:
    """`x` gathered to a NumPy array on this host (single-process meshes only)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(
            "Cannot gather a parameter that is not fully addressable from this process "
            f"(shape {x.shape}, sharding {x.sharding}); export from a single-process mesh."
        )
    return np.asarray(jax.device_get(x))
