r"""The supervised warm start of a tiny policy: training on reference solutions, pass@k.

Reinforcement learning from a randomly initialised character model gets no reward to
learn from. `warm_start` first fits the model to the task's reference completions
(`train_sft`: teacher forcing, loss on the completion tokens only), just long enough that
it solves some problems, then measures it on the test split with the RL loop's own
evaluation (`gac_jax.rollout.evaluation.evaluate_policy`), so RL runs compare against the
same figures:

* pass@1: the unbiased estimator from n samples at temperature 1 (the mean reward);
* pass@k: the unbiased estimator :math:`1 - \binom{n-c}{k} / \binom{n}{k}` (Chen et al.,
  2021, arXiv 2107.03374, eq. 1) with c correct out of n samples, averaged over problems;
* greedy accuracy: one greedy completion per problem.

`train_sft` runs on the learner's step machinery (`gac_jax.learner.SupervisedLearner`)
and reads only its `SFTConfig`, which `WarmStartConfig` extends with the evaluation's
settings. The result is an orbax checkpoint whose metadata holds the config, its hash, the
model config, the tokenizer and the metrics. The default config's checkpoint ships with
the package (`SHIPPED_WARM_START_DIR`)::

    model, tokenizer, metadata = load_warm_start()        # the shipped checkpoint
    metadata["metrics"]["pass@1"]

A sequence is ``<bos> prompt completion <eos>``, the same prompt encoding the rollout
workers use (`tokenizer.encode(prompt, add_bos=True)`).

Over 450 lines because it is the warm start end to end (its configs, the supervised
trainer, the evaluation, the checkpoint and its cache), one story read top to bottom, and
its parts serve nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from gac_jax._locks import exclusive_lock
from gac_jax._validation import check_int
from gac_jax.learner import OptimizerConfig, SupervisedLearner, make_optimizer
from gac_jax.learner.supervised import masked_nll, sft_loss
from gac_jax.models import (
    CharTokenizer,
    ModelConfig,
    RopeScaling,
    ShardingRules,
    create_model,
    get_config,
    make_mesh,
    state_shardings,
)
from gac_jax.models.decoder import unstack_layers
from gac_jax.rollout.answers import AnswerRunner
from gac_jax.rollout.episodes import EpisodeConfig, EpisodeRunner
from gac_jax.rollout.evaluation import EvalSettings, evaluate_policy
from gac_jax.rollout.generation import GenerationConfig, make_sampler
from gac_jax.tasks import Task, get_task
from gac_jax.train.checkpoint import (
    CheckpointManager,
    abstract_tree,
    load_model_params,
    model_params,
    read_metadata,
)
from gac_jax.train.config_io import config_hash, config_to_dict
from gac_jax.train.metrics import MetricWriter, NullMetricWriter, ProgressLine

__all__ = [
    "SHIPPED_WARM_START_DIR",
    "SFTConfig",
    "WarmStartConfig",
    "config_hash",
    "encode_sft_batch",
    "ensure_warm_start",
    "evaluate_warm_start",
    "load_warm_start",
    "masked_nll",
    "sft_loss",
    "train_sft",
    "warm_start",
    "weights_digest",
]

#: The shipped warm starts, one directory each, found by their config hash.
SHIPPED_WARM_STARTS = Path(__file__).resolve().parent.parent / "assets" / "warm_start"
#: The checkpoint of `WarmStartConfig()` (the demo's), shipped as package data.
SHIPPED_WARM_START_DIR = SHIPPED_WARM_STARTS / "countdown_n3_max20_tiny"

_METADATA_KIND = "gac_jax.warm_start"


def _check_ints(config, positive: Sequence[str], non_negative: Sequence[str]) -> None:
    """Raises ValueError unless the fields `positive` of `config` are ints >= 1 and the
    fields `non_negative` ints >= 0."""
    for names, low in ((positive, 1), (non_negative, 0)):
        for name in names:
            check_int(f"{type(config).__name__}.{name}", getattr(config, name), low)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised training on a task's reference completions (`train_sft`).

    Attributes:
      task: a `gac_jax.tasks` name; its train split is the supervised data.
      model: a `gac_jax.models` preset (float32 compute; its vocabulary must hold the
        character tokenizer's).
      steps: optimizer steps.
      batch_size: sequences per step.
      learning_rate: AdamW peak learning rate (linear warm-up, cosine decay to 10%).
      warmup_steps: linear warm-up steps.
      weight_decay: AdamW decoupled weight decay.
      clip_norm: global gradient-norm clip.
      train_examples: train on the first this many examples of the train split; 0 for all.
      max_length: every sequence is padded to this many tokens (one compilation).
      seed: model initialisation and batch order.
    """

    task: str = "countdown/n3_max20"
    model: str = "tiny"
    steps: int = 800
    batch_size: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    train_examples: int = 0
    max_length: int = 40
    seed: int = 0

    def __post_init__(self):
        non_negative = ("warmup_steps", "train_examples", "seed")
        _check_ints(self, ("steps", "batch_size", "max_length"), non_negative)
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate!r} must be positive.")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0.")
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm={self.clip_norm!r} must be positive.")


