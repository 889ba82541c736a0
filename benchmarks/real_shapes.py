"""The one-accelerator presets at their real shapes, with random weights (issue #42): a few
training steps of `qwen3_0_6b_gsm8k_1gpu` (or `--preset`), their speed and peak memory
against what `gac-jax plan` predicts for the same run on the same device.

    python benchmarks/real_shapes.py                  # the 0.6B preset, 3 timed steps
    python benchmarks/real_shapes.py --preset qwen3_1_7b_gsm8k_1gpu_lora
    python benchmarks/real_shapes.py --smoke          # a tiny Qwen3 on CPU (a test runs it)

No download is possible on the accelerator machine, so the script writes what `hf download`
and GSM8K's release files would leave, in a temporary directory:

  weights    a Qwen3 checkpoint directory of the preset's architecture with random weights
             (`models.save_hf_checkpoint`, bf16), where the preset's `init` points;
  tokenizer  a byte-level BPE trained on the problems below (a few thousand ids, not
             Qwen's 151,669: the model's vocabulary and so every shape is Qwen3's; ids past
             the tokenizer's decode to nothing, as padded rows of Qwen's do), with a chat
             template of Qwen3's shape and `<|im_end|>` as EOS;
  data       GSM8K-shaped problems (a question of about 60 words, `#### N` answers).

Then, in this process: `plan` (compiled for this backend: its peaks and FLOPs), and
`train` of `--steps` + 1 steps with the preset's batch (32 groups of 8, prompts of 256 and
up to 512 new tokens: a random model rarely draws EOS, so completions run to the limit,
the preset's widest batch). The first step compiles; the others are timed. Reported:
seconds a step, generated tokens/s, trained tokens/s (prompt + completion, PaLM FLOPs over
the chip's peak as MFU), and the device's peak bytes in use (`memory_stats`, where the
backend gives one) against plan's peaks.

Writes ``--out`` (default ``benchmarks/results/real_shapes``) ``.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from accelerator import _commit, device_peaks, write_result
from learner import flops_per_token

from gac_jax import models
from gac_jax.tasks.gsm8k import gsm8k_manual_dir
from gac_jax.train import apply_overrides, get_preset, train
from gac_jax.train.metrics import read_metrics
from gac_jax.train.plan import GIB, plan

# Qwen3's chat template, cut to what a single-turn prompt uses (thinking switch included).
QWEN3_SHAPED_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking "
    "is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The runs' settings besides the preset's: no evaluation or checkpoint inside the timed steps.
QUIET = ("eval_at_start=false", "eval_every=0", "checkpoint_every=0", "samples_every=0")
# --smoke: the preset's run on a tiny Qwen3 (the `tiny` architecture) with a small batch.
SMOKE = (
    "model=tiny",
    "rollout.groups_per_batch=2",
    "generation.group_size=2",
    "generation.prompt_length=512",  # A 120-id BPE is near byte-level: long prompts.
    "generation.max_new_tokens=8",
    "generation.slots=4",
    "learner.max_tokens_per_micro_batch=1024",
)
NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Goro", "Hana", "Ivan", "Jude")
ITEMS = ("apples", "pencils", "stamps", "marbles", "books", "cookies", "shells", "cards")


def gsm8k_shaped_problems(count: int, seed: int) -> list[dict]:
    """`count` problems in GSM8K's release format, about as long as its questions."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        name, friend = rng.choice(NAMES, 2, replace=False)
        item = rng.choice(ITEMS)
        a, b, c, d = (int(x) for x in rng.integers(2, 60, 4))
        question = (
            f"{name} has {a} {item} in a box at home. On Monday {name} buys {b} more {item} "
            f"at the market, and on Tuesday {friend} gives {name} {c} {item} as a present. "
            f"On Wednesday {name} gives away {d} {item} to the children next door, and then "
            f"counts what is left in the box before going to bed. How many {item} does "
            f"{name} have in the box at the end of Wednesday?"
        )
        total = a + b + c - d
        rows.append({"question": question, "answer": f"{a}+{b}+{c}-{d}={total}\n#### {total}"})
    return rows


