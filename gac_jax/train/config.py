"""The run's config: the components' own configs composed, and the named presets.

Each section of `TrainConfig` (``optimizer``, ``gac``, ``loss``, ``learner``, ``rollout``,
...) is the config of one component, defined next to its code and passed to it whole;
`TrainConfig` adds what the loop itself uses (task, model, steps, evaluation, checkpoints)
and the checks that span sections. `gac_jax.train.config_io` reads and writes configs
(YAML, JSON, ``--set``).

Over 450 lines because `TrainConfig` documents every field of its own in its docstring and
the presets (each with the measurements that sized it, and its one-line description) sit
beside the config they instantiate.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gac_jax._validation import check_int
from gac_jax.learner import LearnerConfig, LossConfig, OptimizerConfig
from gac_jax.models import ComputeConfig, LoraConfig, MeshConfig
from gac_jax.rollout import BufferConfig, GenerationConfig, RolloutConfig
from gac_jax.rollout.buffer import BATCHES_HELD, buffer_capacity
from gac_jax.rollout.episodes import EpisodeConfig
from gac_jax.rollout.placement import PlacementConfig
from gac_jax.rollout.ray_cluster import RayConfig
from gac_jax.rollout.worker import check_version_choice
from gac_jax.tasks.custom import RewardGuardConfig
from gac_jax.transforms import ESSConfig, GACConfig

INIT_MODES = ("random", "warm_start")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. `steps` counts learner updates.

    Attributes:
      task: a `gac_jax.tasks` name, or ``jsonl:TRAIN_PATH[,TEST_PATH]`` for one's own data.
      reward: replaces the task's reward: ``"package.module:function"`` of
        ``(completion, example) -> float``, or a built-in matcher's name (``boxed``,
        ``last_number``, ...); None keeps the task's own.
      reward_guard: `reward`'s timeout, failure score and failure limit
        (`gac_jax.tasks.custom.RewardGuardConfig`); a multi-turn environment's reward too.
      env: a multi-turn environment, ``"package.module:Name"`` (`gac_jax.tasks.environments`),
        replacing the task's own; None keeps the task's. Settings in `episode`.
      episode: multi-turn episodes: turn limit, observation length, tool timeout
        (`gac_jax.rollout.episodes.EpisodeConfig`); the episode's token budget, policy and
        observation tokens together, is `generation.max_new_tokens`.
      chat_template: "auto" renders prompts with the chat template of the `init` model
        directory when it has one (`gac_jax.tasks.chat`); None (``none`` on the command
        line) keeps raw prompts.
      system_prompt: the system message of every prompt that brings none (without a
        chat template: text before the prompt, a blank line between); None: none.
      enable_thinking: the chat template's ``enable_thinking`` variable (Qwen3's thinking
        switch); None leaves it to the template. Needs a chat template.
      data_dir: tfds data dir; None for ~/tensorflow_datasets.
      model: a `gac_jax.models` preset. With a Hugging Face `init` the architecture is the
        checkpoint's: the default ("tiny") means "the checkpoint's", any other preset must
        match its `config.json`; `gac-jax plan` builds it before the download.
      init: "warm_start" (supervised on the task: shipped for countdown on tiny, else
        trained once and cached), "random", or a Hugging Face checkpoint dir (the Qwen3
        presets' `PRESET_CHECKPOINTS` may be absent until a run builds, `require_init`).
      warm_start_steps: supervised steps of ``init=warm_start`` (each value is its own
        cached warm start; 800 is the shipped one). Fewer steps leave RL more to learn.
      steps: learner updates.
      seed: model initialisation (random init), prompt order and sampling.
      eval_every: held-out evaluation every this many steps; 0 disables it.
      eval_size: test problems per evaluation.
      eval_at_start: also evaluate the initial policy (step 0's ``eval_start/...``), so a
        run's gain is measured on its own problems.
      eval_samples: k of pass@k.
      checkpoint_every: checkpoint every this many steps (and at the end); 0 disables it.
      keep_checkpoints: checkpoints kept.
      samples_every: write sampled completions to ``samples.jsonl`` and a TensorBoard
        table every this many steps, at step 0 and at the last; 0 disables it.
      samples_per_log: completions written each time, the first ones of the batch in
        order (whole groups first); None writes the whole batch (process 0's share).
      wandb_project: also log metrics and the sample tables to this Weights & Biases
        project (needs ``pip install 'gac_jax[wandb]'``); None: no W&B.
      wandb_mode: "online", or "offline" (files under the run directory's ``wandb/``,
        uploaded later with ``wandb sync``).
      compilation_cache: JAX's persistent compilation cache directory (``~`` expanded),
        read back by later runs, ``plan`` and ``eval`` of the same shapes; process-wide from
        the build on. None: JAX's own setting. The directory is trusted (it can run code).
    """

    task: str = "countdown/n3_max20"
    reward: str | None = None
    env: str | None = None
    reward_guard: RewardGuardConfig = dataclasses.field(default_factory=RewardGuardConfig)
    chat_template: str | None = "auto"
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    data_dir: str | None = None
    model: str = "tiny"
    init: str = "warm_start"
    warm_start_steps: int = 800
    steps: int = 100
    seed: int = 0
    eval_every: int = 25
    eval_size: int = 64
    eval_at_start: bool = False
    eval_samples: int = 8
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    samples_every: int = 25
    samples_per_log: int | None = 8
    wandb_project: str | None = None
    wandb_mode: str = "online"
    compilation_cache: str | None = None
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    gac: GACConfig = dataclasses.field(default_factory=lambda: GACConfig(monitor_only=True))
    ess: ESSConfig | None = None
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    episode: EpisodeConfig = dataclasses.field(default_factory=EpisodeConfig)
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)

    @property
    def batch_size(self) -> int:
        """Sequences per learner step."""
        return self.rollout.groups_per_batch * self.generation.group_size

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the run: `steps` rollout batches, each
        `learner.mini_batches` x `learner.epochs` updates (the schedule's unit)."""
        return self.steps * self.learner.updates_per_batch

    def validate(self) -> None:
        """Raises ValueError naming the first bad field (as ``section.field``)."""
        # The learner's rules read the loss and the batch: it goes last, once, with them.
        for field in sorted(dataclasses.fields(self), key=lambda f: f.name == "learner"):
            section = getattr(self, field.name)
            context = (self.loss, self.batch_size) if field.name == "learner" else ()
            if dataclasses.is_dataclass(section):
                try:
                    section.validate(*context)
                except ValueError as error:
                    raise ValueError(_in_section(field.name, section, error)) from None
        _validate_run_fields(self)
        _validate_across_sections(self)


def _in_section(name: str, section, error: ValueError) -> str:
    """The component's message with its section: ``gac.tau_low=...`` when it starts with
    one of the section's fields, else ``gac: ...``."""
    message = str(error)
    fields = [f.name for f in dataclasses.fields(section)]
    if any(message.startswith(f) for f in fields):
        return f"{name}.{message}"
    return f"{name}: {message}"


WARM_START_WARMUP = 100  # `WarmStartConfig.warmup_steps`: `warm_start_steps` must exceed it.


def _validate_run_fields(config: TrainConfig) -> None:
    from gac_jax.tasks import get_task
    from gac_jax.tasks.custom import resolve_reward

    for name, low in (
        ("steps", 1),
        ("eval_every", 0),
        ("eval_size", 1),
        ("eval_samples", 1),
        ("checkpoint_every", 0),
        ("keep_checkpoints", 1),
        ("seed", 0),
        ("samples_every", 0),
        ("warm_start_steps", WARM_START_WARMUP + 1),  # Its schedule warms up first.
    ):
        check_int(name, getattr(config, name), low)
    _validate_logging(config)
    try:
        get_task(config.task)
    except ValueError as error:
        raise ValueError(f"task={config.task!r}: {error}") from None
    if config.reward is not None:
        try:
            resolve_reward(config.reward)
        except ValueError as error:
            raise ValueError(f"reward={config.reward!r}: {error}") from None
    if config.env is not None:
        from gac_jax.tasks.environments import resolve_environment

        resolve_environment(config.env)  # Its errors name env= already.
    if config.reward is not None and (config.env or get_task(config.task).environment):
        raise ValueError(
            f"reward={config.reward!r} does not apply to a multi-turn task: its "
            "environment's reward scores the episodes (set env= to change it)."
        )
    _validate_chat(config)
    _validate_init(config)


# The checkpoints the Qwen3 presets train, by the directory the README says to download
# them into (relative to where gac-jax runs) -> their Hugging Face model id. Validation
# lets them be absent (`plan` and `show-config` work before the download; `require_init`).
PRESET_CHECKPOINTS = {
    "checkpoints/Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "checkpoints/Qwen3-1.7B": "Qwen/Qwen3-1.7B",
}
# The `ModelConfig` fields a `model` preset must share with a Hugging Face `init`.
_ARCHITECTURE = ("family", "vocab_size", "embed_dim", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "mlp_dim", "tie_word_embeddings")  # fmt: skip


def require_init(config: TrainConfig) -> None:
    """Raises a one-line ValueError when `init` is a preset's checkpoint directory that
    has not been downloaded."""
    if config.init in PRESET_CHECKPOINTS and not os.path.isdir(config.init):
        raise ValueError(
            f"init={config.init} does not exist: download {PRESET_CHECKPOINTS[config.init]} "
            'there (README, "On real hardware"), or set init= to a copy of it.'
        )


def _validate_init(config: TrainConfig) -> None:
    from gac_jax.models import get_config

    present = os.path.isdir(config.init)
    if config.init not in INIT_MODES and not present and config.init not in PRESET_CHECKPOINTS:
        raise ValueError(
            f"init={config.init!r} is neither one of {list(INIT_MODES)} nor an existing "
            "directory (a Hugging Face checkpoint with config.json)."
        )
    if config.init in INIT_MODES or not present or config.model != TrainConfig.model:
        try:
            preset = get_config(config.model)
        except ValueError as error:
            raise ValueError(f"model={config.model!r}: {error}") from None
    if config.init not in INIT_MODES and present and config.model != TrainConfig.model:
        _check_model_matches_init(config, preset)
    if config.init == "random":
        _check_random_model_speaks_characters(config, preset)


def _check_random_model_speaks_characters(config: TrainConfig, preset) -> None:
    """`init=random` has no checkpoint, so no tokenizer of its own: it runs on the character
    tokenizer, which can never sample (or stop at) a special id beyond its own few."""
    from gac_jax.models import CharTokenizer

    size = CharTokenizer().vocab_size
    special = {
        "EOS": max(preset.eos_token_ids, default=None),  # None: the tokenizer's own.
        "BOS": preset.bos_token_id,
        "padding": preset.pad_token_id,
    }
    for name, token in special.items():
        if token is not None and token >= size:
            raise ValueError(
                f"model={config.model!r} with init=random: its {name} id {token} is beyond the "
                f"{size} ids of the character tokenizer a random model runs on (it would never "
                "stop); use a small preset (model=tiny or small), or init= a checkpoint "
                "directory with its tokenizer."
            )


def _check_model_matches_init(config: TrainConfig, preset) -> None:
    """`model` names a preset while `init` is a checkpoint: they must be one architecture."""
    from gac_jax.models.hf_config import config_from_hf, read_hf_config

    if not os.path.isfile(os.path.join(config.init, "config.json")):
        return  # Not a checkpoint yet: building the model says so.
    try:
        checkpoint = config_from_hf(read_hf_config(config.init))
    except ValueError as error:
        raise ValueError(f"init={config.init!r}: {error}") from None
    differ = [
        f"{name} {getattr(preset, name)} vs {getattr(checkpoint, name)}"
        for name in _ARCHITECTURE
        if getattr(preset, name) != getattr(checkpoint, name)
    ]
    if differ:
        raise ValueError(
            f"model={config.model!r} is not the architecture of init={config.init!r} "
            f"(model vs checkpoint: {', '.join(differ[:3])}): the model is the checkpoint's; "
            "set model= to its "
            f"preset, or to {TrainConfig.model!r} (the default: the checkpoint's own)."
        )


WANDB_MODES = ("online", "offline")


def _validate_logging(config: TrainConfig) -> None:
    import importlib.util

    if config.samples_per_log is not None:
        check_int("samples_per_log", config.samples_per_log, 1)
    if config.wandb_mode not in WANDB_MODES:
        raise ValueError(f"wandb_mode={config.wandb_mode!r} must be one of {list(WANDB_MODES)}.")
    for name in ("wandb_project", "compilation_cache"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name}={value!r} must be a non-empty string or null.")
    project = config.wandb_project
    if project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"wandb_project={project!r} needs the wandb package: pip install 'gac_jax[wandb]'."
        )


