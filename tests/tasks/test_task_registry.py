"""The task registry: names, options, prompts, references and rewards end to end."""

import random
import string

import numpy as np
import pytest

from gac_jax.tasks import TASK_NAMES, Task, get_task
from gac_jax.tasks.builders import Arithmetic, Calculator, Countdown
from gac_jax.tasks.countdown import format_prompt, sample_problem

# The characters of the tiny models' character tokenizer that the embedded tasks may use.
_CHAR_VOCAB = set(string.digits + "+-*/=() " + string.ascii_letters + ",.:;?!<>_%^'\"\n")


def test_names_come_from_the_builder_configs():
    expected = {f"countdown/{c.name}" for c in Countdown.BUILDER_CONFIGS}
    expected |= {f"arithmetic/{c.name}" for c in Arithmetic.BUILDER_CONFIGS}
    expected |= {f"calculator/{c.name}" for c in Calculator.BUILDER_CONFIGS}
    expected.add("gsm8k")
    assert set(TASK_NAMES) == expected
    assert list(TASK_NAMES) == sorted(TASK_NAMES)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown task 'countdown/n9'.*countdown/n3_max20"):
        get_task("countdown/n9")


def test_unknown_or_invalid_option():
    with pytest.raises(ValueError, match=r"takes no option\(s\) \['format_score'\]"):
        get_task("arithmetic/add2", format_score=0.1)
    with pytest.raises(ValueError, match=r"format_score must be in \[0, 1\]"):
        get_task("countdown/n3_max20", format_score=2.0)


def test_countdown_task_on_a_hand_made_example():
    example = {
        "numbers": np.array([3, 5, 7], np.int32),
        "target": np.int32(22),
        "solution": b"5*3+7",
    }
    task = get_task("countdown/n3_max20")
    assert isinstance(task, Task)
    assert task.prompt(example) == "Use 3 5 7 to make 22: "
    assert task.reference_completion(example) == "5*3+7"
    assert task.reward("7+3*5 = 22", example) == 1.0
    assert task.reward("7+3*5+1", example) == 0.0
    scored = get_task("countdown/n3_max20", format_score=0.1)
    assert scored.reward("7+3*5+1", example) == 0.1
    assert scored.reward("seven", example) == 0.0


def test_arithmetic_task_on_a_hand_made_example():
    example = {"a": 37, "op": b"+", "b": 48, "answer": 85, "scratchpad": b"7+8=15;3+4+1=8;85"}
    plain, scratch = get_task("arithmetic/add2"), get_task("arithmetic/add2_scratch")
    assert plain.prompt(example) == scratch.prompt(example) == "37+48="
    assert plain.reference_completion(example) == "85"
    assert scratch.reference_completion(example) == "7+8=15;3+4+1=8;85"
    for task in (plain, scratch):
        assert task.reward("85", example) == 1.0
        assert task.reward("7+8=15;3+4+1=8;85", example) == 1.0
        assert task.reward("86", example) == 0.0


@pytest.mark.parametrize("name", ["arithmetic/add2_scratch", "arithmetic/mul2"])
def test_registered_task_end_to_end(tmp_path, no_network, name):
    task = get_task(name)
    test = task.data_source("test", data_dir=tmp_path)
    config = Arithmetic.builder_configs[name.split("/")[1]]
    assert len(test) == config.num_test
    assert len(task.data_source("train", data_dir=tmp_path)) == config.num_train
    for i in range(0, len(test), 7):
        example = test[i]
        prompt, reference = task.prompt(example), task.reference_completion(example)
        assert set(prompt + reference) <= _CHAR_VOCAB
        assert task.reward(reference, example) == 1.0
        assert task.reward(reference + "1", example) == 0.0


def test_registered_countdown_configs_give_plain_ascii_prompts():
    for config in Countdown.BUILDER_CONFIGS:
        problem = sample_problem(
            random.Random(0),
            num_numbers=config.num_numbers,
            min_number=config.min_number,
            max_number=config.max_number,
            min_target=config.min_target,
            max_target=config.max_target,
            min_used=config.min_used,
        )
        example = {
            "numbers": problem.numbers,
            "target": problem.target,
            "solution": problem.solution,
        }
        task = get_task(f"countdown/{config.name}")
        prompt = task.prompt(example)
        assert prompt == format_prompt(problem.numbers, problem.target)
        assert set(prompt + task.reference_completion(example)) <= _CHAR_VOCAB
        assert task.reward(task.reference_completion(example), example) == 1.0
