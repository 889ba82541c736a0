"""The parts of a run, each built from the run's `TrainConfig`.

`gac_jax.train.run.build_run` assembles them into a `Run`; the Ray rollout actors build
their side here too (`ActorGenerator`), so every role reads the config the same way. With
`abstract=True` no weight is made (`nnx.eval_shape`): how `plan` compiles without memory.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from gac_jax import models
from gac_jax.learner import GRPOLearner, make_optimizer
from gac_jax.models.hf_checkpoint import hf_model_config
from gac_jax.rollout import DecodeSetup, TaskGroupGenerator, make_sampler
from gac_jax.rollout.episodes import EpisodeRunner
from gac_jax.rollout.placement import RolloutPlacement
from gac_jax.tasks import get_task
from gac_jax.tasks.chat import with_chat_template, with_system_prompt
from gac_jax.tasks.chat_turns import ChatTurns
from gac_jax.tasks.custom import GuardedReward, resolve_reward
from gac_jax.tasks.environments import environment_tools, resolve_environment
from gac_jax.train import processes
from gac_jax.train.config import TrainConfig, run_chat_template

# The driver's JAX settings the Ray actors inherit (so a CPU run's actors stay on the CPU,
# with the same fake device count).
INHERITED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS")


def use_compilation_cache(config: TrainConfig) -> None:
    """JAX's persistent compilation cache in `config.compilation_cache` for this process
    from now on (created, ``~`` expanded); None leaves JAX's setting as it is. JAX reads
    the directory once, at the first compile that uses it, so another one is set by
    resetting JAX's cache first (`compilation_cache.reset_cache`, JAX's public API)."""
    if config.compilation_cache is None:
        return
    path = os.path.abspath(os.path.expanduser(config.compilation_cache))
    if jax.config.jax_compilation_cache_dir == path:
        return
    os.makedirs(path, exist_ok=True)
    compilation_cache.reset_cache()
    compilation_cache.set_cache_dir(path)


def _checkpoint_dir(config: TrainConfig) -> Path | None:
    """The Hugging Face directory the model is read from (None for `warm_start`/`random`,
    and for a preset's checkpoint not downloaded yet)."""
    if config.init in ("random", "warm_start") or not os.path.isdir(config.init):
        return None
    return Path(config.init)


def model_config(config: TrainConfig) -> models.ModelConfig:
    """The run's architecture and dtypes, read without loading a weight (a checkpoint's as
    `load_hf_checkpoint` reads them: in its stored dtype unless `compute` says otherwise).
    A preset's checkpoint not downloaded yet gives its `model` preset (the same layout)."""
    overrides = config.compute.overrides()
    path = _checkpoint_dir(config)
    if path is None:
        return models.get_config(config.model, **overrides)
    return hf_model_config(path, **overrides)


def build_tokenizer(config: TrainConfig):
    path = _checkpoint_dir(config)
    return models.CharTokenizer() if path is None else models.HFTokenizer.from_directory(path)


def build_model(config: TrainConfig, mesh, *, abstract: bool = False, num_layers=None):
    """(model, tokenizer) for `config.init`: a warm start of the task and model (the shipped
    one for countdown on `tiny`), random weights, or an HF checkpoint dir (these two built
    with `config.compute`'s settings at once, so no copy is cast; `build_run` applies them
    to a warm start). `abstract`: shapes, dtypes and shardings only, with `compute`'s, and
    with `num_layers` decoder layers if given (`plan`'s probes)."""
    if abstract:
        cfg = model_config(config)
        if num_layers is not None:
            cfg = cfg.replace(num_layers=num_layers)
        model = nnx.eval_shape(lambda: add_lora(config, models.create_model(cfg, seed=0)))
    elif config.init == "warm_start":
        from gac_jax.train.warm_start import load_warm_start

        return load_warm_start(warm_start_directory(config), mesh=mesh)[:2]  # No metadata.
    elif config.init == "random":
        cfg = model_config(config)
        model = models.create_sharded(lambda: models.create_model(cfg, seed=config.seed), mesh)
    else:
        path = Path(config.init)  # `build_run` has said if a preset's is not downloaded yet.
        if not (path / "config.json").is_file():
            raise ValueError(
                f"init={config.init!r} is neither 'warm_start', 'random' nor a Hugging Face "
                "checkpoint directory (with config.json)."
            )
        model = models.load_hf_checkpoint(path, mesh=mesh, **config.compute.overrides())
    return model, build_tokenizer(config)


def warm_start_directory(config: TrainConfig) -> Path:
    """The checkpoint of `config`'s supervised warm start (`init="warm_start"`): a shipped
    one (countdown/n3_max20 on `tiny` at 800 and 300 steps, calculator/muladd's 300), else
    trained once and cached."""
    from gac_jax.train.warm_start import WarmStartConfig, ensure_warm_start

    lengths = {}
    if get_task(config.task).reference_turns is not None:  # Episodes are longer: the run's.
        g = config.generation
        lengths = dict(
            max_length=1 + g.prompt_length + g.max_new_tokens,
            prompt_length=g.prompt_length,
            max_new_tokens=g.max_new_tokens,
        )
    return ensure_warm_start(
        WarmStartConfig(
            task=config.task, model=config.model, steps=config.warm_start_steps, **lengths
        ),
        data_dir=config.data_dir,
    )


def add_lora(config: TrainConfig, model):
    """`model` with LoRA adapters of `config.lora` (itself when `lora.rank` is 0)."""
    if not config.lora.rank:
        return model
    return models.apply_lora(model, config.lora, rngs=nnx.Rngs(params=config.seed))


def build_learner(config: TrainConfig, model, mesh) -> GRPOLearner:
    """The sharded learner of `config`: its optax chain, objective and settings (with
    `config.lora.rank`, the model's LoRA adapters train and the rest is frozen)."""
    tx = make_optimizer(
        config.optimizer, config.gac, config.ess, steps=config.optimizer_steps, seed=config.seed
    )
    trainable = models.lora_filter if config.lora.rank else None
    return GRPOLearner(
        model, tx, mesh, loss=config.loss, config=config.learner, trainable=trainable
    )


def build_task(config: TrainConfig):
    """The run's task: `config.task` with `config.reward` (if set) as its reward, guarded
    by `config.reward_guard` (timeouts, failures scored and counted), `config.env` (if
    set) as its environment, and its prompts in the chat template of the `init` model
    directory (`config.chat_template`), with the environment's tools listed."""
    task = get_task(config.task)
    if config.reward is not None:
        reward = GuardedReward(resolve_reward(config.reward), config.reward, config.reward_guard)
        task = dataclasses.replace(task, reward=reward)
    if config.env is not None:
        environment = resolve_environment(config.env)
        task = dataclasses.replace(task, environment=lambda: environment)
    template = run_chat_template(config)
    if template is not None:
        # The generator adds the tokenizer's BOS id itself, so the template's text goes.
        task = with_chat_template(
            task,
            template,
            system=config.system_prompt,
            strip_bos=True,
            **_template_variables(config, task),
        )
    elif config.system_prompt is not None:
        task = with_system_prompt(task, config.system_prompt)
    return task


def data_sources(task, data_dir) -> tuple[Any, Any]:
    """The task's train and test splits. With several processes, process 0 prepares them
    first (tfds builds a dataset once per directory) and the others then read them."""
    primary = processes.is_primary()
    if not primary:
        processes.barrier("gac_jax.train: data prepared")
    sources = tuple(task.data_source(split, data_dir=data_dir) for split in ("train", "test"))
    if primary:
        processes.barrier("gac_jax.train: data prepared")
    return sources


def build_generator(
    config: TrainConfig, graphdef, sampler, task, examples, tokenizer, placement, latest_params
) -> TaskGroupGenerator:
    """The run's rollout generator: groups of `config.generation` on `placement`'s devices,
    taking newer params between decode chunks when `rollout.inflight_updates`."""
    return TaskGroupGenerator(
        graphdef,
        sampler,
        task,
        examples,
        tokenizer,
        config.generation,
        DecodeSetup(
            placement=placement,
            latest_params=latest_params if config.rollout.inflight_updates else None,
            chunk_steps=config.rollout.inflight_chunk_steps,
        ),
        episodes=build_episodes(config, task, sampler, tokenizer),
    )


def _template_variables(config: TrainConfig, task) -> dict[str, Any]:
    """The chat template's variables: `enable_thinking` if set, the environment's tools."""
    variables: dict[str, Any] = {}
    if config.enable_thinking is not None:
        variables["enable_thinking"] = config.enable_thinking
    if task.environment is not None:
        name = config.env or f"{task.name} environment"
        tools = environment_tools(task.environment(), name)
        if tools is not None:
            variables["tools"] = tools
    return variables


def build_episodes(config: TrainConfig, task, sampler, tokenizer) -> EpisodeRunner | None:
    """The run's multi-turn `EpisodeRunner` (`build_task` made `config.env` the task's
    environment); None for a single-answer task. With a chat template, observations are
    rendered in its roles (`ChatTurns`)."""
    if task.environment is None:
        return None
    environment = task.environment()
    name = config.env or f"{task.name} environment"
    template = run_chat_template(config)
    chat = None if template is None else ChatTurns(template, **_template_variables(config, task))
    return EpisodeRunner(
        sampler, tokenizer, environment, config.episode, name, config.reward_guard, chat
    )


@dataclasses.dataclass(frozen=True)
class ActorGenerator:
    """Picklable factory run inside each Ray rollout actor: the run's `TaskGroupGenerator`
    on the actor's local devices (tensor-parallel by `placement.tensor_parallel`), and the
    function that places a host copy of the params there. The model is built abstract:
    the learner sends every version's params, so only its layout is needed here."""

    config: TrainConfig

    def __call__(self) -> tuple[TaskGroupGenerator, Any]:
        c = self.config
        use_compilation_cache(c)
        task = build_task(c)
        examples = task.data_source("train", data_dir=c.data_dir)
        placement = RolloutPlacement.local(c.placement)
        model, tokenizer = build_model(c, placement.mesh, abstract=True)
        sampler = make_sampler(model.config, tokenizer, c.generation)
        generator = build_generator(
            c, nnx.graphdef(model), sampler, task, examples, tokenizer, placement, None
        )
        return generator, placement.to_rollout


def build_ray_pool(config: TrainConfig, store=None, factory=None):
    """`rollout.backend=ray`: `rollout.num_workers` actor processes on the Ray cluster
    `RAY_ADDRESS` names, or on a new local one (`LocalRayCluster`, started from a clean
    interpreter so no Python runs in a fork of this JAX process, stopped at exit). With
    `rollout.inflight_updates` the actors follow `store` (the learner's `ParamStore`).
    `factory`: the actors' factory (default `ActorGenerator(config)`; a benchmark wraps it)."""
    import atexit

    import ray

    from gac_jax.rollout.ray_cluster import LocalRayCluster
    from gac_jax.rollout.ray_rollouts import RayRolloutPool

    if not ray.is_initialized():
        if "RAY_ADDRESS" in os.environ:
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            cluster = LocalRayCluster().start()
            atexit.register(cluster.stop)  # Runs after Ray's own shutdown (atexit is LIFO).
            cluster.connect()
    env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
    gpus = config.ray.actor_gpus
    return RayRolloutPool(
        factory or ActorGenerator(config),
        config.rollout.num_workers,
        on_actor_failure=config.ray.on_actor_failure,
        actor_options={"num_gpus": gpus} if gpus else None,
        env=env,
        follow=store if config.rollout.inflight_updates else None,
    )