@dataclasses.dataclass(frozen=True)
class WarmStartConfig(SFTConfig):
    """Supervised warm start (`SFTConfig`'s fields) and its evaluation. The defaults make
    the shipped checkpoint, named by the hash of these fields: do not rename or reorder them.

    Attributes:
      seed: as `SFTConfig`'s, and the evaluation samples.
      eval_problems: test problems evaluated (the first ones of the split); 0 for all.
      eval_samples: n samples per problem at temperature 1 (pass@1 and pass@n).
      eval_batch_size: rows per sampler call (a divisor of the sampled rows and at least
        the problems keeps the sampler to one compilation).
      prompt_length: evaluation prompts are left-padded to this many tokens.
      max_new_tokens: longest sampled completion.
    """

    eval_problems: int = 0
    eval_samples: int = 8
    eval_batch_size: int = 500
    prompt_length: int = 32
    max_new_tokens: int = 16

    def __post_init__(self):
        super().__post_init__()
        positive = ("eval_samples", "eval_batch_size", "prompt_length", "max_new_tokens")
        _check_ints(self, positive, ("eval_problems",))


# ------------------------------------------------------------------- supervised training


def encode_sft_batch(
    tokenizer, prompts: Sequence[str], completions: Sequence, length: int
) -> dict[str, np.ndarray]:
    """Right-padded ``<bos> prompt completion <eos>`` rows and their masks.

    `completions` are B texts, or B multi-turn transcripts of ``(role, text)`` turns
    (`Task.reference_turns`): each turn encoded on its own, as the sampler lays an episode
    out, only the "policy" turns (and the EOS) trained on. Returns ``{"tokens": int32
    [B, T], "mask": bool [B, T] (real tokens), "loss_mask": bool [B, T]}`` with T = `length`;
    ValueError if a row is longer.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
    batch = len(prompts)
    tokens = np.full((batch, length), tokenizer.pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    loss_mask = np.zeros((batch, length), bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
        turns = [("policy", completion)] if isinstance(completion, str) else list(completion)
        completion_ids, trained = [], []
        for role, text in turns:
            ids = tokenizer.encode(text)
            completion_ids += ids
            trained += [role == "policy"] * len(ids)
        completion_ids.append(tokenizer.eos_id)
        trained.append(True)
        n = len(prompt_ids) + len(completion_ids)
        if n > length:
            raise ValueError(
                f"Row {row} has {n} tokens, more than length={length}: "
                f"{prompt!r} + {completion!r}. Raise the config's max_length."
            )
        tokens[row, :n] = prompt_ids + completion_ids
        mask[row, :n] = True
        loss_mask[row, len(prompt_ids) : n] = trained
    return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


def _task_texts(task: Task, examples, count: int = 0):
    """The prompts and reference completions (the worked transcripts' turns for a
    multi-turn task) of the first `count` examples (0: all)."""
    rows = [examples[i] for i in range(min(count or len(examples), len(examples)))]
    reference = task.reference_turns or task.reference_completion
    return [task.prompt(ex) for ex in rows], [reference(ex) for ex in rows]


@functools.lru_cache(maxsize=8)
def _optimizer(config: SFTConfig) -> optax.GradientTransformation:
    """The run's chain (`make_optimizer`: clip, AdamW under GAC's monitor), warm-up and
    cosine decay to 10% of the peak rate."""
    return make_optimizer(
        OptimizerConfig(
            learning_rate=config.learning_rate,
            weight_decay=config.weight_decay,
            clip_norm=config.clip_norm,
            schedule="warmup_cosine",
            warmup_steps=min(config.warmup_steps, config.steps - 1),
            decay_steps=config.steps,
            end_lr_ratio=0.1,
        )
    )


def _model_config(config: SFTConfig, tokenizer: CharTokenizer) -> ModelConfig:
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
    config: SFTConfig,
    *,
    data_dir: str | os.PathLike | None = None,
    progress: bool = False,
    metrics_dir: str | os.PathLike | None = None,
):
    """Supervised training on the task's reference completions (no evaluation, no save),
    deterministic for a config on a given machine (seeded by `config.seed`).

    `progress` shows the RL loop's progress line; `metrics_dir`, if given, receives every
    step's loss and gradient norm (`MetricWriter`). Returns `(model, tokenizer, metrics)`:
    the trained `Decoder`, its `CharTokenizer`, training statistics (losses, timings).
    """
    started = time.perf_counter()
    task = get_task(config.task)
    tokenizer = CharTokenizer()
    model_config = _model_config(config, tokenizer)

    train = task.data_source("train", data_dir=data_dir)
    prompts, completions = _task_texts(task, train, config.train_examples)
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
    writer = NullMetricWriter() if metrics_dir is None else MetricWriter(metrics_dir)
    with line, writer:
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


# ------------------------------------------------------------------------ evaluation


def evaluate_warm_start(
    model, tokenizer, config: WarmStartConfig, *, data_dir: str | os.PathLike | None = None
) -> dict[str, float]:
    """pass@1, pass@n (n = `config.eval_samples`) and greedy accuracy of `model` on the
    test split, by the RL loop's own evaluation (`evaluate_policy`), with ``eval_problems``
    and ``eval_samples``."""
    task = get_task(config.task)
    examples = task.data_source("test", data_dir=data_dir)
    num_problems = min(config.eval_problems or len(examples), len(examples))
    # The sampler a run builds (`make_sampler`), so the figures compare with a run's.
    generation = GenerationConfig(
        prompt_length=config.prompt_length, max_new_tokens=config.max_new_tokens
    )
    sampler = make_sampler(model.config, tokenizer, generation)
    graphdef, state = nnx.split(model)
    if task.environment is None:  # One answer a sample.
        runner = AnswerRunner(sampler, tokenizer, task.reward)
    else:  # Multi-turn: episodes with the task's environment.
        runner = EpisodeRunner(sampler, tokenizer, task.environment(), EpisodeConfig())
    settings = EvalSettings(
        config.prompt_length, num_problems, config.eval_samples, config.eval_batch_size
    )
    key = jax.random.key(config.seed + 1)
    metrics = evaluate_policy(graphdef, state, runner, task, examples, tokenizer, settings, key=key)
    return {**metrics, "eval_problems": num_problems, "eval_samples": config.eval_samples}


# --------------------------------------------------------------------------- warm start


def _versions() -> dict[str, str]:
    import flax
    import orbax.checkpoint as ocp

    modules = {"jax": jax, "flax": flax, "optax": optax, "orbax-checkpoint": ocp}
    return {name: module.__version__ for name, module in modules.items()}


def warm_start(
    config: WarmStartConfig,
    out_dir: str | os.PathLike,
    *,
    data_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Trains the warm start (`train_sft`), evaluates it (`evaluate_warm_start`) and saves
    it in `out_dir` as step `config.steps` (which must not exist there yet), with its config
    and metrics as metadata. Returns the metrics, with timings ("total_seconds": data,
    training and evaluation), "checkpoint_dir" and "checkpoint_bytes".
    """
    started = time.perf_counter()
    model, tokenizer, metrics = train_sft(
        config, data_dir=data_dir, progress=progress, metrics_dir=Path(out_dir) / "sft_metrics"
    )
    eval_started = time.perf_counter()
    metrics.update(evaluate_warm_start(model, tokenizer, config, data_dir=data_dir))
    metrics["eval_seconds"] = time.perf_counter() - eval_started
    metrics["total_seconds"] = time.perf_counter() - started

    metadata = {
        "kind": _METADATA_KIND,
        "config": config_to_dict(config),
        "config_hash": config_hash(config),
        "model_config": dataclasses.asdict(model.config),
        "tokenizer": {"kind": "char", "characters": tokenizer.characters},
        "prompt_format": {"add_bos": True, "sequence": "<bos> prompt completion <eos>"},
        "metrics": metrics,
        "versions": _versions(),
    }
    with CheckpointManager(out_dir, max_to_keep=1) as checkpoints:
        checkpoints.save(config.steps, model_params(model), metadata)
        step_dir = checkpoints.directory / str(config.steps)
    metrics["checkpoint_dir"] = str(step_dir.parent)
    metrics["checkpoint_bytes"] = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    return metrics


