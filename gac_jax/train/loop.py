"""The GRPO training loop: sync, lagged-k or async rollouts into the sharded learner.

`train(config, out_dir)` builds everything from a `TrainConfig`, then per step: publish
the params as version `step`, take the step's batch from the rollout source, update,
write the metrics (JSON lines + TensorBoard), evaluate every `eval_every` steps and
checkpoint every `checkpoint_every` steps. `resume=True` continues from the newest
checkpoint in `out_dir/checkpoints`; lagged mode then reproduces an uninterrupted run
exactly (the ParamStore's history is part of the checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from gac_jax import models
from gac_jax.learner import GRPOLearner, TrainBatch, make_optimizer
from gac_jax.models.lora import Policy
from gac_jax.rollout import (
    ParamStore,
    PromptOrder,
    TaskGroupGenerator,
    collate,
    make_sampler,
    store_history,
)
from gac_jax.rollout import make_source as make_rollout_source
from gac_jax.rollout.placement import RolloutPlacement, rollout_mesh, split_devices
from gac_jax.tasks import get_task
from gac_jax.tasks.chat import with_chat_template, with_system_prompt
from gac_jax.tasks.custom import GuardedReward, resolve_reward
from gac_jax.train import config_io, processes
from gac_jax.train.checkpoint import CheckpointManager
from gac_jax.train.config import TrainConfig, require_init, run_chat_template
from gac_jax.train.evaluation import evaluate_policy
from gac_jax.train.interrupt import RunInterrupted, StopSignals
from gac_jax.train.run_checkpoint import restore_run, save_run

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """Everything `train` builds from a config (also handy in notebooks and tests)."""

    config: TrainConfig
    task: Any
    train_examples: Any
    test_examples: Any
    tokenizer: Any
    learner: GRPOLearner
    sampler: models.Sampler
    generator: TaskGroupGenerator
    store: ParamStore
    placement: RolloutPlacement
    rollout_pool: Any = None  # The Ray actors of `rollout.backend=ray` (`make_source`).
    policy: Policy | None = None  # What the sampler runs (a LoRA run's merged decoder).


def resolve_mesh(config: TrainConfig) -> jax.sharding.Mesh:
    """The learner's mesh of `config.mesh`: every device but the rollout devices."""
    learner_devices, _ = split_devices(config.rollout.devices)
    return config.mesh.make(learner_devices)


def resolve_placement(config: TrainConfig, learner_mesh) -> RolloutPlacement:
    """Where this process samples: its rollout devices (split layout) or the learner's."""
    _, devices = split_devices(config.rollout.devices)
    mesh = rollout_mesh(devices, config.rollout.tensor_parallel) if devices else None
    return RolloutPlacement(learner_mesh, mesh)


def build_model(config: TrainConfig, mesh):
    """(model, tokenizer) for `config.init`: a warm start of the task and model (the
    shipped one for countdown on `tiny`), random weights, or an HF checkpoint dir (these
    two built with `config.compute`'s settings at once, so no copy is cast)."""
    if config.init == "warm_start":
        from gac_jax.train.warm_start import WarmStartConfig, ensure_warm_start, load_warm_start

        # The shipped checkpoint serves countdown/n3_max20 on `tiny`; any other task or model
        # gets its own supervised warm start, trained once and cached.
        directory = ensure_warm_start(
            WarmStartConfig(task=config.task, model=config.model, steps=config.warm_start_steps),
            data_dir=config.data_dir,
        )
        model, tokenizer, _ = load_warm_start(directory, mesh=mesh)
        return model, tokenizer
    overrides = config.compute.overrides()
    if config.init == "random":
        model_config = models.get_config(config.model, **overrides)
        model = models.create_sharded(
            lambda: models.create_model(model_config, seed=config.seed), mesh
        )
        return model, models.CharTokenizer()
    require_init(config)  # A preset's checkpoint not downloaded yet.
    path = Path(config.init)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"init={config.init!r} is neither 'warm_start', 'random' nor a Hugging Face "
            "checkpoint directory (with config.json)."
        )
    model = models.load_hf_checkpoint(path, mesh=mesh, **overrides)
    return model, models.HFTokenizer.from_directory(path)


