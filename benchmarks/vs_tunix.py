"""gac_jax versus Tunix: sampling and GRPO-training throughput on the same tiny Qwen3.

    python benchmarks/vs_tunix.py [--quick] [--rounds N] [--profile CALLS]

Tunix (`google-tunix`) is not a dependency of gac_jax. When it cannot be imported, the
script creates a separate virtual environment (`.venv-bench` at the repository root, or
`$GAC_JAX_BENCH_VENV`), installs this checkout (editable) and `google-tunix==0.1.7` into
it once, and re-runs itself there; the project's own `.venv` is never touched. Any
`python3 >= 3.11` can start it, so from a fresh clone the one command above is enough.

What runs, for two configurations in both libraries:

  small  4 layers, width 256, SwiGLU 768, 4 query heads of 64, 2 KV heads
  10M    6 layers, width 384, SwiGLU 1024, 6 query heads of 64, 2 KV heads

both with vocabulary 512, tied embeddings, RoPE theta 1e6 (Tunix's Qwen3 hard-codes it),
fp32 parameters and compute. gac_jax's randomly initialised model is written with
`save_hf_checkpoint` and Tunix loads that directory with its own safetensors loader
(`tunix.models.qwen3.params.create_model_from_safe_tensors`), so both hold the same
weights; the script checks that their logits agree and that greedy decoding gives the
same tokens before timing anything.

  (a) sampling: 64 prompts of 16 random tokens, 48 new tokens, temperature 1 (no top-k,
      no top-p), each library's own KV-cache sampler: `gac_jax.models.Sampler` (which
      also returns each token's log-probabilities under the sampling and the policy
      distribution) and `tunix.generate.sampler.Sampler` (strings in, token lists out,
      `top_p=1.0` so it samples instead of decoding greedily). Generated tokens = 64 x 48
      decode slots per call: both loops run until every row has ended, which with random
      weights never happens before step 48.
  (b) one GRPO training step on 64 sequences (8 groups of 8) of 16 prompt + 48 completion
      tokens: PPO-clip policy loss with clip 0.2, token-mean aggregation, no reference
      model, global-norm clip 1 then AdamW (lr 1e-4). gac_jax: `GRPOLearner.step`
      (advantages inside the step, metrics returned to the host; its chain also runs the
      gradient-alignment monitor, which gac_jax always has). Tunix: the jitted train step
      of `tunix.rl.trainer.Trainer` with `grpo_loss_fn` wired exactly as Tunix's
      `GRPOLearner.__init__` wires it (advantages from Tunix's "grpo" estimator, computed
      outside the step as Tunix does). Trained tokens = 64 x 64 per step. The two steps
      are checked to give the same loss and gradient norm on the first batch.
  (c) the same update with the batch split in SPLIT = 4 micro-batches of 16 sequences,
      each library's own gradient accumulation: gac_jax `LearnerConfig(micro_batches=4)`
      (one jitted step that accumulates over the four), Tunix
      `TrainingConfig(gradient_accumulation_steps=4)` (`optax.MultiSteps`: four jitted
      calls, the optimizer applied on the fourth). On XLA:CPU a program's temporaries are
      faulted in on every call, so a smaller step can be the faster one. The script checks
      that each split computes the whole batch's loss (token-mean, with equal token counts
      per micro-batch) and prints, beside the whole-batch ratio, the split's and the ratio
      of each library's fastest configuration within a round ((b), (c) or (d)).
  (d) each library's default configuration: gac_jax `LearnerConfig()`, which on XLA:CPU
      splits a step into micro-batches by its activations' size (here 8 of 8 sequences),
      against Tunix's default, the whole batch (its (b) step, timed again in the round).

Timing: after warm-up (compilation and two compiled calls per variant, excluded), every
round runs all four (library, task) pairs, alternating which library goes first, so
machine noise hits both. Per library the median time over rounds is printed; the ratio
reported last is the median over rounds of the ratio within each round (the two libraries
timed back to back), which cancels the machine's slower drifts. Each timed call
ends with its outputs on the host (gac_jax: `np.asarray` of the tokens / metrics as
floats; Tunix: its returned lists / `block_until_ready` of loss, aux and grad norm).

Each call's model FLOP/s is printed beside its time, as a fraction of the machine's matmul
rate (MFU; the peak is the fastest of three jitted 2048^2 fp32 matmuls a round, timed as
`learner.py` times it), with the rate gac_jax would need for 1.5x Tunix's median. The
FLOPs are `learner.py`'s accounting (`model_flops`), the same work for both libraries.

The last lines printed are the four ratios gac_jax / Tunix of tokens/s. With `--profile
CALLS`, each size also prints, after its timing, where each of the four calls' time goes
(`trace_profile.py`: its compiled ops and the host's time between them, from a
`jax.profiler` trace of CALLS calls).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TUNIX_REQUIREMENT = "google-tunix==0.1.7"
_CHILD_FLAG = "GAC_JAX_BENCH_CHILD"


def _ensure_tunix() -> None:
    """Re-executes this script inside a venv that has Tunix, creating it if needed."""
    try:
        import tunix  # noqa: F401

        import gac_jax  # noqa: F401

        return
    except ImportError:
        pass
    venv = Path(os.environ.get("GAC_JAX_BENCH_VENV", REPO / ".venv-bench"))
    if os.environ.get(_CHILD_FLAG):
        raise SystemExit(f"tunix or gac_jax is still not importable inside {venv}.")
    python = venv / "bin" / "python"
    stamp = venv / ".tunix-installed"
    if not python.exists():
        print(f"[vs_tunix] creating {venv} (Tunix lives there, not in .venv)", flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    if not stamp.exists():
        print(f"[vs_tunix] installing gac_jax (editable) + {TUNIX_REQUIREMENT}", flush=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.check_call([*pip, "--upgrade", "pip"])
        subprocess.check_call([*pip, "-e", str(REPO), TUNIX_REQUIREMENT])
        stamp.touch()
    os.environ[_CHILD_FLAG] = "1"
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


if __name__ == "__main__":
    _ensure_tunix()

# ruff: noqa: E402  (everything below needs the environment set up above)
import argparse
import logging
import statistics
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_models import EOS, PAD, SIZES, gac_config
from flax import nnx
from learner import PEAK_N, flops_per_token, make_peak, matmul_params

from gac_jax import models
from gac_jax.learner import (
    GRPOLearner,
    LearnerConfig,
    LossConfig,
    OptimizerConfig,
    TrainBatch,
    make_optimizer,
)
from gac_jax.rollout import Rollout, collate

BATCH, PROMPT, NEW = 64, 16, 48
GROUPS, GROUP_SIZE = 8, 8
LEARNING_RATE = 1e-4
CLIP_EPS = 0.2
GRAD_CLIP = 1.0
SPLIT = 4  # Micro-batches of the split train step, (c).


def tunix_config(cfg: models.ModelConfig):
    from tunix.models.qwen3 import model as tunix_qwen3

    return tunix_qwen3.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.embed_dim,
        hidden_dim=cfg.mlp_dim,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_word_embeddings,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )


class IdTokenizer:
    """Space-separated ids <-> token ids: what Tunix's string-in sampler needs."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