# --------------------------------------------------------------------------- loading


def _model_config_from_dict(fields: Mapping[str, Any]) -> ModelConfig:
    fields = {"scan_layers": False, **fields}  # Saved before the field: tiny, unrolled.
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    return ModelConfig(**fields)


def load_warm_start(
    directory: str | os.PathLike | None = None,
    *,
    step: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules | None = None,
):
    """`(model, tokenizer, metadata)` of a warm-start checkpoint written by `warm_start`
    (the shipped one by default; the latest `step` by default).

    With a `mesh`, every parameter is restored directly onto its `NamedSharding` (from the
    model's logical axes and `rules`, `ShardingRules()` by default), else onto the first
    local device. FileNotFoundError if there is no checkpoint, ValueError if it is not a
    warm start.
    """
    directory = SHIPPED_WARM_START_DIR if directory is None else Path(directory)
    rules = ShardingRules() if rules is None else rules
    with CheckpointManager(directory, read_only=True) as checkpoints:
        metadata = checkpoints.read_metadata(step)
        if metadata.get("kind") != _METADATA_KIND:
            raise ValueError(
                f"{str(directory)!r} holds no warm start (metadata kind "
                f"{metadata.get('kind')!r}, expected {_METADATA_KIND!r})."
            )
        model_config = _model_config_from_dict(metadata["model_config"])
        # Restore into an abstract model: no random initialisation to throw away.
        abstract = nnx.eval_shape(lambda: create_model(model_config, rules=rules))
        shardings = None
        if mesh is not None:
            shardings = nnx.to_pure_dict(
                state_shardings(nnx.state(abstract, nnx.Param), mesh, rules)
            )
        target = abstract_tree(model_params(abstract), shardings)
        restored = checkpoints.restore(step, target=target)
    model = load_model_params(abstract, restored.state)
    tokenizer_info = metadata["tokenizer"]
    if tokenizer_info.get("kind") != "char":
        raise ValueError(f"Unknown tokenizer kind {tokenizer_info.get('kind')!r}.")
    return model, CharTokenizer(tokenizer_info["characters"]), metadata