CHAT_TEMPLATE_MODES = ("auto", None)


def run_chat_template(config: TrainConfig):
    """The `ChatTemplate` the run renders prompts with, or None (see `chat_template`)."""
    from gac_jax.tasks.chat import ChatTemplate

    if config.chat_template is None or not os.path.isdir(config.init):
        return None
    return ChatTemplate.from_directory(config.init)


def _validate_chat(config: TrainConfig) -> None:
    if config.chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(
            f"chat_template={config.chat_template!r} must be 'auto' or null (raw prompts)."
        )
    if config.system_prompt is not None and not isinstance(config.system_prompt, str):
        raise ValueError(f"system_prompt={config.system_prompt!r} must be a string or null.")
    if config.enable_thinking is not None and not isinstance(config.enable_thinking, bool):
        raise ValueError(f"enable_thinking={config.enable_thinking!r} must be true, false or null.")
    try:
        template = run_chat_template(config)
    except Exception as error:  # A template that does not compile, a bad JSON file.
        raise ValueError(f"chat_template: the template of init={config.init!r}: {error}") from None
    pending = config.init in PRESET_CHECKPOINTS and not os.path.isdir(config.init)
    if config.enable_thinking is not None and template is None and not pending:
        # (A preset's checkpoint not downloaded yet brings its template with it.)
        raise ValueError(
            f"enable_thinking={config.enable_thinking} needs a chat template: init= a model "
            "directory with one, and chat_template='auto'."
        )