# ---------------------------------------------------------------------------------------
# The two models, same weights
# ---------------------------------------------------------------------------------------


def build_models(cfg: models.ModelConfig, ckpt_dir: str):
    """(gac_jax Decoder, Tunix Qwen3) holding the same weights, via an HF checkpoint."""
    from tunix.models.qwen3 import params as tunix_params

    gac_model = models.create_model(cfg, seed=0)
    models.save_hf_checkpoint(gac_model, ckpt_dir)
    tunix_model = tunix_params.create_model_from_safe_tensors(ckpt_dir, tunix_config(cfg))
    return gac_model, tunix_model


def check_same_model(gac_model, tunix_model, prompts: np.ndarray) -> float:
    """Largest |logit difference| of the two models on the prompts (teacher-forced)."""
    from tunix.generate import utils as tunix_utils

    tokens = jnp.asarray(prompts)
    mask = jnp.ones(tokens.shape, bool)
    gac_logits, _ = gac_model(tokens, None, mask)
    positions = tunix_utils.build_positions_from_mask(mask)
    attn = tunix_utils.make_causal_attn_mask(mask, tokens.shape[1])
    tunix_logits, _ = tunix_model(tokens, positions, None, attn)
    return float(jnp.max(jnp.abs(gac_logits - tunix_logits)))


