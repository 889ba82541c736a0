"""A run: everything a `TrainConfig` builds, and what it does between the loop's hooks.

`build_run(config)` is the one builder: the training loop, `plan` (`abstract=True`: no
weight is made, only shapes, dtypes and shardings), `eval` and `export-hf` all build
through it, so what `plan` reports is the run that will happen (LoRA, split devices).

A `Run` publishes its params as a version, takes the step's batch from its rollout source,
updates, evaluates, and saves or restores its state (`run_state.RunState`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gac_jax import models
from gac_jax.learner import GRPOLearner, TrainBatch
from gac_jax.models.lora import Policy
from gac_jax.rollout import (
    ParamStore,
    Partition,
    PromptOrder,
    TaskGroupGenerator,
    collate,
    make_sampler,
    make_source,
    store_history,
)
from gac_jax.rollout.evaluation import EvalSettings, evaluate_policy
from gac_jax.rollout.placement import RolloutPlacement
from gac_jax.train import build, config_io, processes
from gac_jax.train.batch_reports import BatchReport, batch_reports
from gac_jax.train.checkpoint import CheckpointManager, DamagedCheckpointError
from gac_jax.train.config import TrainConfig, require_init
from gac_jax.train.run_state import RunState, restore_run_state, save_run_state


@dataclasses.dataclass
class Run:
    """Everything `build_run` makes of a config, and the run's behaviour between hooks.

    `start` makes the rollout source (and the Ray actors of `rollout.backend=ray`); `step`
    trains one step; `evaluate`, `save`, `restore` and `load` do what they say; `close`
    stops the rollout side. With `abstract`, `train_examples` and `test_examples` are None.
    """

    config: TrainConfig
    task: Any
    train_examples: Any
    test_examples: Any
    tokenizer: Any
    learner: GRPOLearner
    policy: Policy  # What the sampler runs (a LoRA run's merged decoder).
    sampler: models.Sampler
    generator: TaskGroupGenerator
    store: ParamStore
    placement: RolloutPlacement
    source: Any = None  # The rollout source (`start`).
    rollout_pool: Any = None  # The Ray actors of `rollout.backend=ray` (`start`).
    reports: tuple[BatchReport, ...] = ()  # What the components say of a batch (`start`).

    def start(self, resume_from: dict | None = None, actor_factory=None) -> None:
        """Makes the rollout source (sync, lagged or async, by `rollout.mode`);
        `resume_from` is the source state a checkpoint recorded; `actor_factory` replaces
        the Ray actors' factory (`build.build_ray_pool`)."""
        c = self.config
        generator = self.generator
        if c.rollout.mode == "async" and c.rollout.backend == "ray":
            self.rollout_pool = generator = build.build_ray_pool(c, self.store, actor_factory)
        self.source = make_source(
            c.rollout,
            c.buffer,
            generator,
            self.store,
            PromptOrder(len(self.train_examples), seed=c.seed),
            seed=c.seed,
            resume_from=resume_from,
            partition=Partition(jax.process_index(), jax.process_count()),
        )
        self.reports = tuple(batch_reports(c, self.source, self.rollout_pool))

    def publish(self, version: int) -> None:
        """Publishes the current policy as `version` (once), a copy on the sampler's
        devices (the learner donates its own to the next step)."""
        latest = self.store.latest_version
        if latest is None or latest < version:
            self.store.publish(self.placement.to_rollout(self.policy.params()), version)

    def step(self, step: int, note=None) -> tuple[dict[str, Any], list]:
        """Publishes version `step`, takes its batch and updates; returns the metrics (with
        the per-update records under "updates") and the batch's rollouts. `note`, if given,
        is told what compiles (a run's first step compiles the sampler, then the learner)."""
        note = note or (lambda text: None)
        self.publish(step)
        started = time.monotonic()
        note(f"step {step}: compiling the sampler and making the first rollouts")
        rollouts = self.source.next_batch(step)
        waited = time.monotonic() - started
        prompt_length = self.config.generation.prompt_length
        batch = TrainBatch(**collate(rollouts, prompt_length, self.generator.overlong))
        note(f"step {step}: compiling the learner step")
        started = time.monotonic()
        metrics = self.learner.step(batch, step)
        train_seconds = time.monotonic() - started
        tokens = sum(int(r.completion_mask.sum()) for r in rollouts)
        generate = sum(r.generate_seconds for r in rollouts)
        stats = self.source.stats()
        metrics.update(
            generated_tokens=float(tokens),
            generate_tokens_per_s=tokens / generate if generate > 0 else float("nan"),
            wait_seconds=waited,
            train_seconds=train_seconds,
            train_tokens_per_s=float(np.sum(batch.loss_mask)) / max(train_seconds, 1e-9),
            buffer_depth=stats.depth,
            buffer_dropped=stats.dropped,
        )
        for report in self.reports:
            metrics.update(report(rollouts, step))
        return metrics, rollouts

    def evaluate(self, key, prefix: str = "eval/", progress=None) -> dict[str, float]:
        """Held-out evaluation of the current policy as configured (`eval_size` problems,
        `eval_samples` samples each), with keys prefixed `prefix`; `progress` is told each
        sampler call (`evaluate_policy`)."""
        c = self.config
        params = self.policy.params()
        if not self.placement.shared:  # Sample on the rollout devices (process-local).
            params = self.placement.to_rollout(params)
        scores = evaluate_policy(
            self.policy.graphdef,
            params,
            self.generator.runner,
            self.task,
            self.test_examples,
            self.tokenizer,
            EvalSettings(
                c.generation.prompt_length, c.eval_size, c.eval_samples, progress=progress
            ),
            key=key,
        )
        return {f"{prefix}{k}": v for k, v in scores.items()}

    def _template(self, versions) -> dict[str, Any]:
        """The restore target of a checkpoint holding the store's `versions`."""
        return {
            "params": self.learner.params,
            "opt_state": self.learner.opt_state,
            "history": {str(v): self.policy.like() for v in versions},
        }

    def save(self, checkpoints: CheckpointManager, next_step: int) -> None:
        """Saves what resuming at `next_step` needs (`RunState`); never from non-finite
        state."""
        like = self.policy.like()
        state = RunState(
            next_step=next_step,
            params=self.learner.params,
            opt_state=self.learner.opt_state,
            history={
                v: self.placement.to_learner(self.store.get(v), like) for v in self.store.versions()
            },
            # One state per learner process (each has its own group numbering).
            rollout_states=processes.allgather_json(self.source.state()),
            config_hash=config_io.resume_hash(self.config),
            seed=self.config.seed,
        )
        save_run_state(checkpoints, state)

    def restore(
        self, checkpoints: CheckpointManager, out_dir: Path
    ) -> tuple[int, dict | None, list[DamagedCheckpointError]]:
        """Restores params, optimizer and the store's history from the newest checkpoint
        that reads back intact; returns the next step, the rollout source's recorded state
        (for `start`) and the damaged newer checkpoints it skipped, newest first. A
        checkpoint of another config is refused (ValueError), not skipped."""
        state, skipped = restore_run_state(
            checkpoints,
            self._template,
            check=lambda metadata: _check_resumable(self.config, metadata, out_dir),
        )
        self.learner.params, self.learner.opt_state = state.params, state.opt_state
        for v, params in state.history.items():
            self.store.publish(self.placement.to_rollout(params), v)
        return state.next_step, _own_rollout_state(state.rollout_states), skipped

    def load(self, checkpoint_dir: str | os.PathLike, step: int | None = None) -> int:
        """Loads a checkpoint's params (for evaluation and export); returns its step.

        `checkpoint_dir` is a run directory, its `checkpoints/` folder or one step's folder;
        `step` picks a step (a damaged one raises `DamagedCheckpointError`); without it,
        the newest that reads back intact, each damaged newer one named on stderr."""
        path, step = _step_directory(Path(checkpoint_dir), step)
        with CheckpointManager(path, read_only=True) as checkpoints:
            if step is not None and step not in checkpoints.steps():
                raise ValueError(
                    f"no checkpoint of step {step} in {str(path)!r}; steps: {checkpoints.steps()}."
                )
            state, skipped = restore_run_state(checkpoints, self._template, step=step)
        for error in skipped:
            print(f"warning: {error}; using an older step", file=sys.stderr)
        self.learner.params = state.params
        return state.next_step

    def close(self) -> None:
        """Stops the rollout source and the Ray actors (if any)."""
        if self.source is not None:
            self.source.close()
        if self.rollout_pool is not None:
            self.rollout_pool.close()


