"""`GRPOLearner`: the sharded, jitted, donated train step over a device mesh, and its
config."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.objective import LossConfig, Objective
from gac_jax.learner.step import make_train_step
from gac_jax.learner.token_budget import budget_micro_batches, trim_padding, used_columns
from gac_jax.models.sharding import ShardingRules, state_shardings

# Trimmed batches are this many columns wide, times some integer (few widths, few compiles).
WIDTH_MULTIPLE = 64

# The batch dimension is split over every axis that does not shard the weights' width.
BATCH_AXES = ("data", "fsdp")


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


def _replaced_leaves(opt_state) -> set[int]:
    """Flat indices of the optimizer-state leaves that are replaced wholesale each step
    (GAC's reference), by their path."""
    paths, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    return {
        i
        for i, (path, _) in enumerate(paths)
        if any(getattr(key, "name", None) == "gac_reference" for key in path)
    }


def _is_abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _with_shardings(tree, shardings):
    """Abstract leaves carrying their shardings, as `jax.jit(...).lower` reads them."""
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        tree,
        shardings,
    )


class NonFiniteStepError(RuntimeError):
    """Too many consecutive train steps had a non-finite loss, gradient or update.

    Each was skipped (params and optimizer state untouched), so the learner's state is that
    of the last finite step and safe to checkpoint; the run cannot make progress, though.
    """


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """How the learner runs the step (the objective itself is a `LossConfig`).

    Attributes:
      micro_batches: gradient accumulation: the batch is split into this many chunks, whose
        gradients are summed exactly (`make_train_step`); it must divide the batch.
      max_consecutive_nonfinite: a step with a non-finite loss, gradient or update is
        skipped (`make_train_step`); this many skipped in a row raise `NonFiniteStepError`.
      logits_chunk_size: the step never materialises the logits [B, T, V]: log-probs and
        entropies are computed this many positions at a time, in the forward and the
        backward pass (`gac_jax.models.chunked_logprobs`), so the logits take
        B x logits_chunk_size x V float32s at a time. Any value gives the same result;
        smaller saves memory, larger means fewer, bigger matmuls.
      max_tokens_per_micro_batch: None, or a token budget per device: each batch is first
        trimmed to the columns its rows use (rounded up to a multiple of 64), then split
        into the fewest micro-batches (at least `micro_batches`) whose rows on one device
        hold at most this many padded tokens (`gac_jax.learner.token_budget`). A batch of
        short completions then runs in few micro-batches and one long completion does not
        set the memory of every batch; the step compiles once per width and count met.
    """

    micro_batches: int = 1
    max_consecutive_nonfinite: int = 3
    logits_chunk_size: int = 512
    max_tokens_per_micro_batch: int | None = None

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        m = self.micro_batches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"micro_batches={m!r} must be an int >= 1.")
        k = self.max_consecutive_nonfinite
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"max_consecutive_nonfinite={k!r} must be an int >= 1.")
        c = self.logits_chunk_size
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"logits_chunk_size={c!r} must be an int >= 1.")
        b = self.max_tokens_per_micro_batch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"max_tokens_per_micro_batch={b!r} must be an int >= 1 or null.")