# ---------------------------------------------------------------------------------------
# (a) Sampling
# ---------------------------------------------------------------------------------------


def make_samplers(cfg, gac_model, tunix_model, prompts: np.ndarray):
    """Two callables `seed -> [B, NEW] generated tokens on the host`, and a greedy check."""
    from tunix.generate import sampler as tunix_sampler

    gac = models.Sampler(cfg, max_new_tokens=NEW, eos_ids=EOS, pad_id=PAD)
    graphdef, state = nnx.split(gac_model)
    gac_tokens, gac_mask = jnp.asarray(prompts), jnp.ones(prompts.shape, bool)

    def gac_sample(seed: int, temperature: float = 1.0) -> np.ndarray:
        out = gac(
            graphdef, state, gac_tokens, gac_mask, jax.random.key(seed), temperature=temperature
        )
        return np.asarray(out.tokens)

    tunix = tunix_sampler.Sampler(
        tunix_model,
        IdTokenizer(),
        tunix_sampler.CacheConfig(
            cache_size=PROMPT + NEW,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        ),
    )
    strings = [" ".join(str(t) for t in row) for row in prompts]

    def tunix_sample(seed: int, temperature: float = 1.0):
        sampling = dict(temperature=temperature, top_p=1.0) if temperature > 0 else {}
        out = tunix(
            strings,
            max_generation_steps=NEW,
            max_prompt_length=PROMPT,
            eos_tokens=[EOS],
            seed=seed,
            **sampling,
        )
        return out.tokens

    def greedy_agreement() -> int:
        """Rows whose greedy completions (up to EOS) are identical in both libraries."""
        ours = gac_sample(0, temperature=0.0)
        theirs = tunix_sample(0, temperature=0.0)
        same = 0
        for row, their_row in zip(ours, theirs, strict=True):
            end = np.flatnonzero(row == EOS)
            row = row[: end[0]] if end.size else row  # Tunix drops the EOS token.
            same += np.array_equal(row, np.asarray(their_row)[: len(row)])
        return same

    return gac_sample, tunix_sample, greedy_agreement


# ---------------------------------------------------------------------------------------
# (b) One GRPO training step
# ---------------------------------------------------------------------------------------


def fake_rollouts(cfg, seed: int) -> list[Rollout]:
    """8 groups of 8 full-length completions with random tokens, behaviour log-probs near
    the uniform policy's and 0/1 rewards."""
    rng = np.random.default_rng(seed)
    v = cfg.vocab_size
    return [
        Rollout(
            prompt_id=i,
            group_id=i,
            prompt_tokens=rng.integers(3, v, PROMPT).astype(np.int32),
            completion_tokens=rng.integers(3, v, (GROUP_SIZE, NEW)).astype(np.int32),
            completion_mask=np.ones((GROUP_SIZE, NEW), bool),
            behaviour_logp=(np.log(1.0 / v) - 0.1 * rng.random((GROUP_SIZE, NEW))).astype(
                np.float32
            ),
            rewards=rng.integers(0, 2, GROUP_SIZE).astype(np.float32),
            policy_version=0,
        )
        for i in range(GROUPS)
    ]


def make_gac_trainer(gac_model, batch, micro_batches: int | None = 1):
    learner = GRPOLearner(
        gac_model,
        make_optimizer(OptimizerConfig(learning_rate=LEARNING_RATE, clip_norm=GRAD_CLIP)),
        models.make_mesh(),  # One CPU device; XLA's intra-op threads use both cores.
        loss=LossConfig(
            policy_loss="ppo",
            loss_kwargs=dict(eps_low=CLIP_EPS, eps_high=CLIP_EPS, aggregation="token-mean"),
            advantage="grpo",
        ),
        config=LearnerConfig(micro_batches=micro_batches),
    )
    placed = learner.place_batch(batch)
    version = [0]

    def step() -> dict[str, float]:
        version[0] += 1
        return learner.step(placed, version[0])

    return step