def build_learner(config: TrainConfig, model, mesh) -> GRPOLearner:
    """The sharded learner of `config`: its optax chain, objective and settings (with
    `config.lora.rank`, LoRA adapters train and the model is frozen)."""
    tx = make_optimizer(config.optimizer, config.gac, config.ess, steps=config.optimizer_steps)
    model = models.apply_lora(model, config.lora, rngs=nnx.Rngs(params=config.seed))
    trainable = models.lora_filter if config.lora.rank else None
    return GRPOLearner(
        model, tx, mesh, loss=config.loss, config=config.learner, trainable=trainable
    )


def build_task(config: TrainConfig):
    """The run's task: `config.task` with `config.reward` (if set) as its reward, guarded
    (a call that raises counts as 0 and is logged once per run), and its prompts in the
    chat template of the `init` model directory (`config.chat_template`)."""
    task = get_task(config.task)
    if config.reward is not None:
        reward = GuardedReward(resolve_reward(config.reward), config.reward)
        task = dataclasses.replace(task, reward=reward)
    template = run_chat_template(config)
    if template is not None:
        thinking = (
            {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}
        )
        # The generator adds the tokenizer's BOS id itself, so the template's text goes.
        task = with_chat_template(
            task, template, system=config.system_prompt, strip_bos=True, **thinking
        )
    elif config.system_prompt is not None:
        task = with_system_prompt(task, config.system_prompt)
    return task


def build_run(config: TrainConfig) -> Run:
    """Builds the task, model, learner, sampler and generator of a run."""
    config.validate()
    require_init(config)  # Before the data and the model are built.
    task = build_task(config)
    train_examples, test_examples = _data_sources(task, config.data_dir)
    mesh = resolve_mesh(config)
    model, tokenizer = build_model(config, mesh)
    model = models.with_compute(model, config.compute)  # The warm start's dtypes, too.
    learner = build_learner(config, model, mesh)
    sampler = make_sampler(model.config, tokenizer, config.generation)
    placement = resolve_placement(config, mesh)
    store = ParamStore(history=store_history(config.rollout, config.buffer))
    inflight = config.rollout.inflight_updates
    policy = Policy(learner)
    generator = TaskGroupGenerator(
        policy.graphdef,
        sampler,
        task,
        train_examples,
        tokenizer,
        config.generation,
        placement=placement,
        latest_params=store.latest if inflight else None,
        chunk_steps=config.rollout.inflight_chunk_steps,
    )
    return Run(
        config,
        task,
        train_examples,
        test_examples,
        tokenizer,
        learner,
        sampler,
        generator,
        store,
        placement,
        policy=policy,
    )


def _data_sources(task, data_dir):
    """The task's train and test splits. With several processes, process 0 prepares them
    first (tfds builds a dataset once per directory) and the others then read them."""

    def load():
        return (
            task.data_source("train", data_dir=data_dir),
            task.data_source("test", data_dir=data_dir),
        )

    if processes.is_primary():
        sources = load()
        processes.barrier("gac_jax.train: data prepared")
        return sources
    processes.barrier("gac_jax.train: data prepared")
    return load()


def make_source(run: Run, resume_from: dict | None = None):
    """The run's rollout source (sync, lagged or async, by `config.rollout.mode`);
    `resume_from` is the `state()` a checkpoint recorded."""
    c = run.config
    prompts = PromptOrder(len(run.train_examples), seed=c.seed)
    generator = run.generator
    if c.rollout.mode == "async" and c.rollout.backend == "ray":
        from gac_jax.train.ray_backend import make_pool

        run.rollout_pool = generator = make_pool(c)
    return make_rollout_source(
        c.rollout,
        c.buffer,
        generator,
        run.store,
        prompts,
        seed=c.seed,
        resume_from=resume_from,
        process_index=jax.process_index(),
        num_processes=jax.process_count(),
    )


def _rollout_metrics(rollouts, seconds: float) -> dict[str, float]:
    tokens = sum(int(r.completion_mask.sum()) for r in rollouts)
    generate = sum(r.generate_seconds for r in rollouts)
    return {
        "generated_tokens": float(tokens),
        "generate_tokens_per_s": tokens / generate if generate > 0 else float("nan"),
        "wait_seconds": seconds,
    }