def _validate_across_sections(config: TrainConfig) -> None:
    opt = config.optimizer
    total = config.optimizer_steps
    if opt.schedule != "constant" and opt.decay_steps is None and opt.warmup_steps >= total:
        raise ValueError(
            f"optimizer.warmup_steps={opt.warmup_steps} must be < the run's {total} optimizer "
            "steps (steps x learner.mini_batches x learner.epochs; optimizer.decay_steps=null: "
            "the schedule lasts the run)."
        )
    rollout = config.rollout
    try:
        check_version_choice(rollout.version_choice, config.buffer.stale_policy)
    except ValueError as error:
        raise ValueError(f"rollout.{error}") from None
    capacity = config.buffer.capacity
    if capacity is not None and capacity < config.rollout.groups_per_batch:
        raise ValueError(
            f"buffer.capacity={capacity} must be >= rollout.groups_per_batch="
            f"{config.rollout.groups_per_batch}, or a batch could never be assembled."
        )
    room = buffer_capacity(capacity, rollout.groups_per_batch)
    if rollout.mode == "async" and rollout.groups_per_call > room:
        # A worker reserves a call's slots before it samples: more than the buffer holds
        # and it waits forever for room that only its own groups could make.
        raise ValueError(
            f"rollout.groups_per_call={rollout.groups_per_call} must be <= the buffer's "
            f"{room} groups (buffer.capacity, or {BATCHES_HELD} x rollout.groups_per_batch when "
            "null), or the rollout workers deadlock."
        )


