"""`gac-jax export-hf`: a checkpoint's policy as a Hugging Face model directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from flax import nnx

from gac_jax import models
from gac_jax.train.config import TrainConfig
from gac_jax.train.run import load_checkpoint

# Files of a Hugging Face model directory that describe its tokenizer, copied on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILES += ("vocab.json", "merges.txt", "generation_config.json")


def export_checkpoint(
    config: TrainConfig,
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
) -> Path:
    """Writes a checkpoint's policy as a Hugging Face model directory (config.json and
    safetensors, `dtype` or the params' own), with the tokenizer files of `config.init`
    when it is a Hugging Face directory; returns `out_dir`. A LoRA run writes its merged
    weights (W + (alpha / r) A @ B), a plain model that loads without adapters."""
    run, _ = load_checkpoint(config, checkpoint_dir, step=step)
    model = nnx.merge(run.policy.graphdef, run.policy.params())  # A LoRA run's merged.
    out_dir = Path(out_dir)
    models.save_hf_checkpoint(model, out_dir, dtype=dtype)
    umask = os.umask(0)  # Read it (and put it back): safetensors writes its files 0600.
    os.umask(umask)
    for path in out_dir.glob("model*.safetensors"):
        path.chmod(0o666 & ~umask)  # Readable as the directory's other files are.
    source = Path(config.init)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
    return out_dir
