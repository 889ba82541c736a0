"""`TrainConfig.compilation_cache`: a run's programs kept on disk and read back by the next
process that compiles them (JAX's persistent compilation cache)."""

import dataclasses
import subprocess
import sys

import pytest

from gac_jax.train import TrainConfig, get_preset
from tests.conftest import process_env

TINY_PLAN = [
    "init=random",
    "task=arithmetic/add2",
    "rollout.groups_per_batch=2",
    "rollout.groups_per_call=2",
    "generation.group_size=2",
]


def _plan(cache, cwd) -> None:
    env = process_env(1)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # The suite's own: the field must set it.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gac_jax.train.cli",
            "plan",
            "--set",
            *TINY_PLAN,
            f"compilation_cache={cache}",
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _entries(cache) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}


@pytest.mark.slow
def test_a_second_process_reads_the_programs_the_first_compiled(tmp_path):
    cache = tmp_path / "a" / "xla"  # Created by the run.
    _plan(cache, tmp_path)
    written = _entries(cache)
    # The learner step and the sampler, each compiled once.
    assert any(n.startswith("jit_split_step-") for n in written), written
    assert any(n.startswith("jit__sample-") for n in written), written
    _plan(cache, tmp_path)
    # A miss compiles and writes its entry again; every program was read back instead.
    assert _entries(cache) == written


def test_the_real_hardware_presets_keep_their_programs_in_the_users_cache(monkeypatch):
    from gac_jax.train import config

    monkeypatch.setattr(config, "REAL_HARDWARE_COMPILATION_CACHE", "~/.cache/gac_jax/xla")
    for name in ("qwen3_0_6b_gsm8k", "qwen3_0_6b_gsm8k_1gpu", "qwen3_1_7b_gsm8k_1gpu_lora"):
        assert get_preset(name, validate=False).compilation_cache == "~/.cache/gac_jax/xla"
    assert TrainConfig().compilation_cache is None  # JAX's own setting unless asked.


@pytest.mark.parametrize("bad", ["", 3])
def test_a_bad_cache_directory_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^compilation_cache=.* must be a non-empty string"):
        dataclasses.replace(TrainConfig(), compilation_cache=bad).validate()
