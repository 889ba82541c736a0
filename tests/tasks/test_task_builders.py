"""The synthetic tfds builders: offline preparation, disjoint splits, determinism."""

import dataclasses
import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from gac_jax.tasks.arithmetic import scratchpad
from gac_jax.tasks.builders import (
    Arithmetic,
    ArithmeticConfig,
    Countdown,
    CountdownConfig,
    prepare_source,
)
from gac_jax.tasks.countdown import check_countdown


def _countdown_config(seed=1, name="tiny"):
    return CountdownConfig(
        name=name,
        num_numbers=3,
        max_number=10,
        min_target=1,
        max_target=40,
        min_used=2,
        num_train=300,
        num_test=60,
        seed=seed,
    )


def _arithmetic_config(seed=1, name="tiny_add", op="+", digits=2):
    return ArithmeticConfig(
        name=name, op=op, digits=digits, scratchpad=True, num_train=400, num_test=100, seed=seed
    )


def _as_python(example):
    out = {}
    for key, value in example.items():
        value = np.asarray(value)
        out[key] = value.tolist() if value.ndim else value.item()
    return out


def _read(builder_cls, config, data_dir):
    builder = builder_cls(config=config, data_dir=data_dir)
    return {
        split: [_as_python(ex) for ex in prepare_source(builder, split)]
        for split in ("train", "test")
    }


def _countdown_key(ex):
    return tuple(sorted(ex["numbers"])), ex["target"]


def _arithmetic_key(ex):
    a, b = ex["a"], ex["b"]
    return (min(a, b), max(a, b)) if ex["op"] in (b"+", b"*") else (a, b)


def test_countdown_prepares_offline_and_reads_back(tmp_path, no_network):
    with pytest.raises(OSError, match="disabled"):
        socket.create_connection(("example.com", 80), timeout=1)
    config = _countdown_config()
    data = _read(Countdown, config, tmp_path)
    assert len(data["train"]) == config.num_train
    assert len(data["test"]) == config.num_test
    assert list((tmp_path / "countdown" / "tiny" / "1.0.0").glob("*.array_record*"))
    for ex in data["train"] + data["test"]:
        assert len(ex["numbers"]) == 3
        assert all(1 <= n <= 10 for n in ex["numbers"])
        assert 1 <= ex["target"] <= 40
        assert ex["target"] not in ex["numbers"]
        assert check_countdown(ex["solution"], ex["numbers"], ex["target"]).correct


def test_arithmetic_prepares_offline_and_reads_back(tmp_path, no_network):
    config = _arithmetic_config(op="-", digits=3)
    data = _read(Arithmetic, config, tmp_path)
    assert (len(data["train"]), len(data["test"])) == (config.num_train, config.num_test)
    for ex in data["train"] + data["test"]:
        assert ex["op"] == b"-"
        assert 100 <= ex["b"] <= ex["a"] <= 999
        assert ex["answer"] == ex["a"] - ex["b"]
        assert ex["scratchpad"] == scratchpad(ex["a"], "-", ex["b"]).encode()


def test_preparing_an_embedded_task_says_so_in_one_line_and_no_download(tmp_path, capfd):
    _read(Arithmetic, _arithmetic_config(op="+", digits=2), tmp_path)
    out, err = capfd.readouterr()
    assert "Downloading and preparing" not in out + err
    assert "downloaded and prepared" not in out + err
    notes = [line for line in err.splitlines() if "preparing the embedded task data" in line]
    assert len(notes) == 1 and "nothing is downloaded" in notes[0]
    _read(Arithmetic, _arithmetic_config(op="+", digits=2), tmp_path)  # Prepared: silent.
    assert "preparing" not in "".join(capfd.readouterr())