def _preset_demo() -> TrainConfig:
    # Sized from short sweeps here: at lr 1e-3 the warm start degraded, at 1e-4 to 2e-4 the
    # batch reward rose; 16 prompts per step keep the reward curve readable.
    return TrainConfig(
        steps=300,
        eval_every=100,
        eval_size=128,
        checkpoint_every=100,
        optimizer=OptimizerConfig(learning_rate=2e-4),
        gac=GACConfig(),
        rollout=RolloutConfig(mode="async", num_workers=1, groups_per_batch=16, groups_per_call=16),
        buffer=BufferConfig(max_staleness=2),
    )


def _preset_countdown_sweep() -> TrainConfig:
    # The base of the experiments in experiments/ (lagged naive GRPO from the warm start):
    # sized so that one run takes about three minutes on one CPU core.
    return TrainConfig(
        steps=200,
        eval_every=50,
        eval_size=128,
        checkpoint_every=50,
        keep_checkpoints=1,
        optimizer=OptimizerConfig(learning_rate=SWEEP_LEARNING_RATE),
        rollout=RolloutConfig(mode="lagged", groups_per_batch=16),
    )


SWEEP_LEARNING_RATE = 6e-4


def _preset_lab() -> TrainConfig:
    # experiments/lab.py's laboratory (issue #21), chosen by the pilots in its RESULTS.md.
    return TrainConfig(
        warm_start_steps=LAB_WARM_START_STEPS,
        steps=LAB_STEPS,
        eval_every=LAB_STEPS // 5,
        eval_size=128,
        eval_at_start=True,
        checkpoint_every=LAB_STEPS // 4,
        keep_checkpoints=1,
        samples_every=0,
        optimizer=OptimizerConfig(learning_rate=LAB_LEARNING_RATE),
        # Whole steps, as its committed runs were made (the CPU default would split them).
        learner=LearnerConfig(micro_batches=1, policy_change=True),
        rollout=RolloutConfig(mode="lagged", groups_per_batch=16),
    )


