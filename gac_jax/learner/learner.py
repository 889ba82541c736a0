"""`ShardedLearner`: params and optimizer state on a device mesh, and a jitted, donated
step over them (the GRPO learner of `gac_jax.learner.grpo` and the supervised warm start
both run on it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gac_jax.learner.optimizer import replaced_leaves
from gac_jax.models.sharding import ShardingRules, abstract_with_shardings, state_shardings

# The batch dimension is split over every axis that does not shard the weights' width.
BATCH_AXES = ("data", "fsdp")


# XLA:CPU page-faults a step's arena of temporaries in afresh on every call; this scheduler
# orders the same ops for a third less arena (steps 5-7% faster, benchmarks/README.md).
# `plan`'s learners (abstract: lowered, never run) compile without it, as for an accelerator.
CPU_STEP_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def optimizer_shardings(tx, abstract_params, param_shardings, mesh: Mesh):
    """Shardings of `tx`'s state: each param-shaped leaf (moments, GAC's reference) takes
    its param's sharding; scalars, counters and the leaves of a params-like tree with
    other shapes (adafactor's factored row and column statistics) are replicated."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, P())

    def sharding_of(leaf, param, sharding):
        return sharding if jnp.shape(leaf) == jnp.shape(param) else replicated

    return optax.tree_utils.tree_map_params(
        tx,
        sharding_of,
        abstract_state,
        abstract_params,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def is_abstract(tree) -> bool:
    """Whether `tree` holds abstract leaves (`jax.ShapeDtypeStruct`: from `nnx.eval_shape`)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def with_shardings(tree, shardings):
    """`tree` on `shardings`: arrays put there; abstract leaves (`is_abstract`) made to
    carry them, as `jax.jit(...).lower` reads them."""
    if not is_abstract(tree):
        return jax.device_put(tree, shardings)
    return abstract_with_shardings(tree, shardings)


class ShardedLearner:
    """Params and optimizer state on a mesh, and a jitted, donated step over them.

    The one step machinery of gac_jax: the GRPO learner and the supervised warm start both
    run on it. Params and optimizer state (GAC's reference direction included) carry
    `NamedSharding`s from the model's logical axes; the step is `jax.jit` with in/out
    shardings, and both are donated but for GAC's reference, which the step replaces with
    the gradient.

    Args:
      model: a `gac_jax.models.Decoder` (its params are resharded onto `mesh`, a mesh with
        axes ("data", "fsdp", "tensor")).
      trainable: None (every param trains), or an nnx filter of the params that train
        (`gac_jax.models.lora.lora_filter`): `params` (what the optimizer, GAC and ESS
        see) are those; the rest are `frozen`, sharded alike, never donated, and passed
        to the step as ``step(..., frozen=frozen)``.
      kept: ``opt_state -> a bool per leaf``: the optimizer-state leaves not donated, as the
        chain's builder declares them (`replaced_leaves`: GAC's references).
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        rules: ShardingRules | None = None,
        trainable=None,
        kept=replaced_leaves,
    ):
        self.mesh = mesh
        self.tx = tx
        self.rules = rules = ShardingRules() if rules is None else rules
        if trainable is None:
            (self.graphdef, params), frozen = nnx.split(model), None
        else:
            self.graphdef, params, frozen = nnx.split(model, trainable, ...)
        self.frozen_shardings = None if frozen is None else state_shardings(frozen, mesh, rules)
        self.frozen = None if frozen is None else with_shardings(frozen, self.frozen_shardings)
        self.param_shardings = state_shardings(params, mesh, rules)
        self.opt_shardings = optimizer_shardings(tx, params, self.param_shardings, mesh)
        self.params = with_shardings(params, self.param_shardings)
        if is_abstract(params):  # From `nnx.eval_shape`: a learner to `lower`, not to run.
            self.opt_state = with_shardings(jax.eval_shape(tx.init, params), self.opt_shardings)
        else:
            self.opt_state = jax.jit(tx.init, out_shardings=self.opt_shardings)(self.params)
        self.batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
        self.replicated = NamedSharding(mesh, P())
        self.batch_divisor = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
        self._opt_treedef = jax.tree.structure(self.opt_state)
        keep = self._opt_treedef.flatten_up_to(kept(self.opt_state))
        self._kept = tuple(i for i, k in enumerate(keep) if k)
        self._donated = tuple(i for i, k in enumerate(keep) if not k)

    def compile_step(self, step, num_extra: int = 0):
        """`step` jitted with this learner's shardings and donation (see the class doc):
        ``step(params, opt_state, batch, *extra) -> (params, opt_state, metrics)`` with
        `num_extra` `extra` arguments; the batch's leaves are split by rows over ("data",
        "fsdp"), the `extra` arguments and the metrics are replicated. On XLA:CPU a learner
        that runs compiles it with `CPU_STEP_COMPILER_OPTIONS`. A subclass sets
        ``self._step`` to one, the step `run_step` runs by default."""
        opt_sharding_leaves = self._opt_treedef.flatten_up_to(self.opt_shardings)

        def split_step(params, donated, kept, frozen, batch, *extra):
            kwargs = {} if frozen is None else {"frozen": frozen}
            opt_state = self._merge(donated, kept)
            params, opt_state, metrics = step(params, opt_state, batch, *extra, **kwargs)
            return (params, *self._split(opt_state), metrics)

        shardings = self._split_leaves(opt_sharding_leaves)
        return jax.jit(
            split_step,
            in_shardings=(self.param_shardings, *shardings, self.frozen_shardings)
            + (self.batch_sharding,)
            + (None,) * num_extra,
            out_shardings=(self.param_shardings, *shardings, self.replicated),
            donate_argnums=(0, 1),
            compiler_options=CPU_STEP_COMPILER_OPTIONS if self.runs_on_cpu else None,
        )

    @property
    def runs_on_cpu(self) -> bool:
        """Whether the step runs (its params are arrays, not abstract) on XLA:CPU."""
        return not is_abstract(self.params) and all(
            d.platform == "cpu" for d in self.mesh.devices.flat
        )

    def run_step(self, batch, *extra, step=None) -> dict[str, float]:
        """One update on a placed batch with the step (or `step`, a `compile_step`
        result); returns the metrics as Python floats (lists for stacked ones)."""
        self.params, donated, kept, metrics = (step or self._step)(
            self.params, *self._split(self.opt_state), self.frozen, batch, *extra
        )
        self.opt_state = self._merge(donated, kept)
        return {k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}

    def lower(self, batch, *extra, step=None) -> jax.stages.Lowered:
        """The step (or `step`, a `compile_step` result) lowered for `batch` (arrays or
        `jax.ShapeDtypeStruct`s, laid out as a placed batch) without running it:
        `.compile()` then gives XLA's memory and cost analyses. Works on a learner built
        from an abstract model (`nnx.eval_shape`)."""
        return (step or self._step).lower(
            self.params, *self._split(self.opt_state), self.frozen, batch, *extra
        )

    def model(self) -> nnx.Module:
        """The current params (and frozen ones) merged into a model (shares the arrays)."""
        if self.frozen is None:
            return nnx.merge(self.graphdef, self.params)
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def _split_leaves(self, leaves):
        return [leaves[i] for i in self._donated], [leaves[i] for i in self._kept]

    def _split(self, opt_state):
        return self._split_leaves(self._opt_treedef.flatten_up_to(opt_state))

    def _merge(self, donated, kept):
        by_index = dict(zip(self._donated + self._kept, [*donated, *kept], strict=True))
        return self._opt_treedef.unflatten([by_index[i] for i in range(len(by_index))])