def build_run(config: TrainConfig, *, abstract: bool = False, num_layers=None) -> Run:
    """Builds the task, model, learner, sampler and generator of a run.

    `abstract`: the same run without weights or data (params and optimizer state are
    `jax.ShapeDtypeStruct`s with their shardings; the splits are None), for `plan`;
    `num_layers`, with `abstract` only: its model with that many decoder layers."""
    if num_layers is not None and not abstract:
        raise ValueError("build_run: num_layers changes only an abstract run's model.")
    config.validate()
    build.use_compilation_cache(config)
    if not abstract:
        require_init(config)  # Before the data and the model are built.
    task = build.build_task(config)
    train_examples, test_examples = (
        (None, None) if abstract else build.data_sources(task, config.data_dir)
    )
    placement = RolloutPlacement.from_config(config.placement, config.mesh)
    mesh = placement.learner_mesh
    model, tokenizer = build.build_model(config, mesh, abstract=abstract, num_layers=num_layers)
    if not abstract:  # The abstract model has both already.
        model = build.add_lora(config, models.with_compute(model, config.compute))
    learner = build.build_learner(config, model, mesh)
    try:  # Found before any rollout is made.
        learner.check_batch_rows(config.batch_size)
    except ValueError as error:
        raise ValueError(f"rollout.groups_per_batch x generation.group_size: {error}") from None
    sampler = make_sampler(model.config, tokenizer, config.generation)
    store = ParamStore(history=store_history(config.rollout, config.buffer))
    policy = Policy(learner)
    generator = build.build_generator(
        config, policy.graphdef, sampler, task, train_examples, tokenizer, placement, store.latest
    )
    return Run(
        config,
        task,
        train_examples,
        test_examples,
        tokenizer,
        learner,
        policy,
        sampler,
        generator,
        store,
        placement,
    )