LAB_WARM_START_STEPS = 300
LAB_STEPS = 1000
LAB_LEARNING_RATE = 2e-4


# The real-hardware presets' compiled programs (compiling took minutes: benchmarks/ACCELERATOR.md).
REAL_HARDWARE_COMPILATION_CACHE = "~/.cache/gac_jax/xla"


def _preset_qwen3_gsm8k(model: str, init: str, micro_batches: int) -> TrainConfig:
    # `init` is the downloaded checkpoint (`PRESET_CHECKPOINTS`): a random 151,936-token
    # model with the 128-symbol character tokenizer would learn nothing.
    return TrainConfig(
        task="gsm8k",
        model=model,
        init=init,
        steps=500,
        compilation_cache=REAL_HARDWARE_COMPILATION_CACHE,
        optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.1),
        gac=GACConfig(),
        learner=LearnerConfig(micro_batches=micro_batches, logits_chunk_size=128),
        generation=GenerationConfig(group_size=8, prompt_length=256, max_new_tokens=512),
        rollout=RolloutConfig(mode="async", groups_per_batch=64, num_workers=2, groups_per_call=8),
        buffer=BufferConfig(max_staleness=4),
        mesh=MeshConfig(data=1, fsdp=-1),
        compute=ComputeConfig(remat="full"),
    )