def weights_digest(directory: str | os.PathLike | None = None, step: int | None = None) -> str:
    """A SHA-256 of a warm start's parameters (each one's path, dtype, shape and bytes, in
    path order): two runs started from weights with the same digest started from the same
    policy, on whatever machine. `directory` and `step` as `load_warm_start`. Of the layers
    one by one, as they were saved before the decoder's scan: the digests stay those runs
    recorded."""
    model, _, _ = load_warm_start(directory, step=step)
    flat = jax.tree_util.tree_flatten_with_path(unstack_layers(model_params(model)))
    digest = hashlib.sha256()
    for path, leaf in sorted(flat[0], key=lambda item: jax.tree_util.keystr(item[0])):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """`$GAC_JAX_CACHE/warm_start`, or `~/.cache/gac_jax/warm_start`."""
    root = os.environ.get("GAC_JAX_CACHE") or Path.home() / ".cache" / "gac_jax"
    return Path(root) / "warm_start"


def ensure_warm_start(
    config: WarmStartConfig | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
) -> Path:
    """The checkpoint directory of `config`'s warm start, training it if needed.

    A shipped checkpoint (`SHIPPED_WARM_STARTS`) serves its own config, so every machine
    starts from the same weights (float reductions differ between CPUs); any other config
    (`WarmStartConfig()` by default) is trained once and cached under
    `cache_dir / config_hash(config)` (`default_cache_dir()` by default). Processes asking
    at once train it once: the first holds a lock while it trains, the others then load it.
    """
    config = WarmStartConfig() if config is None else config
    digest = config_hash(config)
    for shipped in sorted(SHIPPED_WARM_STARTS.iterdir()):
        if _holds(shipped, digest):
            return shipped
    cached = Path(cache_dir or default_cache_dir()) / digest
    if _holds(cached, digest):
        return cached
    with exclusive_lock(cached.parent / f".{digest}.lock"):
        if not _holds(cached, digest):  # Not trained by another process meanwhile.
            # Minutes of work on first use: said, and shown as it goes, not silent.
            print(
                f"training the warm start once ({config.steps} supervised steps on "
                f"{config.task}), cached in {cached}",
                file=sys.stderr,
                flush=True,
            )
            warm_start(config, cached, data_dir=data_dir, progress=True)
    return cached


def _holds(directory: Path, digest: str) -> bool:
    try:
        return read_metadata(directory).get("config_hash") == digest
    except FileNotFoundError:
        return False
