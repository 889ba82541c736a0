"""`gac-jax plan` compiles a run's learner step and sampler from abstract arrays and says
whether they fit, without creating a weight."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from gac_jax import models
from gac_jax.train.build import model_config
from gac_jax.train.cli import main
from gac_jax.train.config import TrainConfig, get_preset
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.plan import (
    CHEAP_CPU_COMPILE_FLAGS,
    PROBE_LAYERS,
    extrapolate_layers,
    plan,
    with_cheap_cpu_compiles,
)
from tests.conftest import process_env

SMALL = [
    "mesh.data=1",
    "mesh.fsdp=-1",
    "rollout.groups_per_batch=4",
    "rollout.groups_per_call=2",
    "generation.max_new_tokens=8",
]


@pytest.fixture(scope="module")
def small_demo():
    """The demo preset with `SMALL`, and its plan (shared: each plan traces and compiles
    both programs)."""
    config = apply_overrides(get_preset("demo"), SMALL)
    said = []
    report = plan(config, device_memory_gib=80, progress=said.append)
    return config, {**report, "said": said}


def test_the_report_has_both_programs_on_the_mesh(small_demo):
    config, report = small_demo
    assert report["devices"] == 8 and report["mesh"]["fsdp"] == 8
    learner, sampler = report["learner"], report["sampler"]
    width = config.generation.prompt_length + 8
    assert learner["batch"] == [4 * 8, width] and sampler["rows"] == 2 * 8
    for program in (learner, sampler):
        assert program["peak_gib"] > program["temp_gib"] > 0
    assert report["learner"]["tflops_per_step"] > 0 < report["sampler"]["tflops_loop_bodies_once"]
    # Params are sharded over fsdp=8: each device holds about an eighth (82,304 floats).
    assert learner["params_gib"] * 2**30 < 82_304 * 4 / 8 * 1.5
    assert learner["optimizer_gib"] > learner["params_gib"]  # Adam's two moments.
    assert report["fits"] and report["verdict"].startswith("fits: peak per device learner")


def test_each_part_is_named_as_it_starts_and_timed_when_done(small_demo):
    config, report = small_demo
    starts = [
        "building the run from abstract arrays (no weights)...",
        "compiling the learner step (32 x 40 tokens in 1 micro-batch(es))...",
        "compiling the sampler (16 rows of 32 + 8 tokens)...",
    ]
    assert report["said"][0::2] == starts
    for start, done in zip(starts, report["said"][1::2], strict=True):
        assert re.fullmatch(
            re.escape(re.split(r" \(| from", start)[0]) + r": done in \d+\.\d s", done
        )


def test_the_command_says_something_within_15_seconds():
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "gac_jax.train.cli", "plan", "--config", "demo"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=process_env(1),
    )
    try:
        first = child.stderr.readline()
        waited = time.monotonic() - started
    finally:
        child.kill()
        child.communicate()
    assert first.startswith("plan: ") and waited < 15, (first, waited)


@pytest.mark.parametrize(
    ("memory", "code", "word"), [("80", 0, "fits"), ("0.001", 1, "does NOT fit")]
)
def test_the_command_prints_json_and_a_verdict(capsys, memory, code, word):
    argv = ["plan", "--config", "demo", "--device-memory-gib", memory, "--set", *SMALL]
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert json.loads(out)["device_memory_gib"] == float(memory)
    assert word in err.strip().splitlines()[-1].split(":")[0]


def test_micro_batches_follow_the_token_budget():
    width = get_preset("demo").generation.prompt_length + 8
    budget = f"learner.max_tokens_per_micro_batch={width}"
    config = apply_overrides(get_preset("demo"), [*SMALL, budget])
    # 32 rows of `width` tokens on 8 devices: one row a device per micro-batch, so 4 of them.
    assert plan(config)["learner"]["micro_batches"] == 4


def test_the_step_flops_do_not_depend_on_the_micro_batches(small_demo):
    # XLA counts a loop's body once; the report multiplies it back to the whole step.
    config, one = small_demo
    # The default (None) splits only a step that runs on XLA:CPU; a plan is abstract.
    assert one["learner"]["micro_batches"] == 1 and config.learner.micro_batches is None
    four = plan(apply_overrides(config, ["learner.micro_batches=4"]), device_memory_gib=80)
    assert four["learner"]["micro_batches"] == 4
    flops = [report["learner"]["tflops_per_step"] for report in (one, four)]
    assert flops[1] == pytest.approx(flops[0], rel=0.15)


def test_a_preset_checkpoint_not_downloaded_is_planned_from_its_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # No checkpoints/Qwen3-0.6B here.
    config = get_preset("qwen3_0_6b_gsm8k")
    assert model_config(config) == models.get_config("qwen3_0_6b", remat="full")
    # The whole plan, on a model small enough to compile here (the check cannot compare
    # it with a checkpoint that is absent).
    report = plan(apply_overrides(config, [*SMALL, "model=tiny", "generation.prompt_length=64"]))
    assert report["parameters"] == 82_304 and report["fits"]


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_a_checkpoint_is_planned_in_its_own_dtype(tmp_path, stored):
    hf = models.config_to_hf(models.get_config("tiny"), dtype=stored)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = TrainConfig(task="arithmetic/add2", init=str(tmp_path))
    # As `load_hf_checkpoint` builds it: computing in the stored dtype, params in float32.
    assert (model_config(config).dtype, model_config(config).param_dtype) == (stored, "float32")
    bf16 = apply_overrides(config, ["compute.dtype=bfloat16"])
    assert model_config(bf16).dtype == "bfloat16"


def test_lora_and_split_devices_change_the_plan(small_demo):
    # `plan` builds the run `train` would: LoRA's frozen base and the learner's smaller mesh
    # once the rollout devices are taken are in its figures.
    base, plain = small_demo
    lora = plan(apply_overrides(base, ["lora.rank=8"]))
    split = plan(apply_overrides(base, ["placement.devices=4"]))
    assert lora["learner"]["optimizer_gib"] < plain["learner"]["optimizer_gib"]
    assert lora["learner"]["peak_gib"] != plain["learner"]["peak_gib"]
    assert split["devices"] == 4 and split["rollout_devices"] == 4 == plain["rollout_devices"] + 4
    assert split["learner"]["params_gib"] > plain["learner"]["params_gib"]  # fsdp 4, not 8.
    assert split["sampler"]["peak_gib"] != plain["sampler"]["peak_gib"]


def test_plan_compiles_without_llvm_optimisations_unless_the_user_set_them():
    assert with_cheap_cpu_compiles("") == " ".join(CHEAP_CPU_COMPILE_FLAGS)
    mine = "--xla_backend_optimization_level=2 --xla_cpu_foo=1"
    assert with_cheap_cpu_compiles(mine).split() == [
        *mine.split(),
        "--xla_llvm_disable_expensive_passes=true",
    ]
    once = with_cheap_cpu_compiles("")
    assert with_cheap_cpu_compiles(once) == once


def test_extrapolation_extends_the_line_through_the_probes_and_refuses_a_bend():
    def probe(layers, bend=0.0):
        return {"batch": [4, 8], "peak_gib": 2.0 + 0.5 * layers + bend, "temp_gib": 0.25 * layers}

    probes = [probe(n) for n in PROBE_LAYERS]
    out = extrapolate_layers(probes, 28)
    assert out["peak_gib"] == pytest.approx(16.0) and out["temp_gib"] == pytest.approx(7.0)
    assert out["batch"] == [4, 8] and out["extrapolated_from_layers"] == list(PROBE_LAYERS)
    bent = [probe(PROBE_LAYERS[0], bend=0.1), *probes[1:]]
    with pytest.raises(ValueError, match=r"peak_gib is not affine in the layers \(3.1000"):
        extrapolate_layers(bent, 28)
    moved = [{**probes[0], "batch": [4, 4]}, *probes[1:]]
    with pytest.raises(ValueError, match="batch changes with the layers"):
        extrapolate_layers(moved, 28)


@pytest.mark.parametrize("preset", ["qwen3_0_6b_gsm8k_1gpu", "qwen3_1_7b_gsm8k_1gpu_lora"])
def test_the_one_gpu_presets_fit_one_device_with_room_to_spare(tmp_path, preset):
    # As the README runs it (its checkpoint not downloaded: planned from the preset's
    # model), on one fake CPU device; the learner from its 2-, 3- and 4-layer compiles.
    # With XLA's own fusion emitters: the suite's older ones compile its small programs
    # faster but these 0.6B-wide ones slower (this 0.6B plan: 60 s against 109 s).
    env = process_env(None)
    older = "--xla_cpu_use_fusion_emitters=false"
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f != older)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gac_jax.train.cli",
            "plan",
            "--config",
            preset,
            "--extrapolate",
            "--set",
            f"compilation_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["devices"] == 1 and report["fits"]
    assert report["learner"]["extrapolated_from_layers"] == [2, 3, 4]
    # The README's bound: both programs under 64 GiB of an 80 GB device.
    assert max(report["learner"]["peak_gib"], report["sampler"]["peak_gib"]) <= 64
    # What the learner trains: all of Qwen3-0.6B, or the 1.7B model's rank-64 adapters.
    trained = {"qwen3_0_6b_gsm8k_1gpu": 596_049_920, "qwen3_1_7b_gsm8k_1gpu_lora": 69_730_304}
    assert report["parameters"] == trained[preset]
    assert done.stderr.strip().splitlines()[-1].startswith("fits: peak per device learner")
