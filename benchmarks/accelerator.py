"""One command for an accelerator (issue #34): the learner's MFU, the sampler against its
bandwidth roofline, GAC + ESS against AdamW, and the compile time of each.

    python benchmarks/accelerator.py            # full shapes, on whatever backend JAX finds
    python benchmarks/accelerator.py --smoke    # tiny shapes, one round (CPU; a test runs it)

Writes ``--out`` (default ``benchmarks/results/accelerator``) ``.json`` and ``.md``: the
device, the commit and one row per measurement. What is measured, on one device:

  learner   `GRPOLearner.step` on a Qwen3-0.6B-shaped model (random weights, bf16 compute,
            fp32 params), the preset `qwen3_0_6b_gsm8k`'s sequence (256 + 512 tokens),
            chunked log-probs (chunks of 128) and full remat, as the preset runs it.
            Tokens/s and MFU: model FLOPs (PaLM's accounting: 6 x matmul params + the
            attention term, no remat, no causal discount; `benchmarks/learner.py`) per
            second over the chip's dense bf16 peak (`PEAKS`).
  sampler   `models.Sampler` decoding `--decode-tokens` new tokens for batches of 64 and
            256 prompts of 256 tokens (bf16 params), generated tokens/s against the
            roofline of decoding: every step reads the weights and the KV cache once, so
            tokens/s <= batch x bandwidth / (weight bytes + mean KV bytes).
  update    the optimizer half of a step (update + apply, params and state donated, as
            `benchmarks/transforms.py`) on 0.6B-sized fp32 params: optax.adamw against
            chain(GAC, AdamW, ESS scaling), as a time ratio.

Compile time is the first call's wall time less one timed call. On CPU there is no bf16
peak or HBM bandwidth to compare with: the peak is a timed 2048^2 fp32 matmul and the
bandwidth a timed copy of 256 MiB, and `--smoke` shrinks every shape so the whole script
runs in about a minute.

On the accelerator machine (no network; its image has JAX with CUDA, flax, optax, orbax,
chex and most of the rest): `benchmarks/accelerator_wheels.sh` here builds the wheels it
lacks into `.accelerator-wheels/`; carry that folder, install them with `--no-index`, then
`make bench-accelerator ACCEL_PYTHON=python3` runs this script and `real_shapes.py` (the
one-GPU preset's own steps) with this tree on the path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from learner import flops_per_token
from transforms import make_step

from gac_jax import models
from gac_jax.learner import (
    GRPOLearner,
    LearnerConfig,
    OptimizerConfig,
    TrainBatch,
    make_optimizer,
)
from gac_jax.rollout import Rollout, collate
from gac_jax.transforms import ESSConfig, GACConfig

# Dense bf16 FLOP/s and memory bandwidth (bytes/s) by device kind, from the vendors' data
# sheets (SXM parts; the first match in order wins). JAX names TPU v5e "TPU v5 lite", v5p
# "TPU v5" and v6e "TPU v6 lite".
PEAKS = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.0e12),
    ("L4", 121e12, 0.3e12),
    ("TPU v6", 918e12, 1.64e12),
    ("TPU v5 lite", 197e12, 0.82e12),
    ("TPU v5", 459e12, 2.76e12),
    ("TPU v4", 275e12, 1.2e12),
)
FULL = dict(model="qwen3_0_6b", prompt=256, completion=512, rows=8, chunk=128, remat="full")
FULL_DECODE = dict(batches=(64, 256), prompt=256, new=128)
SMOKE_MODEL = dict(num_layers=2, embed_dim=128, mlp_dim=256, num_heads=2, num_kv_heads=1)
SMOKE = dict(model="tiny", prompt=16, completion=16, rows=4, chunk=16, remat="full")
SMOKE_DECODE = dict(batches=(4, 8), prompt=16, new=8)


@functools.cache
def device_peaks() -> tuple[str, float, float, str]:
    """(device kind, peak FLOP/s, bandwidth bytes/s, where they come from): the data sheet's
    of a known kind, else timed here (once a process)."""
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    for name, flops, bandwidth in PEAKS:
        if name.lower() in kind.lower():
            return kind, flops, bandwidth, "data sheet (dense bf16)"
    unknown = "" if device.platform == "cpu" else f"unknown device kind {kind!r}: "
    source = f"{unknown}measured here (fp32 matmul, copy)"
    return kind, _measured_matmul_peak(), _measured_bandwidth(), source


def _best_time(fn, repeats: int = 5) -> float:
    fn()  # Compile.
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def _measured_matmul_peak(n: int = 2048) -> float:
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 / _best_time(lambda: matmul(a, a))


def _measured_bandwidth(nbytes: int = 256 << 20) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    return 2 * nbytes / _best_time(lambda: copy(x))  # Read once, write once.


def model_config(shape: dict, param_dtype: str) -> models.ModelConfig:
    """The benchmark's model: a Qwen3-0.6B-shaped one, or a tiny one under --smoke."""
    extra = SMOKE_MODEL if shape["model"] == "tiny" else {}
    if "scan_layers" in shape:
        extra = {**extra, "scan_layers": shape["scan_layers"]}
    return models.get_config(
        shape["model"], dtype="bfloat16", param_dtype=param_dtype, remat=shape["remat"], **extra
    )