class RunExistsError(ValueError):
    """`train` without `resume` or `overwrite` into a directory that holds a run."""


RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "config.json", "plot.png")


def _prepare_directory(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuses to train over a run unless resuming it or told to overwrite it."""
    present = [name for name in RUN_FILES if (out_dir / name).exists()]
    if not present or resume:
        return
    if not overwrite:
        raise RunExistsError(
            f"{str(out_dir)!r} already holds a run ({', '.join(present)}): resume it "
            "(`--resume`), overwrite it (`--overwrite`) or choose another directory."
        )
    for name in present:
        path = out_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _train_step(run: Run, source, step: int, eval_key) -> tuple[dict[str, float], list]:
    """Publishes version `step`, takes its batch, updates, evaluates when due; returns the
    metrics and the batch's rollouts."""
    config, learner, store = run.config, run.learner, run.store
    initial = {}
    if step == 0 and config.eval_at_start:
        scores = evaluate_run(run, jax.random.key(config.seed + 3))  # Its own key.
        initial = {f"eval_start/{k.removeprefix('eval/')}": v for k, v in scores.items()}
    if store.latest_version is None or store.latest_version < step:
        # A copy on the sampler's devices (the learner donates its own to the next step).
        store.publish(run.placement.to_rollout(run.policy.params()), step)
    started = time.monotonic()
    rollouts = source.next_batch(step)
    waited = time.monotonic() - started
    batch = TrainBatch(**collate(rollouts, config.generation.prompt_length))
    started = time.monotonic()
    metrics = learner.step(batch, step)
    train_seconds = time.monotonic() - started
    metrics.update(_rollout_metrics(rollouts, waited))
    trained_tokens = float(np.sum(batch.loss_mask))
    metrics["train_tokens_per_s"] = trained_tokens / max(train_seconds, 1e-9)
    stats = source.stats()
    metrics.update(buffer_depth=stats.depth, buffer_dropped=stats.dropped)
    if run.rollout_pool is not None:
        metrics["rollout_actor_replacements"] = run.rollout_pool.replacements
    if config.eval_every and (step + 1) % config.eval_every == 0:
        metrics.update(evaluate_run(run, jax.random.fold_in(eval_key, step)))
    return {**initial, **metrics}, rollouts


def train(
    config: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> Path:
    """Runs the training described by `config`, writing everything under `out_dir`.

    Writes `metrics.jsonl`, `tensorboard/`, `checkpoints/`, `config.json` and, at the end,
    `plot.png`. A directory that holds a run is refused unless `resume` (continue from its
    newest checkpoint) or `overwrite` (delete it first). SIGINT or SIGTERM finish the
    current step, checkpoint it and raise `RunInterrupted`. Returns `out_dir`.

    Under `jax.distributed` every process calls `train` with the same config and
    `out_dir` (shared storage): each makes its share of every batch, process 0 writes the
    files that are not checkpoints, and all of them write their checkpoint shards.
    """
    from gac_jax.train.metrics import NullMetricWriter, ProgressLine, run_writer
    from gac_jax.train.plots import plot_run
    from gac_jax.train.samples import sample_logger

    out_dir = Path(out_dir)
    primary = processes.is_primary()
    if primary:
        _prepare_directory(out_dir, resume=resume, overwrite=overwrite)
        out_dir.mkdir(parents=True, exist_ok=True)
    processes.barrier("gac_jax.train: run directory ready")
    checkpoints = CheckpointManager(out_dir / "checkpoints", max_to_keep=config.keep_checkpoints)
    run = build_run(config)
    start_step, rollout_state = 0, None
    if resume and checkpoints.latest_step() is not None:
        start_step, rollout_state = restore_run(run, checkpoints, out_dir)
    elif resume:
        logger.info("no checkpoint in %s: starting from step 0", out_dir / "checkpoints")
    # Written once the run is known to be this config's (a refused resume leaves it alone).
    if primary:
        config_json = json.dumps(config_io.config_to_dict(run.config), indent=2)
        (out_dir / "config.json").write_text(config_json)
    writer = run_writer(config, out_dir, start_step=start_step) if primary else NullMetricWriter()
    samples = sample_logger(config, out_dir, writer, run.tokenizer, start_step, primary)
    source = make_source(run, rollout_state)
    eval_key = jax.random.key(config.seed + 1)
    progress = ProgressLine(total=config.steps, quiet=not primary)
    try:
        with StopSignals() as stop, writer, samples:
            for step in range(start_step, config.steps):
                metrics, rollouts = _train_step(run, source, step, eval_key)
                # One record per optimizer step (`learner.mini_batches` x `learner.epochs`).
                for record in [*metrics.pop("updates", [])[:-1], metrics]:
                    writer.write(step, record)
                samples.write(step, rollouts)
                progress.update(step + 1, metrics)
                last = step + 1 == config.steps
                due = (step + 1) % config.checkpoint_every == 0 if config.checkpoint_every else 0
                if (config.checkpoint_every and (due or last)) or _stop_requested(stop):
                    save_run(run, checkpoints, step + 1, source)
                if _stop_requested(stop) and step + 1 < config.steps:
                    raise RunInterrupted(out_dir, step + 1, stop.signum or 0)
    finally:
        source.close()
        if run.rollout_pool is not None:
            run.rollout_pool.close()
        checkpoints.close()
        progress.close()
    if primary:
        plot_run(out_dir / "metrics.jsonl", out_dir / "plot.png")
    return out_dir


def _stop_requested(stop: StopSignals) -> bool:
    """Whether any process was signalled: all of them then checkpoint and stop together
    (a step's collectives need every process)."""
    if jax.process_count() == 1:
        return stop.signum is not None
    return any(processes.allgather_json(stop.signum is not None))


def evaluate_run(run: Run, key) -> dict[str, float]:
    """Held-out evaluation of the run's current policy as configured (`eval_size` problems,
    `eval_samples` samples each), with keys prefixed ``eval/``."""
    c = run.config
    params = run.policy.params()
    if not run.placement.shared:  # Sample on the rollout devices (process-local).
        params = run.placement.to_rollout(params)
    scores = evaluate_policy(
        run.policy.graphdef,
        params,
        run.sampler,
        run.task,
        run.test_examples,
        run.tokenizer,
        prompt_length=c.generation.prompt_length,
        num_problems=c.eval_size,
        num_samples=c.eval_samples,
        key=key,
        stop=c.generation.stop,
    )
    return {f"eval/{k}": v for k, v in scores.items()}


def _step_directory(path: Path, step: int | None) -> tuple[Path, int | None]:
    """(checkpoints directory, step) for a run dir, a checkpoints dir or a step dir."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", step
    if path.name.isdigit() and path.is_dir() and not (path / "checkpoints").exists():
        if step is not None and step != int(path.name):
            raise ValueError(f"--step {step} contradicts the step directory {str(path)!r}.")
        return path.parent, int(path.name)
    return path, step


def load_checkpoint(
    config: TrainConfig, checkpoint_dir: str | os.PathLike, *, step: int | None = None
) -> tuple[Run, int]:
    """The run of `config` holding a checkpoint's params, and the checkpoint's step.

    `checkpoint_dir` is a run directory, its `checkpoints/` folder or one step's folder;
    `step` picks a step (the newest if None)."""
    path, step = _step_directory(Path(checkpoint_dir), step)
    run = build_run(config)
    with CheckpointManager(path, read_only=True) as checkpoints:
        if step is not None and step not in checkpoints.steps():
            raise ValueError(
                f"no checkpoint of step {step} in {str(path)!r}; steps: {checkpoints.steps()}."
            )
        versions = checkpoints.read_metadata(step)["store_versions"]
        restored = checkpoints.restore(
            step,
            target={
                "params": run.learner.params,
                "opt_state": run.learner.opt_state,
                "history": {str(v): run.policy.like() for v in versions},
            },
        )
    run.learner.params = restored.state["params"]
    return run, restored.step


def evaluate_checkpoint(
    config: TrainConfig, checkpoint_dir: str | os.PathLike, *, step: int | None = None
) -> dict:
    """Held-out evaluation of a checkpoint (see `load_checkpoint` for the arguments)."""
    run, step = load_checkpoint(config, checkpoint_dir, step=step)
    scores = evaluate_run(run, jax.random.key(config.seed + 2))
    scores["step"] = step
    return scores