@pytest.mark.parametrize(
    ("builder_cls", "make_config", "key"),
    [
        (Countdown, _countdown_config, _countdown_key),
        (Arithmetic, _arithmetic_config, _arithmetic_key),
    ],
    ids=["countdown", "arithmetic"],
)
def test_splits_are_disjoint_and_seeded(tmp_path, builder_cls, make_config, key):
    first = _read(builder_cls, make_config(seed=1), tmp_path / "a")
    again = _read(builder_cls, make_config(seed=1), tmp_path / "b")
    other = _read(builder_cls, make_config(seed=2), tmp_path / "c")

    train_keys = [key(ex) for ex in first["train"]]
    test_keys = [key(ex) for ex in first["test"]]
    assert len(set(train_keys)) == len(train_keys)  # no duplicates within a split
    assert len(set(test_keys)) == len(test_keys)
    assert not set(train_keys) & set(test_keys)  # no problem in both splits

    assert first == again  # same seed: identical data, in the same order
    assert first["test"] != other["test"]  # another seed: other problems
    assert first["train"] != other["train"]


def test_growing_train_keeps_the_test_split(tmp_path):
    small = _read(Countdown, _countdown_config(), tmp_path / "a")
    large = _read(
        Countdown, dataclasses.replace(_countdown_config(), num_train=500), tmp_path / "b"
    )
    assert large["test"] == small["test"]
    assert len(large["train"]) == 500


def test_too_many_problems_for_the_problem_space_is_an_error(tmp_path):
    # One-digit operands allow only 45 distinct sums.
    config = ArithmeticConfig(name="impossible", op="+", digits=1, num_train=50, num_test=10)
    with pytest.raises(ValueError, match="distinct problems"):
        Arithmetic(config=config, data_dir=tmp_path).download_and_prepare()


def test_unknown_split_is_an_error(tmp_path):
    builder = Arithmetic(config=_arithmetic_config(), data_dir=tmp_path)
    with pytest.raises(ValueError, match=r"Unknown split 'validation'.*\['test', 'train'\]"):
        prepare_source(builder, "validation")


def test_registered_configs():
    countdown = {c.name for c in Countdown.BUILDER_CONFIGS}
    assert {"n3_max20", "n4_max50", "n5_max100"} <= countdown
    arithmetic = {c.name for c in Arithmetic.BUILDER_CONFIGS}
    assert {"add2", "add3", "mul2", "mul2_scratch", "sub3_scratch"} <= arithmetic
    for config in Countdown.BUILDER_CONFIGS:
        assert 1 <= config.min_used <= config.num_numbers <= 5
        assert config.num_train > 0 and config.num_test > 0
    for config in Arithmetic.BUILDER_CONFIGS:
        assert config.scratchpad == config.name.endswith("_scratch")


def test_empty_split_is_an_error(tmp_path):
    config = dataclasses.replace(_arithmetic_config(), num_test=0)
    with pytest.raises(ValueError, match="num_train and num_test must be >= 1"):
        Arithmetic(config=config, data_dir=tmp_path).download_and_prepare()


def test_a_builder_made_before_another_prepared_the_data_reads_it(tmp_path):
    # A sweep's processes make their builders at once; the first to lock prepares the data.
    late = Countdown(config=_countdown_config(), data_dir=tmp_path)
    first = _read(Countdown, _countdown_config(), tmp_path)
    again = [_as_python(ex) for ex in prepare_source(late, "test")]
    assert again == first["test"]


_PREPARE = """
import json, sys
from gac_jax.tasks.builders import Countdown, CountdownConfig, prepare_source
config = CountdownConfig(name="tiny", num_numbers=3, max_number=10, min_target=1,
    max_target=40, min_used=2, num_train=300, num_test=60, seed=1)
source = prepare_source(Countdown(config=config, data_dir=sys.argv[1]), "train")
print(json.dumps([int(source[i]["target"]) for i in range(len(source))]))
"""


def test_processes_preparing_one_dataset_at_once_all_succeed(tmp_path):
    # Without the lock the second process to finish fails to rename its copy over the first.
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [child.communicate(timeout=240) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-2000:]
    targets = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert len(targets[0]) == 300 and targets[0] == targets[1] == targets[2]