def random_batch(config: models.ModelConfig, shape: dict, seed: int) -> TrainBatch:
    rng = np.random.default_rng(seed)
    rows, prompt, completion = shape["rows"], shape["prompt"], shape["completion"]
    rollouts = [
        Rollout(
            prompt_id=i,
            group_id=i,
            prompt_tokens=rng.integers(3, config.vocab_size, prompt).astype(np.int32),
            completion_tokens=rng.integers(3, config.vocab_size, (2, completion)).astype(np.int32),
            completion_mask=np.ones((2, completion), bool),
            behaviour_logp=np.full((2, completion), -np.log(config.vocab_size), np.float32),
            rewards=np.array([0.0, 1.0], np.float32),
            policy_version=0,
        )
        for i in range(rows // 2)
    ]
    return TrainBatch(**collate(rollouts, prompt))


def bench_learner(shape: dict, rounds: int, peak: float) -> dict:
    config = model_config(shape, "float32")
    learner = GRPOLearner(
        models.create_model(config, seed=0),
        make_optimizer(OptimizerConfig(learning_rate=1e-6)),
        models.make_mesh(),
        config=LearnerConfig(logits_chunk_size=shape["chunk"]),
    )
    batches = [random_batch(config, shape, seed) for seed in range(2)]
    start = time.perf_counter()
    learner.step(batches[0], 0)
    first = time.perf_counter() - start
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        learner.step(batches[(r + 1) % 2], r + 1)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    seq = shape["prompt"] + shape["completion"]
    tokens = shape["rows"] * seq
    achieved = flops_per_token(config, seq) * tokens / seconds
    return {
        "what": f"learner step, {shape['model']}, {shape['rows']} x {seq} tokens, bf16, "
        f"remat {shape['remat']}, logits chunks {shape['chunk']}",
        "step_ms": 1e3 * seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": achieved / peak,
        "compile_s": first - seconds,
    }


def bench_sampler(decode: dict, shape: dict, rounds: int, bandwidth: float) -> list[dict]:
    config = model_config(shape, "bfloat16")
    graphdef, state = nnx.split(models.create_model(config, seed=0))
    rows = []
    for batch in decode["batches"]:
        prompts = np.random.default_rng(batch).integers(
            3, config.vocab_size, (batch, decode["prompt"]), dtype=np.int32
        )
        mask = np.ones(prompts.shape, bool)
        # The last id as EOS: a random model draws it about once in a vocabulary's worth of
        # tokens, so nearly every step decodes the full batch (generated tokens counted).
        eos = config.vocab_size - 1
        sampler = models.Sampler(config, max_new_tokens=decode["new"], eos_ids=eos, pad_id=0)

        def call(seed, sampler=sampler, prompts=prompts, mask=mask):
            return jax.device_get(sampler(graphdef, state, prompts, mask, jax.random.key(seed)))

        start = time.perf_counter()
        call(0)
        first = time.perf_counter() - start
        times, generated = [], 0
        for r in range(rounds):
            start = time.perf_counter()
            out = call(r + 1)
            times.append(time.perf_counter() - start)
            generated = int(np.sum(out.lengths))
        seconds = statistics.median(times)
        mean_context = decode["prompt"] + decode["new"] / 2
        roofline = decode_roofline(config, state, batch, mean_context, bandwidth)
        rate = generated / seconds
        rows.append(
            {
                "what": f"sampler, batch {batch}, {decode['prompt']} + {decode['new']} tokens",
                "tokens_per_s": rate,
                "roofline_tokens_per_s": roofline,
                "fraction_of_roofline": rate / roofline,
                "compile_s": first - seconds,
            }
        )
        print(f"sampler row: {json.dumps(rows[-1])}", flush=True)
    return rows


def decode_roofline(config, params, batch: int, context: float, bandwidth: float) -> float:
    """Tokens/s of decoding `batch` rows at a mean `context` if each step read only the
    weights `params` (as the sampler holds them) and the rows' KV caches (bf16), once."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * context
    return batch * bandwidth / (weight_bytes + kv_bytes * batch)


def bench_update(shape: dict, rounds: int) -> dict:
    config = model_config(shape, "float32")
    params = nnx.state(models.create_model(config, seed=0), nnx.Param).to_pure_dict()
    grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    log_w = jnp.zeros((8,), jnp.float32)
    chains = {
        "adamw": make_optimizer(OptimizerConfig(learning_rate=1e-6, clip_norm=None)),
        "gac+adamw+ess": make_optimizer(
            OptimizerConfig(learning_rate=1e-6, clip_norm=None),
            gac=GACConfig(tau_low=0.2, tau_high=0.8),
            ess=ESSConfig(),
        ),
    }
    steps, times, compile_s = {}, {name: [] for name in chains}, {}
    for name, tx in chains.items():
        state = jax.tree.map(jnp.copy, tx.init(params))  # Distinct buffers to donate.
        step, split, _ = make_step(tx, state, donate_reference=False)
        p = jax.tree.map(jnp.copy, params)
        donated, kept = split(state)
        start = time.perf_counter()
        p, donated, kept = jax.block_until_ready(step(p, donated, kept, grads, log_w))
        compile_s[name] = time.perf_counter() - start
        steps[name] = [step, p, donated, kept]
    for _ in range(rounds):  # Interleaved: noise hits both.
        for name, entry in steps.items():
            step, p, donated, kept = entry
            start = time.perf_counter()
            entry[1:] = jax.block_until_ready(step(p, donated, kept, grads, log_w))
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    n = sum(x.size for x in jax.tree.leaves(params))
    return {
        "what": f"optimizer update on {n / 1e6:.3g}M fp32 params",
        "adamw_ms": 1e3 * medians["adamw"],
        "gac_ess_ms": 1e3 * medians["gac+adamw+ess"],
        "gac_ess_added_over_adamw": medians["gac+adamw+ess"] / medians["adamw"] - 1.0,
        "compile_s": compile_s["gac+adamw+ess"] - medians["gac+adamw+ess"],  # The larger one.
    }


def _commit() -> str:
    """The tree's commit: `GAC_JAX_COMMIT` where the tree travelled without its git history
    (the accelerator machine gets a copy of the files), else `git rev-parse`."""
    if os.environ.get("GAC_JAX_COMMIT"):
        return os.environ["GAC_JAX_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:  # No git on the machine.
        return "unknown"
    return done.stdout.strip() or "unknown"


def markdown(result: dict) -> str:
    head = (
        f"Device: {result['device']} ({result['backend']}), peaks {result['peak_source']}: "
        f"{result['peak_flops'] / 1e12:.1f} TFLOP/s, {result['bandwidth'] / 1e9:.0f} GB/s. "
        f"Commit {result['commit']}, `{result['command']}`.\n\n"
    )
    lines = ["| measurement | figure | against | compile s |", "|---|---|---|---|"]
    learner = result.get("learner")
    if learner:
        lines.append(
            f"| {learner['what']} | {learner['tokens_per_s']:.0f} tokens/s "
            f"({learner['step_ms']:.1f} ms) | MFU {100 * learner['mfu']:.1f}% | "
            f"{learner['compile_s']:.1f} |"
        )
    for row in result.get("sampler", ()):
        lines.append(
            f"| {row['what']} | {row['tokens_per_s']:.0f} tokens/s | "
            f"{100 * row['fraction_of_roofline']:.1f}% of the bandwidth roofline "
            f"({row['roofline_tokens_per_s']:.0f}) | {row['compile_s']:.1f} |"
        )
    update = result.get("update")
    if update:
        lines.append(
            f"| {update['what']} | GAC + ESS {update['gac_ess_ms']:.2f} ms | AdamW "
            f"{update['adamw_ms']:.2f} ms: {100 * update['gac_ess_added_over_adamw']:+.0f}% | "
            f"{update['compile_s']:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--out", default="benchmarks/results/accelerator", help="path stem")
    parser.add_argument(
        "--parts", default="learner,sampler,update", help="which measurements, in this order"
    )
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"learner", "sampler", "update"})
    if unknown:
        parser.error(f"--parts={args.parts}: unknown {unknown}; expected learner, sampler, update")
    shape, decode = (SMOKE, SMOKE_DECODE) if args.smoke else (FULL, FULL_DECODE)
    rounds = args.rounds or (1 if args.smoke else 5)
    kind, peak, bandwidth, source = device_peaks()
    print(f"device {kind}: peak {peak / 1e12:.1f} TFLOP/s, {bandwidth / 1e9:.0f} GB/s ({source})")
    result = {
        "device": kind,
        "backend": jax.default_backend(),
        "peak_flops": peak,
        "bandwidth": bandwidth,
        "peak_source": source,
        "commit": _commit(),
        "command": "python benchmarks/accelerator.py" + (" --smoke" if args.smoke else ""),
    }
    # Each part printed as it ends, so that a run cut off by a time limit keeps what it did.
    measures = {
        "learner": lambda: bench_learner(shape, rounds, peak),
        "sampler": lambda: bench_sampler(decode, shape, rounds, bandwidth),
        "update": lambda: bench_update(shape, max(rounds, 3)),
    }
    for part in parts:
        result[part] = measures[part]()
        print(f"{part}: {json.dumps(result[part])}", flush=True)
    write_result(Path(args.out), result, markdown(result))
    return result


def write_result(out: Path, result: dict, table: str, show: bool = True) -> None:
    """`out`.json (the figures) and `out`.md (their table), and the table printed (`show`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    out.with_suffix(".md").write_text(table)
    if show:
        print(table)


if __name__ == "__main__":
    sys.exit(main() and 0)