class ShardedLearner:
    """Params and optimizer state on a mesh, and a jitted, donated step over them.

    The one step machinery of gac_jax: the GRPO learner and the supervised warm start both
    run on it. Params and optimizer state (GAC's reference direction included) carry
    `NamedSharding`s from the model's logical axes; the step is `jax.jit` with in/out
    shardings, and both are donated but for GAC's reference, which the step replaces with
    the gradient.

    Args:
      model: a `gac_jax.models.Decoder` (its params are resharded onto `mesh`).
      tx: the optimizer chain.
      mesh: a mesh with axes ("data", "fsdp", "tensor").
      step: ``step(params, opt_state, batch, *extra) -> (params, opt_state, metrics)``;
        the batch's leaves are split by rows over ("data", "fsdp"), `extra` arguments
        and the metrics are replicated.
      num_extra: how many `extra` arguments the step takes.
      rules: logical-to-mesh sharding rules.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        step,
        *,
        num_extra: int = 0,
        rules: ShardingRules | None = None,
    ):
        self.mesh = mesh
        self.tx = tx
        rules = ShardingRules() if rules is None else rules
        self.graphdef, params = nnx.split(model)
        self.param_shardings = state_shardings(params, mesh, rules)
        self.opt_shardings = optimizer_shardings(tx, params, self.param_shardings, mesh)
        if _is_abstract(params):  # From `nnx.eval_shape`: a learner to `lower`, not to run.
            self.params = _with_shardings(params, self.param_shardings)
            self.opt_state = _with_shardings(jax.eval_shape(tx.init, params), self.opt_shardings)
        else:
            self.params = jax.device_put(params, self.param_shardings)
            self.opt_state = jax.jit(tx.init, out_shardings=self.opt_shardings)(self.params)
        self.batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
        self.replicated = NamedSharding(mesh, P())
        self.batch_divisor = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
        # Params and optimizer state are donated, except the leaves a transform replaces
        # wholesale while still reading the old value (GAC's reference: the new one is
        # this step's gradient). Donating those makes XLA copy the old value out of the
        # way first, a full extra pass; not donating them lets the gradient's own buffer
        # become the new reference, at no extra peak memory.
        leaves, self._opt_treedef = jax.tree.flatten(self.opt_state)
        kept = _replaced_leaves(self.opt_state)
        self._kept = tuple(i for i in range(len(leaves)) if i in kept)
        self._donated = tuple(i for i in range(len(leaves)) if i not in kept)
        self._num_extra = num_extra
        self._step = self.compile_step(step)

    def compile_step(self, step):
        """`step` jitted with this learner's shardings and donation (see the class doc)."""
        opt_sharding_leaves = self._opt_treedef.flatten_up_to(self.opt_shardings)

        def split_step(params, donated, kept, batch, *extra):
            params, opt_state, metrics = step(params, self._merge(donated, kept), batch, *extra)
            return (params, *self._split(opt_state), metrics)

        shardings = self._split_leaves(opt_sharding_leaves)
        return jax.jit(
            split_step,
            in_shardings=(self.param_shardings, *shardings, self.batch_sharding)
            + (None,) * self._num_extra,
            out_shardings=(self.param_shardings, *shardings, self.replicated),
            donate_argnums=(0, 1),
        )

    def run_step(self, batch, *extra, step=None) -> dict[str, float]:
        """One update on a placed batch (with `step`, a `compile_step` result, instead of
        the learner's own); returns the metrics as Python floats."""
        self.params, donated, kept, metrics = (step or self._step)(
            self.params, *self._split(self.opt_state), batch, *extra
        )
        self.opt_state = self._merge(donated, kept)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def lower(self, batch, *extra, step=None) -> jax.stages.Lowered:
        """The step (or `step`, a `compile_step` result) lowered for `batch` (arrays or
        `jax.ShapeDtypeStruct`s, laid out as a placed batch) without running it:
        `.compile()` then gives XLA's memory and cost analyses. Works on a learner built
        from an abstract model (`nnx.eval_shape`)."""
        return (step or self._step).lower(self.params, *self._split(self.opt_state), batch, *extra)

    def model(self) -> nnx.Module:
        """The current params merged into a model (shares the arrays)."""
        return nnx.merge(self.graphdef, self.params)

    def _split_leaves(self, leaves):
        return [leaves[i] for i in self._donated], [leaves[i] for i in self._kept]

    def _split(self, opt_state):
        return self._split_leaves(self._opt_treedef.flatten_up_to(opt_state))

    def _merge(self, donated, kept):
        leaves = [None] * (len(donated) + len(kept))
        for i, leaf in zip(self._donated, donated, strict=True):
            leaves[i] = leaf
        for i, leaf in zip(self._kept, kept, strict=True):
            leaves[i] = leaf
        return self._opt_treedef.unflatten(leaves)