def write_data(data_dir: Path, seed: int = 0) -> list[dict]:
    """GSM8K's release files where the task reads them offline; returns the train rows."""
    manual = gsm8k_manual_dir(str(data_dir))
    manual.mkdir(parents=True, exist_ok=True)
    train_rows = gsm8k_shaped_problems(512, seed)
    for name, rows in (("train.jsonl", train_rows), ("test.jsonl", train_rows[:64])):
        (manual / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train_rows


def write_tokenizer(path: Path, texts: list[str], vocab_size: int) -> None:
    """A byte-level BPE `tokenizer.json` and a `tokenizer_config.json` with the template."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte, so any text encodes; `tiny`'s 128 ids leave room for the texts' alone.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if vocab_size > 256 else [],
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": QWEN3_SHAPED_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_checkpoint(path: Path, model_name: str, texts: list[str]) -> models.ModelConfig:
    """A Qwen3 checkpoint directory of `model_name`'s architecture, random bf16 weights."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = 120 if model_name == "tiny" else 4096  # `tiny` has 128 ids in all.
    write_tokenizer(path, texts, vocab)
    config = models.get_config(model_name)
    model = models.create_model(config, seed=0)
    models.save_hf_checkpoint(model, path, dtype="bfloat16")
    del model
    return config


def peak_bytes_in_use() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / GIB


def prepare(preset: str, steps: int, smoke: bool, work: Path):
    """(config, model config) of `preset` for `steps` + 1 steps, with GSM8K-shaped data and
    a random checkpoint of its architecture written under `work`, and a compilation cache
    of its own there (the preset's is the user's): every compile measured cold."""
    base = get_preset(preset, validate=False)
    data_dir = work / "tfds"
    rows = write_data(data_dir)
    overrides = [*QUIET, f"data_dir={data_dir}", f"steps={steps + 1}", *(SMOKE if smoke else ())]
    overrides.append(f"compilation_cache={work / 'xla'}")
    config = apply_overrides(base, overrides)
    texts = [r["question"] + " " + r["answer"] for r in rows] + [config.system_prompt or ""]
    checkpoint = work / "checkpoint"
    model_config = write_checkpoint(checkpoint, config.model, texts)
    config = apply_overrides(config, [f"init={checkpoint}"])
    config.validate()
    return config, model_config


def measure(preset: str, steps: int, smoke: bool, work: Path, on_partial=print) -> dict:
    config, model_config = prepare(preset, steps, smoke, work)
    # The run first, then `plan`: on an accelerator both compile for minutes, and a call cut
    # off by its time limit keeps the run's figures (written before `plan` starts).
    started = time.perf_counter()
    train(config, work / "run")
    train_seconds = time.perf_counter() - started
    records = read_metrics(work / "run" / "metrics.jsonl")[1:]  # The first step compiles.
    result = summarize(config, model_config, train_seconds, records)
    result["measured_peak_gib"] = peak_bytes_in_use()  # The run's, before plan compiles.
    on_partial(result)
    result.update(plan_figures(config))
    return result


def plan_figures(config) -> dict:
    """`plan` of `config` on this backend: its peaks, FLOPs and seconds."""
    started = time.perf_counter()
    predicted = plan(config)
    return dict(
        plan_learner_peak_gib=predicted["learner"]["peak_gib"],
        plan_sampler_peak_gib=predicted["sampler"]["peak_gib"],
        plan_tflops_per_step=predicted["learner"]["tflops_per_step"],
        plan_seconds=time.perf_counter() - started,
    )


def summarize(config, model_config, train_seconds, records) -> dict:
    kind, peak_flops, _, source = device_peaks()
    g = config.generation
    # A synchronous step: waiting for its batch (sampling) then the learner's update.
    step = statistics.median(r["wait_seconds"] + r["train_seconds"] for r in records)
    width = g.prompt_length + g.max_new_tokens
    tokens = config.batch_size * width  # Padded to the widest: as the learner computes.
    flops = flops_per_token(model_config, width) * tokens
    return {
        "preset": config_name(config),
        "device": kind,
        "backend": jax.default_backend(),
        "peak_source": source,
        "commit": _commit(),
        "batch": [config.batch_size, width],
        "timed_steps": len(records),
        "step_seconds": step,
        "generate_tokens_per_s": statistics.median(r["generate_tokens_per_s"] for r in records),
        "learner_seconds": statistics.median(r["train_seconds"] for r in records),
        "learner_mfu": flops / statistics.median(r["train_seconds"] for r in records) / peak_flops,
        "generated_tokens": statistics.median(r["generated_tokens"] for r in records),
        "train_seconds": train_seconds,
    }


def config_name(config) -> str:
    return f"{config.model}, {config.task}, {config.rollout.mode}, lora rank {config.lora.rank}"


def markdown(result: dict) -> str:
    measured = result["measured_peak_gib"]
    memory = "not reported by this backend" if measured is None else f"{measured:.1f} GiB"
    rows, width = result["batch"]
    if "plan_seconds" in result:
        planned = (
            f"; plan: learner {result['plan_learner_peak_gib']:.3g} GiB, "
            f"sampler {result['plan_sampler_peak_gib']:.3g} GiB"
        )
        plan_row = (
            f"{result['plan_seconds']:.0f} s; {result['plan_tflops_per_step']:.3g} TFLOPs a step"
        )
    else:
        planned, plan_row = "", "not finished (the run's figures were written before it began)"
    return (
        f"Real shapes ({result['preset']}), random weights, on {result['device']} "
        f"({result['backend']}); commit {result['commit']}, `{result['command']}`.\n\n"
        "| measurement | figure |\n|---|---|\n"
        f"| batch | {rows} rows x {width} tokens; {result['timed_steps']} steps timed |\n"
        f"| step (sampling + learner) | {result['step_seconds']:.2f} s |\n"
        f"| sampling | {result['generate_tokens_per_s']:.0f} generated tokens/s "
        f"({result['generated_tokens']:.0f} a step) |\n"
        f"| learner | {result['learner_seconds']:.2f} s, MFU "
        f"{100 * result['learner_mfu']:.1f}% (peaks {result['peak_source']}) |\n"
        f"| peak memory | {memory}{planned} |\n"
        f"| train, all {result['timed_steps'] + 1} steps | {result['train_seconds']:.0f} s |\n"
        f"| plan | {plan_row} |\n"
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3_0_6b_gsm8k_1gpu", help="a one-GPU preset")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (one more compiles)")
    parser.add_argument("--smoke", action="store_true", help="a tiny Qwen3, on CPU")
    parser.add_argument("--out", default="benchmarks/results/real_shapes", help="path stem")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps}: expected at least 1 timed step")
    command = "python benchmarks/real_shapes.py " + " ".join(argv or sys.argv[1:])

    def write(result: dict) -> None:
        result["command"] = command
        write_result(Path(args.out), result, markdown(result))

    with tempfile.TemporaryDirectory(prefix="real_shapes_") as work:
        result = measure(args.preset, args.steps, args.smoke, Path(work), on_partial=write)
    write(result)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
