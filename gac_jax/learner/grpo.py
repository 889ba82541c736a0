"""`GRPOLearner`: the GRPO step (`make_train_step`, set by a `LearnerConfig`) on a
`ShardedLearner`: token-budget micro-batches, PPO mini-batches and epochs, the frozen
reference policy, and the guard against runs of non-finite updates."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.learner import BATCH_AXES, ShardedLearner, with_shardings
from gac_jax.learner.objective import LossConfig, Objective
from gac_jax.learner.step import LearnerConfig, make_train_step
from gac_jax.learner.token_budget import MicroBatching, trim_padding, used_columns
from gac_jax.models.config import ModelConfig
from gac_jax.models.sharding import ShardingRules

# Trimmed batches are this many columns wide, times some integer (few widths, few compiles).
WIDTH_MULTIPLE = 64


class NonFiniteStepError(RuntimeError):
    """Too many consecutive train steps had a non-finite loss, gradient or update.

    Each was skipped (params and optimizer state untouched), so the learner's state is that
    of the last finite step and safe to checkpoint; the run cannot make progress, though.
    """


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
      trainable: None, or an nnx filter of the params that train (`ShardedLearner`).
      reference: the frozen reference policy of a KL penalty or `tb` (a model of the same
        architecture), when the objective `needs_reference`; None: the initial params.
        Kept on the devices, or in host memory with `config.reference_offload`.
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
        trainable=None,
        reference: nnx.Module | None = None,
    ):
        self.config = LearnerConfig() if config is None else config
        self.objective = Objective(LossConfig() if loss is None else loss)
        self.consecutive_nonfinite = 0
        # Learner versions of the last finite step and of the first of the skipped run.
        self._last_finite_step: int | None = None
        self._first_nonfinite_step: int | None = None
        self._train_step = make_train_step(  # Validates the config before any array is placed.
            nnx.graphdef(model),
            tx,
            self.objective.config,
            config=self.config,
            row_sharding=NamedSharding(mesh, P(BATCH_AXES)),
        )
        super().__init__(model, tx, mesh, rules=rules, trainable=trainable)
        self.micro_batching = self._micro_batching(getattr(model, "config", None))
        self._steps = {}  # The compiled steps by micro-batch count.
        self._step = self.step_for(self.micro_batching.least)
        self.reference = self._place_reference(reference, trainable)

    def _place_reference(self, reference, trainable):
        """The reference params on the params' shardings (host memory when offloaded), or
        None when the objective reads no reference."""
        if not self.objective.needs_reference:
            return None
        if reference is None:  # The initial params (LoRA: the adapters at zero).
            state = jax.tree.map(jnp.copy, self.params)
        elif trainable is not None:
            raise ValueError("a reference model with a `trainable` filter (LoRA) is not supported.")
        else:
            state = nnx.state(reference)
        shardings = self.param_shardings
        if self.config.reference_offload:
            shardings = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings)
        return with_shardings(state, shardings)

    def step_for(self, micro_batches: int):
        """The jitted step that splits a batch into `micro_batches` (compiled once)."""
        if micro_batches not in self._steps:
            step = functools.partial(self._train_step, micro_batches=micro_batches)
            self._steps[micro_batches] = self.compile_step(step, num_extra=2)
        return self._steps[micro_batches]

    def _micro_batching(self, model_config) -> MicroBatching:
        """This learner's `MicroBatching`: a `Decoder` on XLA:CPU has its budget, unless a
        split costs a whole-batch pass (batch statistics) or is not allowed (a partition
        function)."""
        spec = self.objective.spec
        splits = spec.batch_statistics is None and not spec.needs_reference
        runs = isinstance(model_config, ModelConfig) and self.runs_on_cpu
        cpu_model = model_config if splits and runs else None
        return MicroBatching.of(self.config, cpu_model=cpu_model, devices=self.batch_divisor)

    def _trimmed(self, local_batch: TrainBatch) -> TrainBatch:
        """The host batch trimmed to its used columns (the same ones in every process)."""
        columns = used_columns(local_batch.attention_mask)
        if jax.process_count() > 1:
            bounds = multihost_utils.process_allgather(np.asarray(columns))
            columns = (int(bounds[:, 0].min()), int(bounds[:, 1].max()))
        return trim_padding(local_batch, WIDTH_MULTIPLE, columns)

    def check_batch_rows(self, rows: int) -> None:
        """The one check that a global batch of `rows` sequences splits evenly over the
        mesh's data x fsdp devices: ValueError in one line otherwise."""
        if rows % self.batch_divisor:
            raise ValueError(
                f"the global batch of {rows} sequences is not divisible by the "
                f"{self.batch_divisor} devices of the mesh's data x fsdp axes "
                f"({dict(self.mesh.shape)})."
            )

    def place_batch(self, local_batch: TrainBatch) -> TrainBatch:
        """Host rows -> one global batch sharded over ("data", "fsdp").

        With several processes, each passes its own rows (the same count everywhere);
        `jax.make_array_from_process_local_data` assembles the global arrays. Group ids are
        local to each process's rows (`collate` numbers groups from 0 everywhere), so they
        are made globally distinct first: `id * process_count + process_index`.
        """
        rows = local_batch.num_sequences * jax.process_count()
        self.check_batch_rows(rows)
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

    def step(self, batch: TrainBatch, learner_version: int) -> dict[str, Any]:
        """The updates of one rollout batch (host or placed); returns its metrics as Python
        floats.

        With several optimizer steps per batch (`config.mini_batches` x `config.epochs`),
        the metrics of each update are also listed under ``"updates"`` (with its
        ``optimizer_step``, ``epoch`` and ``mini_batch``), and the top-level ones are the
        last update's. A non-finite update is skipped (metric `nonfinite_step` = 1.0, state
        untouched); `config.max_consecutive_nonfinite` of them in a row raise
        `NonFiniteStepError`.
        """
        tokens, rule = batch.tokens, self.micro_batching
        placed = isinstance(tokens, jax.Array) and tokens.sharding == self.batch_sharding
        if rule.max_tokens and not placed:
            batch = self._trimmed(batch)
        if not placed:
            batch = self.place_batch(batch)
        # A batch placed by the caller is not trimmed: a configured budget leaves it alone.
        budgeted = not (placed and rule.max_tokens)
        micro_batches = rule.count(*batch.tokens.shape) if budgeted else rule.least
        step = self.step_for(micro_batches)
        metrics = self.run_step(batch, np.int32(learner_version), self.reference, step=step)
        metrics["micro_batches"] = float(micro_batches)
        for update in self._per_update(metrics, learner_version):
            self._count_nonfinite(update["nonfinite_step"], learner_version)
        return metrics

    def _per_update(self, metrics: dict[str, Any], learner_version: int) -> list[dict]:
        """Splits stacked per-update metrics into one record per optimizer step."""
        count, per_epoch = self.config.updates_per_batch, self.config.mini_batches
        if count == 1:
            return [metrics]
        stacked = {name: v for name, v in metrics.items() if isinstance(v, list)}
        updates = []
        for u in range(count):
            epoch, mini_batch = divmod(u, per_epoch)
            record = {name: v[u] for name, v in stacked.items()}
            record.update(
                optimizer_step=learner_version * count + u, epoch=epoch, mini_batch=mini_batch
            )
            updates.append(record)
        metrics.update(updates[-1])
        metrics["updates"] = updates
        return updates

    def _count_nonfinite(self, nonfinite: float, learner_version: int) -> None:
        if nonfinite == 0.0:
            self.consecutive_nonfinite = 0
            self._last_finite_step = learner_version
            return
        if self.consecutive_nonfinite == 0:
            self._first_nonfinite_step = learner_version
        self.consecutive_nonfinite += 1
        if self.consecutive_nonfinite >= self.config.max_consecutive_nonfinite:
            kept = (
                f"those of step {self._last_finite_step}"
                if self._last_finite_step is not None
                else f"those from before step {self._first_nonfinite_step}"
            )
            raise NonFiniteStepError(
                f"step {learner_version}: {self.consecutive_nonfinite} consecutive non-finite "
                f"steps (loss, gradient, update or reward); params and optimizer state are {kept}"
            )