# GSM8K as it is commonly run on Qwen3 (Qwen's math prompt, thinking off): the reward is the
# task's final-number match (`gsm8k_reward`: ``#### N``, ``\boxed{N}``, ``answer is N``,
# else the last number), no format reward.
GSM8K_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def _preset_qwen3_gsm8k_one_device(model: str, init: str, lora: bool) -> TrainConfig:
    # One 80 GB accelerator: sync GRPO (on shared devices asynchrony changes the data, not
    # the speed); 4096-token micro-batches and remat bound activations, 128 decode slots the
    # KV cache (checked by `gac-jax plan`). LoRA for 1.7B: its full state is about 40 GB.
    return TrainConfig(
        task="gsm8k",
        model=model,
        init=init,
        system_prompt=GSM8K_SYSTEM_PROMPT,
        enable_thinking=False,
        steps=300,
        eval_every=50,
        eval_size=256,
        eval_at_start=True,
        checkpoint_every=50,
        compilation_cache=REAL_HARDWARE_COMPILATION_CACHE,
        optimizer=OptimizerConfig(learning_rate=2e-5 if lora else 1e-6, weight_decay=0.0),
        gac=GACConfig(monitor_only=True),
        learner=LearnerConfig(max_tokens_per_micro_batch=4096, logits_chunk_size=128),
        lora=LoraConfig(rank=64, alpha=128.0, targets=LORA_ALL) if lora else LoraConfig(),
        generation=GenerationConfig(
            group_size=8, prompt_length=256, max_new_tokens=512, temperature=1.0, slots=128
        ),
        rollout=RolloutConfig(mode="sync", groups_per_batch=32),
        mesh=MeshConfig(data=1, fsdp=-1),
        compute=ComputeConfig(remat="full"),
    )


LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _preset_qwen3_gsm8k_one_device_stale(cure: str) -> TrainConfig:
    # The one-GPU 0.6B preset on rollouts 8 versions stale (issue 61), with a cure. "vcpo":
    # ESS step scaling and the off-policy optimal baseline, gradient norms by the length
    # proxy. "gac": GAC on applied updates, thresholds 0.92/0.96 (PPO's median and 90th
    # percentile in laboratory v4: a starting point, not a tuning).
    base = _preset_qwen3_gsm8k_one_device("qwen3_0_6b", "checkpoints/Qwen3-0.6B", lora=False)
    stale = dataclasses.replace(
        base, rollout=dataclasses.replace(base.rollout, mode="lagged", lag=8)
    )
    if cure == "vcpo":
        loss = dataclasses.replace(base.loss, advantage="vcpo", grad_norm="length")
        return dataclasses.replace(stale, ess=ESSConfig(), loss=loss)
    gac = GACConfig(
        monitor_only=False, acts_on="update", reference="update", tau_low=0.92, tau_high=0.96
    )
    return dataclasses.replace(stale, gac=gac)


def _preset_calculator() -> TrainConfig:
    # Multi-turn tool use (issue #35): the calculator task from a 300-step supervised warm
    # start on worked tool-using transcripts (greedy 0.52, pass@1 0.21 on 200 test problems).
    return TrainConfig(
        task="calculator/muladd",
        warm_start_steps=300,
        steps=100,
        eval_every=25,
        eval_size=128,
        eval_at_start=True,
        checkpoint_every=50,
        optimizer=OptimizerConfig(learning_rate=CALCULATOR_LEARNING_RATE),
        generation=GenerationConfig(group_size=8, prompt_length=16, max_new_tokens=48),
        episode=EpisodeConfig(max_turns=4, max_observation_tokens=8),
        learner=LearnerConfig(micro_batches=1),  # Whole steps, as its committed runs.
        rollout=RolloutConfig(mode="sync", groups_per_batch=16),
    )


CALCULATOR_LEARNING_RATE = 2e-4