def make_tunix_trainer(tunix_model, batch, micro_batches: int = 1):
    """Tunix's RL actor trainer with its GRPO loss, as `tunix.rl.grpo.GRPOLearner` sets
    it up (minus rollout, reward and reference-model machinery). With `micro_batches` > 1
    a step is that many calls on slices of the batch, accumulated by Tunix's
    `gradient_accumulation_steps` (as its RL cluster derives it from a micro-batch size)."""
    from tunix.rl import algo_core
    from tunix.rl import common as tunix_common
    from tunix.rl import trainer as tunix_trainer
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    algo_config = grpo_learner.GRPOConfig(
        num_generations=GROUP_SIZE,
        num_iterations=1,
        beta=0.0,  # No reference model, no KL term.
        epsilon=CLIP_EPS,
        loss_agg_mode="token-mean",
    )
    algo_config.temperature = 1.0  # GRPOLearner copies it from the rollout config.
    trainer = tunix_trainer.Trainer(
        tunix_model,
        optax.chain(optax.clip_by_global_norm(GRAD_CLIP), optax.adamw(LEARNING_RATE)),
        peft_trainer.TrainingConfig(
            eval_every_n_steps=10**9,
            max_steps=10**9,
            gradient_accumulation_steps=micro_batches if micro_batches > 1 else None,
        ),
        custom_checkpoint_metadata_fn=lambda: {},
    )
    trainer.with_loss_fn(
        lambda model, train_example, algo_config: algo_core.grpo_loss_fn(
            model, train_example, algo_config=algo_config, pad_id=PAD, eos_id=EOS
        ),
        has_aux=True,
    )
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo_config})
    # `Trainer.train` uses cache_nnx_graph=True by default; so do we.
    train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

    tokens = np.asarray(batch.tokens)
    advantages = algo_core.compute_advantages(np.asarray(batch.rewards), GROUP_SIZE)
    rows = np.array_split(np.arange(BATCH), micro_batches)
    examples = [
        tunix_common.TrainExample(
            prompt_ids=jnp.asarray(tokens[r, :PROMPT]),
            prompt_mask=jnp.asarray(batch.attention_mask[r, :PROMPT]).astype(jnp.int32),
            completion_ids=jnp.asarray(tokens[r, PROMPT:]),
            completion_mask=jnp.asarray(batch.loss_mask[r, PROMPT:]).astype(jnp.int32),
            advantages=jnp.asarray(advantages[r], jnp.float32),
            ref_per_token_logps=None,
            old_per_token_logps=jnp.asarray(batch.behaviour_logp[r, PROMPT:]),
        )
        for r in rows
    ]

    def step() -> dict[str, float]:
        losses = []
        for example in examples:
            loss, aux, grad_norm = train_step(example)
            losses.append(loss)
        jax.block_until_ready((losses, aux, grad_norm))
        # Equal token counts per micro-batch: the mean of their token-means is the batch's.
        return {"loss": float(np.mean(losses)), "grad_norm": float(grad_norm)}

    return step


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def model_flops(cfg: models.ModelConfig) -> dict[str, float]:
    """Model FLOPs of one call of each task, PaLM's accounting as `learner.py` counts them
    (2 N_matmul a token forward, 6 N_matmul forward and backward, attention over the whole
    context, no causal discount): the GRPO step over 64 x 64 tokens; sampling's prefill of
    the prompts and one forward a new token at its position."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    n = matmul_params(cfg)
    prefill = BATCH * PROMPT * (2 * n + attention * PROMPT)
    decode = sum(BATCH * (2 * n + attention * (PROMPT + i + 1)) for i in range(NEW))
    return {
        "sample": float(prefill + decode),
        "train": flops_per_token(cfg, PROMPT + NEW) * BATCH * (PROMPT + NEW),
    }


TASKS = ("sample", "train", "split", "default")
LABELS = (
    ("sample", "sampling"),
    ("train", "GRPO train step"),
    ("split", f"train, split in {SPLIT}"),
    ("default", "train, each's default"),
    ("best", "train, each's fastest"),
)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench_size(
    name: str, size: dict, rounds: int, profile_calls: int = 0
) -> tuple[dict[str, dict[str, list[float]]], float]:
    """Seconds a call per task and library, each round's, and the matmul peak (FLOP/s)."""
    cfg = gac_config(size)
    rng = np.random.default_rng(1234)
    prompts = rng.integers(3, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    with tempfile.TemporaryDirectory() as ckpt:
        gac_sampling_model, tunix_sampling_model = build_models(cfg, ckpt)
        gac_training_model, tunix_training_model = build_models(cfg, ckpt)
        gac_split_model, tunix_split_model = build_models(cfg, ckpt)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(gac_sampling_model, nnx.Param)))
    logit_gap = check_same_model(gac_sampling_model, tunix_sampling_model, prompts)

    gac_sample, tunix_sample, greedy_agreement = make_samplers(
        cfg, gac_sampling_model, tunix_sampling_model, prompts
    )
    batch = TrainBatch(**collate(fake_rollouts(cfg, seed=0), PROMPT))
    gac_step = make_gac_trainer(gac_training_model, batch)
    tunix_step = make_tunix_trainer(tunix_training_model, batch)
    gac_split = make_gac_trainer(gac_split_model, batch, SPLIT)
    tunix_split = make_tunix_trainer(tunix_split_model, batch, SPLIT)
    gac_default = make_gac_trainer(models.create_model(cfg, seed=0), batch, None)

    # Warm-up: compile, then two compiled calls each. The first training step of each
    # library runs on identical weights and data, so loss and gradient norm must agree.
    first_gac, first_tunix = gac_step(), tunix_step()
    split_losses = gac_split()["loss"], tunix_split()["loss"]
    first_default = gac_default()
    agree = greedy_agreement()
    for _ in range(2):
        gac_sample(0), tunix_sample(0), gac_step(), tunix_step(), gac_split(), tunix_split()
        gac_default()

    print(
        f"\n{name}: {n_params / 1e6:.2f}M params (V={cfg.vocab_size} D={cfg.embed_dim} "
        f"L={cfg.num_layers} N={cfg.num_heads}x{cfg.head_dim} K={cfg.num_kv_heads} "
        f"F={cfg.mlp_dim}, tied, fp32)\n"
        f"  same model: max |logit gap| {logit_gap:.1e}; greedy 48-token completions "
        f"identical in {agree}/{BATCH} rows\n"
        f"  first train step: loss gac_jax {first_gac['loss']:+.6f} / Tunix "
        f"{first_tunix['loss']:+.6f}; grad norm {first_gac['grad_norm']:.6f} / "
        f"{first_tunix['grad_norm']:.6f}\n"
        f"  split in {SPLIT}, first step: loss gac_jax {split_losses[0]:+.6f} / Tunix "
        f"{split_losses[1]:+.6f}\n"
        f"  gac_jax's default: {first_default['micro_batches']:.0f} micro-batches on "
        f"{jax.default_backend()}, first step loss {first_default['loss']:+.6f}",
        flush=True,
    )

    times = {t: {"gac_jax": [], "tunix": []} for t in TASKS}
    # The machine's matmul rate, timed three times a round between the libraries' calls;
    # the fastest of all is the peak each call's model FLOP/s is compared with (its MFU).
    peak_timer, peak_times = make_peak(), []
    tasks = {
        ("sample", "gac_jax"): gac_sample,
        ("sample", "tunix"): tunix_sample,
        ("train", "gac_jax"): lambda _: gac_step(),
        ("train", "tunix"): lambda _: tunix_step(),
        ("split", "gac_jax"): lambda _: gac_split(),
        ("split", "tunix"): lambda _: tunix_split(),
        ("default", "gac_jax"): lambda _: gac_default(),
        ("default", "tunix"): lambda _: tunix_step(),  # Tunix's default: the whole batch.
    }
    for r in range(rounds):
        libs = ("gac_jax", "tunix") if r % 2 == 0 else ("tunix", "gac_jax")
        for task in TASKS:
            for lib in libs:
                times[task][lib].append(timed(tasks[task, lib], 1 + r))
        peak_times += [peak_timer() for _ in range(3)]
    if profile_calls:
        print_profiles(name, tasks, profile_calls)
    return times, 2 * PEAK_N**3 / min(peak_times)


