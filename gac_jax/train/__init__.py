"""Training: configs, the GRPO loop, evaluation, orbax checkpoints and the warm start.

config = gac_jax.train.get_preset("demo")
config = gac_jax.train.apply_overrides(config, ["rollout.lag=8", "gac.monitor_only=false"])
gac_jax.train.train(config, "runs/mine")
"""

from gac_jax.rollout.evaluation import evaluate_policy, pass_at_k
from gac_jax.train.checkpoint import (
    Checkpoint,
    CheckpointManager,
    abstract_tree,
    latest_step,
    load_model_params,
    model_params,
    read_metadata,
    restore_checkpoint,
    restore_model,
    save_checkpoint,
)
from gac_jax.train.config import TrainConfig, get_preset, preset_names
from gac_jax.train.config_io import (
    apply_overrides,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
    save_config,
    to_yaml,
)
from gac_jax.train.loop import train
from gac_jax.train.run import Run, build_run, evaluate_checkpoint, load_checkpoint
from gac_jax.train.warm_start import (
    SHIPPED_WARM_START_DIR,
    SFTConfig,
    WarmStartConfig,
    ensure_warm_start,
    evaluate_warm_start,
    load_warm_start,
    train_sft,
    warm_start,
)

__all__ = ["SHIPPED_WARM_START_DIR", "SFTConfig", "TrainConfig", "apply_overrides", "config_hash",
           "save_config", "to_yaml", "build_run", "config_from_dict", "config_to_dict",
           "evaluate_checkpoint", "load_checkpoint", "Run", "evaluate_policy", "get_preset",
           "load_config", "pass_at_k", "preset_names", "train", "Checkpoint", "CheckpointManager",
           "WarmStartConfig", "abstract_tree", "ensure_warm_start", "evaluate_warm_start",
           "latest_step", "load_model_params", "load_warm_start", "model_params", "read_metadata",
           "restore_checkpoint", "restore_model", "save_checkpoint", "train_sft",
           "warm_start"]  # fmt: skip