def load_checkpoint(
    config: TrainConfig, checkpoint_dir: str | os.PathLike, *, step: int | None = None
) -> tuple[Run, int]:
    """The run of `config` holding a checkpoint's params, and the checkpoint's step (see
    `Run.load` for the arguments)."""
    run = build_run(config)
    return run, run.load(checkpoint_dir, step)


def evaluation_key(seed: int, updates: int) -> jax.Array:
    """The key of the held-out evaluation of the params after `updates` updates: the run's
    own evaluations and `evaluate_checkpoint` of its checkpoints draw the same samples."""
    return jax.random.fold_in(jax.random.key(seed + 1), updates - 1)  # As runs always did.


def evaluate_checkpoint(
    config: TrainConfig, checkpoint_dir: str | os.PathLike, *, step: int | None = None,
    progress=lambda text: None,
) -> dict:  # fmt: skip
    """Held-out evaluation of a checkpoint (see `Run.load` for the arguments), with the
    draws the run's own evaluation of that step used (`evaluation_key`); `progress` is told
    each part as it starts."""
    progress("building the run (model, tokenizer, data) and loading the checkpoint")
    run, step = load_checkpoint(config, checkpoint_dir, step=step)
    progress(f"step {step}: the first sampler call compiles the sampler")
    return {**run.evaluate(evaluation_key(config.seed, step), progress=progress), "step": step}


def _check_resumable(config: TrainConfig, metadata: dict, out_dir: Path) -> None:
    if metadata.get("config_hash") == config_io.resume_hash(config):
        return
    saved = out_dir / "config.json"
    changed = []
    if saved.is_file():
        old = json.loads(saved.read_text())
        diff = config_io.config_diff(old, config)
        changed = [k for k, _, _ in diff if k.split(".")[0] not in config_io.RESUMABLE_FIELDS]
    fields = f" ({', '.join(changed)} changed)" if changed else ""
    raise ValueError(
        f"the checkpoint in {str(out_dir)!r} was written by a different config{fields}; "
        f"only {', '.join(config_io.RESUMABLE_FIELDS)} may change on resume."
    )


def _own_rollout_state(states: list | None) -> dict | None:
    """This process's rollout source state of a checkpoint's (None in checkpoints that
    predate it)."""
    if states is None:
        return None
    if len(states) != jax.process_count():
        raise ValueError(
            f"the checkpoint was written by {len(states)} learner processes; resume it with "
            f"as many, not {jax.process_count()}."
        )
    return states[jax.process_index()]


def _step_directory(path: Path, step: int | None) -> tuple[Path, int | None]:
    """(checkpoints directory, step) for a run dir, a checkpoints dir or a step dir."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", step
    if path.name.isdigit() and path.is_dir() and not (path / "checkpoints").exists():
        if step is not None and step != int(path.name):
            raise ValueError(f"--step {step} contradicts the step directory {str(path)!r}.")
        return path.parent, int(path.name)
    return path, step