def print_profiles(name: str, tasks, calls: int) -> None:
    """Each (task, library) call traced by `jax.profiler` (`trace_profile.py`): its
    compiled ops' time and the host's time between them, per call."""
    from trace_profile import TABLE_HEAD, format_profile, profile

    print(f"\n  {name}: profile, {calls} traced calls each (ms a call)\n{TABLE_HEAD}")
    for (task, lib), fn in tasks.items():
        print(format_profile(f"{name} {task} {lib}", profile(lambda fn=fn: fn(0), calls)))


def summarise(name: str, times, peak: float) -> dict[str, float]:
    tokens = {
        "sample": BATCH * NEW,
        "train": BATCH * (PROMPT + NEW),
        "split": BATCH * (PROMPT + NEW),
        "default": BATCH * (PROMPT + NEW),
    }
    label = {"sample": "generated", "train": "trained", "split": "trained", "default": "trained"}
    ratios = {}
    flops = model_flops(gac_config(SIZES[name]))
    flops["split"] = flops["default"] = flops["train"]
    print(
        f"  {name}: median over {len(times['sample']['gac_jax'])} rounds; matmul peak (a "
        f"jitted {PEAK_N}^2 fp32 matmul, the fastest of three a round) {peak / 1e9:.1f} GFLOP/s"
    )
    for task in TASKS:
        rates = {}
        for lib in ("gac_jax", "tunix"):
            t = times[task][lib]
            median = statistics.median(t)
            rates[lib] = tokens[task] / median
            achieved = flops[task] / median
            print(
                f"    {task:<6} {lib:<7} {1e3 * median:8.1f} ms (min {1e3 * min(t):.1f}, "
                f"max {1e3 * max(t):.1f})  {rates[lib]:8.0f} {label[task]} tokens/s  "
                f"{achieved / 1e9:6.1f} GFLOP/s, MFU {100 * achieved / peak:4.1f}%"
            )
        # Each round times both libraries back to back, so the ratio within a round sees
        # one state of the (shared, noisy) machine; its median is the headline figure.
        paired = [
            t_tunix / t_gac
            for t_gac, t_tunix in zip(times[task]["gac_jax"], times[task]["tunix"], strict=True)
        ]
        ratios[task] = (statistics.median(paired), min(paired), max(paired))
        goal = 1.5 * flops[task] / statistics.median(times[task]["tunix"])
        print(
            f"    {task:<6} 1.5x Tunix's median would be {goal / 1e9:.1f} GFLOP/s, MFU "
            f"{100 * goal / peak:.1f}% ({flops[task] / 1e9:.1f} GFLOP a call)"
        )
        print(
            f"    {task:<6} ratio of medians {rates['gac_jax'] / rates['tunix']:.2f}x; "
            f"per-round ratios median {ratios[task][0]:.2f}x "
            f"(range {ratios[task][1]:.2f}-{ratios[task][2]:.2f})"
        )
    # Each library's fastest way to make the update, chosen within each round.
    ways = ("train", "split", "default")
    best = [
        min(times[w]["tunix"][r] for w in ways) / min(times[w]["gac_jax"][r] for w in ways)
        for r in range(len(times["train"]["gac_jax"]))
    ]
    ratios["best"] = (statistics.median(best), min(best), max(best))
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed rounds instead of 10")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per size")
    parser.add_argument(
        "--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES), help="sizes to run"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="CALLS",
        help="after timing, trace CALLS calls of each and print where their time goes",
    )
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 10)

    warnings.filterwarnings("ignore")
    logging.getLogger("absl").setLevel(logging.ERROR)
    from importlib.metadata import version

    print(
        f"jax {jax.__version__}, flax {version('flax')}, optax {version('optax')}, "
        f"gac_jax {version('gac_jax')}, google-tunix {version('google-tunix')}; backend "
        f"{jax.default_backend()}, {jax.device_count()} device(s), {os.cpu_count()} CPU "
        f"core(s); {rounds} timed rounds per size, A/B order alternating"
    )
    print(
        f"(a) sampling: {BATCH} prompts x {PROMPT} tokens, {NEW} new tokens, temperature 1; "
        f"(b) GRPO step: {BATCH} x {PROMPT + NEW} tokens, PPO clip {CLIP_EPS}, no reference "
        f"model, clip-by-norm {GRAD_CLIP} + AdamW"
    )
    results = {name: bench_size(name, SIZES[name], rounds, args.profile) for name in args.sizes}
    print("\nThroughput")
    ratios = {name: summarise(name, *result) for name, result in results.items()}
    print(
        "\nRatios gac_jax / Tunix (tokens/s; >1 means gac_jax is faster): median over rounds "
        "of the ratio within each round"
    )
    for name, r in ratios.items():
        for task, label in LABELS:
            median, low, high = r[task]
            print(f"  {name:<5} {label:<22} {median:.2f}x  (range {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