class GRPOLearner(ShardedLearner):
    """Holds params and optimizer state on a mesh and runs the GRPO step on batches.

    A `ShardedLearner` whose step is `make_train_step`'s. Under `jax.distributed`, each
    process passes its own rows (`local_batch`) and they form one global batch.

    Args:
      model: a `gac_jax.models.Decoder` (its params are resharded onto `mesh`).
      tx: the optimizer chain (`make_optimizer`).
      mesh: a mesh with axes ("data", "fsdp", "tensor").
      loss: the objective (`LossConfig()` by default).
      config: the learner's own settings (`LearnerConfig()` by default).
      rules: logical-to-mesh sharding rules.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformationExtraArgs,
        mesh: Mesh,
        *,
        loss: LossConfig | None = None,
        config: LearnerConfig | None = None,
        rules: ShardingRules | None = None,
    ):
        self.config = LearnerConfig() if config is None else config
        self.config.validate()
        self.objective = Objective(LossConfig() if loss is None else loss)
        self.micro_batches = self.config.micro_batches
        self.max_consecutive_nonfinite = self.config.max_consecutive_nonfinite
        self.logits_chunk_size = self.config.logits_chunk_size
        self.max_tokens_per_micro_batch = self.config.max_tokens_per_micro_batch
        self.consecutive_nonfinite = 0
        # Learner versions of the last finite step and of the first of the skipped run.
        self._last_finite_step: int | None = None
        self._first_nonfinite_step: int | None = None
        self._make_step = functools.partial(
            make_train_step,
            nnx.graphdef(model),
            tx,
            loss,
            logits_chunk_size=self.logits_chunk_size,
        )
        step = self._make_step(micro_batches=self.micro_batches)
        super().__init__(model, tx, mesh, step, num_extra=1, rules=rules)
        self._steps = {self.micro_batches: self._step}  # By micro-batch count.

    def step_for(self, micro_batches: int):
        """The jitted step that splits a batch into `micro_batches` (compiled once)."""
        if micro_batches not in self._steps:
            step = self._make_step(micro_batches=micro_batches)
            self._steps[micro_batches] = self.compile_step(step)
        return self._steps[micro_batches]

    def budget_micro_batches(self, rows: int, width: int) -> int:
        """Micro-batches for a batch of `rows` x `width` (the token budget's, or the
        configured count without a budget)."""
        if not self.max_tokens_per_micro_batch:
            return self.micro_batches
        return budget_micro_batches(
            rows,
            width,
            self.max_tokens_per_micro_batch,
            minimum=self.micro_batches,
            devices=self.batch_divisor,
        )

    def _fit_budget(self, local_batch: TrainBatch) -> tuple[TrainBatch, int]:
        """The host batch trimmed to its used columns (the same ones in every process) and
        the micro-batch count its token budget needs (`token_budget`)."""
        columns = used_columns(local_batch.attention_mask)
        if jax.process_count() > 1:
            bounds = multihost_utils.process_allgather(np.asarray(columns))
            columns = (int(bounds[:, 0].min()), int(bounds[:, 1].max()))
        batch = trim_padding(local_batch, WIDTH_MULTIPLE, columns)
        rows, width = batch.num_sequences * jax.process_count(), batch.tokens.shape[1]
        return batch, self.budget_micro_batches(rows, width)

    def place_batch(self, local_batch: TrainBatch) -> TrainBatch:
        """Host rows -> one global batch sharded over ("data", "fsdp").

        With several processes, each passes its own rows (the same count everywhere);
        `jax.make_array_from_process_local_data` assembles the global arrays. Group ids are
        local to each process's rows (`collate` numbers groups from 0 everywhere), so they
        are made globally distinct first: `id * process_count + process_index`.
        """
        rows = local_batch.num_sequences * jax.process_count()
        if rows % self.batch_divisor:
            raise ValueError(
                f"the global batch of {rows} sequences is not divisible by the "
                f"{self.batch_divisor} devices of the mesh's data x fsdp axes "
                f"({dict(self.mesh.shape)})."
            )
        if jax.process_count() == 1:
            return jax.device_put(local_batch, self.batch_sharding)
        group_ids = np.asarray(local_batch.group_ids)
        local_batch = dataclasses.replace(
            local_batch,
            group_ids=group_ids * jax.process_count() + jax.process_index(),
        )
        batch = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x),
            local_batch,
        )
        if batch.num_sequences != rows:
            # The batch axes do not split the processes apart: each would claim the same rows.
            raise ValueError(
                f"the mesh's data x fsdp axes ({dict(self.mesh.shape)}) must give every one of "
                f"the {jax.process_count()} processes its own rows; the global batch has "
                f"{batch.num_sequences} sequences, not {rows}."
            )
        return batch

    def step(self, batch: TrainBatch, learner_version: int) -> dict[str, float]:
        """One update on `batch` (host or placed); returns the metrics as Python floats.

        A non-finite step is skipped (metric `nonfinite_step` = 1.0, state untouched);
        `config.max_consecutive_nonfinite` of them in a row raise `NonFiniteStepError`.
        """
        micro_batches = self.micro_batches
        placed = (
            isinstance(batch.tokens, jax.Array) and batch.tokens.sharding == self.batch_sharding
        )
        if self.max_tokens_per_micro_batch and not placed:
            batch, micro_batches = self._fit_budget(batch)
        if not placed:
            batch = self.place_batch(batch)
        metrics = self.run_step(batch, np.int32(learner_version), step=self.step_for(micro_batches))
        metrics["micro_batches"] = float(micro_batches)
        if metrics["nonfinite_step"] == 0.0:
            self.consecutive_nonfinite = 0
            self._last_finite_step = learner_version
            return metrics
        if self.consecutive_nonfinite == 0:
            self._first_nonfinite_step = learner_version
        self.consecutive_nonfinite += 1
        if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            kept = (
                f"those of step {self._last_finite_step}"
                if self._last_finite_step is not None
                else f"those from before step {self._first_nonfinite_step}"
            )
            raise NonFiniteStepError(
                f"step {learner_version}: {self.consecutive_nonfinite} consecutive non-finite "
                f"steps (loss, gradient, update or reward); params and optimizer state are {kept}"
            )
        return metrics