PRESETS: dict[str, Any] = {
    # The embedded default: countdown from the shipped warm start, async GRPO with GAC.
    "demo": _preset_demo,
    # From the same warm start, so at the demo's rate: 40 steps here raised the batch reward
    # at 2e-4 (mean of the first and last 10 steps: sync 0.21 -> 0.25, lagged8 0.22 -> 0.27)
    # and collapsed it at the default 1e-3 (lagged8 0.22 -> 0.04).
    "countdown_sync": lambda: TrainConfig(
        optimizer=OptimizerConfig(learning_rate=2e-4), rollout=RolloutConfig(mode="sync")
    ),
    "countdown_lagged8": lambda: TrainConfig(
        optimizer=OptimizerConfig(learning_rate=2e-4), rollout=RolloutConfig(mode="lagged", lag=8)
    ),
    "countdown_sweep": _preset_countdown_sweep,
    "lab": _preset_lab,
    "calculator": _preset_calculator,
    # Real hardware: Qwen3 on GSM8K from a Hugging Face checkpoint (see README). Sized with
    # `gac-jax plan` to fit 8 devices of 80 GB, with half of it spare (README, "Will it fit?").
    # Micro-batches: 4 sequences a device at 0.6B, 2 at 1.7B (`gac-jax plan`: 34.4 and
    # 29.3 GiB a device; 1.7B at 4 a device needed 52.7).
    "qwen3_0_6b_gsm8k": lambda: _preset_qwen3_gsm8k(
        "qwen3_0_6b", "checkpoints/Qwen3-0.6B", micro_batches=16
    ),
    "qwen3_1_7b_gsm8k": lambda: _preset_qwen3_gsm8k(
        "qwen3_1_7b", "checkpoints/Qwen3-1.7B", micro_batches=32
    ),
    # One accelerator of 80 GB (issue #42): the way most researchers start.
    "qwen3_0_6b_gsm8k_1gpu": lambda: _preset_qwen3_gsm8k_one_device(
        "qwen3_0_6b", "checkpoints/Qwen3-0.6B", lora=False
    ),
    "qwen3_1_7b_gsm8k_1gpu_lora": lambda: _preset_qwen3_gsm8k_one_device(
        "qwen3_1_7b", "checkpoints/Qwen3-1.7B", lora=True
    ),
    # The same 0.6B run on rollouts 8 versions stale, with a stabilizer (issue 61).
    "qwen3_0_6b_gsm8k_1gpu_lagged8_vcpo": lambda: _preset_qwen3_gsm8k_one_device_stale("vcpo"),
    "qwen3_0_6b_gsm8k_1gpu_lagged8_gac": lambda: _preset_qwen3_gsm8k_one_device_stale("gac"),
}


# What `gac-jax presets` says of each, one line (a test checks every preset has one).
PRESET_DESCRIPTIONS = {
    "demo": "the embedded default: countdown, shipped warm start, async GRPO with GAC (300 steps)",
    "countdown_sync": "countdown from the shipped warm start, synchronous GRPO, lr 2e-4",
    "countdown_lagged8": "countdown_sync with every batch 8 versions stale (lagged mode)",
    "countdown_sweep": "the older experiments' base: lagged naive GRPO, about 3 min a run",
    "lab": "experiments/lab.py's laboratory: countdown from the 300-step warm start",
    "calculator": "multi-turn tool use: a*b+c with a calculator tool, sync GRPO on episodes",
    "qwen3_0_6b_gsm8k": "Qwen3-0.6B on GSM8K, FSDP over all devices (needs the HF checkpoint)",
    "qwen3_1_7b_gsm8k": "Qwen3-1.7B on GSM8K, FSDP over all devices (needs the HF checkpoint)",
    "qwen3_0_6b_gsm8k_1gpu": "Qwen3-0.6B on GSM8K, one 80 GB accelerator, sync (HF checkpoint)",
    "qwen3_1_7b_gsm8k_1gpu_lora": "Qwen3-1.7B, LoRA, GSM8K, one 80 GB accelerator (HF checkpoint)",
    "qwen3_0_6b_gsm8k_1gpu_lagged8_vcpo": "the 0.6B one-GPU run, rollouts 8 versions stale, VCPO",
    "qwen3_0_6b_gsm8k_1gpu_lagged8_gac": "the 0.6B one-GPU run, rollouts 8 versions stale, GAC",
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, *, validate: bool = True) -> TrainConfig:
    """A preset by name, validated unless `validate` is false (a base that overrides will
    change before it is validated whole); ValueError listing the names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"Unknown config preset {name!r}; known presets: {preset_names()}.")
    config = PRESETS[name]()
    if validate:
        config.validate()
    return config
