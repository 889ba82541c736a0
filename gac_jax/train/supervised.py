"""Supervised training on a task's reference completions: the warm start's trainer.

The rows are ``<bos> prompt completion <eos>`` (the prompt encoding the rollout workers
use) with the loss on the completion; training runs on the learner's step machinery
(`gac_jax.learner.SupervisedLearner`, the GRPO learner's sharded, jitted, donated step) and
reports through the RL loop's progress line and metric writer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax
from flax import nnx

from gac_jax.learner import SupervisedLearner
from gac_jax.models import CharTokenizer, ModelConfig, create_model, get_config, make_mesh
from gac_jax.tasks import Task, get_task
from gac_jax.train.metrics import MetricWriter, ProgressLine

if TYPE_CHECKING:  # The config lives with the cache that names runs by it.
    from gac_jax.train.warm_start import WarmStartConfig

__all__ = ["encode_sft_batch", "train_sft"]


class _NoWriter:
    def write(self, step, metrics) -> None:
        del step, metrics


def _writer(metrics_dir):
    if metrics_dir is None:
        return contextlib.nullcontext(_NoWriter())
    return MetricWriter(metrics_dir)


def encode_sft_batch(
    tokenizer, prompts: Sequence[str], completions: Sequence[str], length: int
) -> dict[str, np.ndarray]:
    """Right-padded ``<bos> prompt completion <eos>`` rows and their masks.

    Args:
      tokenizer: a `gac_jax.models.Tokenizer` with a BOS id.
      prompts: B prompt texts.
      completions: B completion texts.
      length: T, the padded length.

    Returns:
      ``{"tokens": int32 [B, T], "mask": bool [B, T] (real tokens),
      "loss_mask": bool [B, T] (the completion and its EOS)}``.

    Raises:
      ValueError: if a row is longer than `length`.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    batch = len(prompts)
    tokens = np.full((batch, length), tokenizer.pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    loss_mask = np.zeros((batch, length), bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
        completion_ids = tokenizer.encode(completion, add_eos=True)
        n = len(prompt_ids) + len(completion_ids)
        if n > length:
            raise ValueError(
                f"Row {row} has {n} tokens, more than length={length}: "
                f"{prompt!r} + {completion!r}. Raise WarmStartConfig.max_length."
            )
        tokens[row, :n] = prompt_ids + completion_ids
        mask[row, :n] = True
        loss_mask[row, len(prompt_ids) : n] = True
    return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


def _task_texts(task: Task, examples, count: int = 0):
    count = len(examples) if count == 0 else min(count, len(examples))
    rows = [examples[i] for i in range(count)]
    return rows, [task.prompt(ex) for ex in rows], [task.reference_completion(ex) for ex in rows]


@functools.lru_cache(maxsize=8)
def _optimizer(config: WarmStartConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps - 1),
        decay_steps=config.steps,
        end_value=0.1 * config.learning_rate,
    )
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


def _model_config(config: WarmStartConfig, tokenizer: CharTokenizer) -> ModelConfig:
    model_config = get_config(config.model, dtype="float32")
    if model_config.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"Model preset {config.model!r} has vocab_size={model_config.vocab_size}, fewer "
            f"than the character tokenizer's {tokenizer.vocab_size} ids."
        )
    return model_config.replace(
        bos_token_id=tokenizer.bos_id,
        eos_token_ids=(tokenizer.eos_id,),
        pad_token_id=tokenizer.pad_id,
    )


def train_sft(
    config: WarmStartConfig,
    *,
    data_dir: str | os.PathLike | None = None,
    progress: bool = False,
    metrics_dir: str | os.PathLike | None = None,
):
    """Supervised training on the task's reference completions (no evaluation, no save).

    Deterministic for a config on a given machine: the initialisation and the batch
    order derive from `config.seed`.

    Args:
      config: what to train.
      data_dir: tfds data directory of the task (tfds's default if None).
      progress: show the run's progress line (the RL loop's) with the training loss.
      metrics_dir: if given, every step's loss and gradient norm are written there with
        the RL loop's `MetricWriter` (JSON lines and TensorBoard).

    Returns:
      `(model, tokenizer, metrics)`: the trained `Decoder`, its `CharTokenizer`, and
      training statistics (losses, parameter count, timings).
    """
    started = time.perf_counter()
    task = get_task(config.task)
    tokenizer = CharTokenizer()
    model_config = _model_config(config, tokenizer)

    train = task.data_source("train", data_dir=data_dir)
    _, prompts, completions = _task_texts(task, train, config.train_examples)
    data = encode_sft_batch(tokenizer, prompts, completions, config.max_length)
    num_train = len(prompts)
    rng = np.random.default_rng(config.seed)

    model = create_model(model_config, seed=config.seed)
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    learner = SupervisedLearner(model, _optimizer(config), make_mesh(1, 1, 1))
    data_seconds = time.perf_counter() - started

    losses = []
    order = np.empty(0, np.int64)
    train_started = time.perf_counter()
    line = ProgressLine(config.steps, quiet=not progress, fields=(("loss", ("loss",)),))
    with line, _writer(metrics_dir) as writer:
        for step in range(config.steps):
            # Epochs of fresh permutations, so every example is seen once per epoch.
            if len(order) < config.batch_size:
                order = np.concatenate([order, rng.permutation(num_train)])
            rows, order = order[: config.batch_size], order[config.batch_size :]
            metrics = learner.step({name: array[rows] for name, array in data.items()})
            losses.append(metrics["loss"])
            writer.write(step, metrics)
            line.update(step + 1, metrics)
    losses = np.asarray(losses, np.float64)
    train_seconds = time.perf_counter() - train_started
    model = learner.model()

    tokens_trained = float(data["mask"].sum(axis=1).mean()) * config.batch_size * config.steps
    metrics = {
        "first_train_loss": float(losses[0]),
        "final_train_loss": float(losses[-min(50, len(losses)) :].mean()),
        "num_params": int(num_params),
        "train_examples": num_train,
        "epochs": config.steps * config.batch_size / num_train,
        "data_seconds": data_seconds,
        "train_seconds": train_seconds,
        "train_tokens_per_second": tokens_trained / train_seconds,
    }
    return model, tokenizer, metrics
