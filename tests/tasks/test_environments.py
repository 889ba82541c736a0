"""The calculator task and the guard every environment step runs under."""

import random
import time

import numpy as np
import pytest

from gac_jax.tasks import get_task
from gac_jax.tasks.calculator import Calculator, calculator_reward, evaluate, sample_problem
from gac_jax.tasks.environments import GuardedEnvironment, Observation, resolve_environment


def _example(p):
    return {"a": p.a, "b": p.b, "op": p.op, "c": p.c, "answer": p.answer}


def test_the_reference_transcript_is_what_the_calculator_answers_and_scores_one():
    env, rng = Calculator(), random.Random(0)
    task = get_task("calculator/muladd")
    for _ in range(200):
        example = _example(sample_problem(rng))
        turns = task.reference_turns(example)
        transcript = ""
        for role, text in turns:
            if role == "tool":  # The environment, asked with the policy's text so far.
                last_turn = transcript[transcript.rfind(">", 0, len(transcript) - 1) + 1 :]
                assert env.step(None, last_turn) == Observation(text)
            transcript += text
        assert env.reward(None, transcript, example) == 1.0
        assert task.reward(transcript, example) == 1.0
        assert task.reference_completion(example) == transcript
        wrong = transcript[: transcript.rindex("=") + 1] + str(example["answer"] + 1)
        assert env.reward(None, wrong, example) == 0.0


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*34", "408"),
        (" 7 - 9 ", "-2"),
        ("100+1", "101"),
        ("42", "42"),
        ("-3*-3", "9"),
        ("2**8", "error: syntax"),
        ("1+2+3", "error: syntax"),
        ("__import__('os')", "error: syntax"),
        ("", "error: syntax"),
        ("1" * 13, "error: syntax"),
    ],
)
def test_the_calculator_evaluates_one_integer_operation_and_nothing_else(expression, value):
    assert evaluate(expression) == value


def test_the_reward_reads_only_a_final_equals_number():
    assert calculator_reward("<3*4>12 =12", 12) == 1.0
    assert calculator_reward("<3*4>12 =12 ", 12) == 1.0
    assert calculator_reward("<3*4>12", 12) == 0.0  # A tool's output is not an answer.
    assert calculator_reward("=12 and more", 12) == 0.0
    assert calculator_reward("", 12) == 0.0


class Misbehaving:
    turn_end = (">",)

    def start(self, example):
        return None

    def step(self, state, turn):
        if "hang" in turn:
            time.sleep(30)
        if "raise" in turn:
            raise RuntimeError("tool crashed")
        if "garbage" in turn:
            return 12.5
        if "flood" in turn:
            return "9" * 100_000
        if "calls" in turn:  # Several results: a flood in the second, garbage in a third.
            return Observation(("1" * 40, "2" * 40, "3"), role="tool")
        if "mixed" in turn:
            return Observation(("ok", 7))
        if "done" in turn:
            return Observation(done=True)
        return "ok"

    def reward(self, state, transcript, example):
        return 0.0


@pytest.mark.parametrize(
    "turn, text, kind",
    [
        ("<hang>", "error: timeout", "timeout"),
        ("<raise>", "error: raised", "raised"),
        ("<garbage>", "error: invalid", "invalid"),
        ("<flood>", "9" * 64, None),
        ("<x>", "ok", None),
        ("<calls>", ("1" * 40, "2" * 24, ""), None),  # 64 characters in all, in order.
        ("<mixed>", "error: invalid", "invalid"),
    ],
)
def test_a_misbehaving_tool_becomes_an_observation_within_its_timeout(turn, text, kind, caplog):
    guarded = GuardedEnvironment(Misbehaving(), "misbehaving", timeout=0.5, max_chars=64)
    started = time.monotonic()
    observation, error = guarded.step(None, turn).result(timeout=5)
    assert time.monotonic() - started < 2.0
    role = "tool"
    assert observation == Observation(text, role=role) and error == kind


def test_many_hanging_steps_time_out_together_not_one_after_another():
    guarded = GuardedEnvironment(Misbehaving(), "misbehaving", timeout=0.5, max_chars=64)
    started = time.monotonic()
    futures = [guarded.step(None, "<hang>") for _ in range(20)]
    results = [f.result(timeout=5) for f in futures]
    assert time.monotonic() - started < 3.0
    assert all(r == (Observation("error: timeout"), "timeout") for r in results)


def test_an_environment_can_end_the_episode():
    guarded = GuardedEnvironment(Misbehaving(), "misbehaving", timeout=1.0, max_chars=64)
    observation, error = guarded.step(None, "<done>").result(timeout=5)
    assert observation.done and error is None


def test_environments_resolve_by_import_path_with_one_line_errors():
    env = resolve_environment("gac_jax.tasks.calculator:Calculator")
    assert isinstance(env, Calculator)
    for spec, message in [
        ("calculator", "must be 'package.module:Name'"),
        ("no_such_module_x:Env", "cannot import"),
        ("gac_jax.tasks.calculator:Nope", "has no 'Nope'"),
        ("gac_jax.tasks.calculator:evaluate", "is not an environment"),
    ]:
        with pytest.raises(ValueError, match=message) as error:
            resolve_environment(spec)
        assert "\n" not in str(error.value)


def test_the_calculator_data_prepares_offline_with_distinct_problems(tmp_path):
    task = get_task("calculator/muladd")
    train = task.data_source("train", data_dir=tmp_path)
    test = task.data_source("test", data_dir=tmp_path)
    assert len(train) == 20_000 and len(test) == 1_000
    keys = {
        (int(e["a"]), int(e["b"]), e["op"], int(e["c"])) for e in (test[i] for i in range(1000))
    }
    assert len(keys) == 1_000
    example = train[0]
    assert int(example["answer"]) == int(example["a"]) * int(example["b"]) + (
        int(example["c"]) if example["op"] in ("+", b"+") else -int(example["c"])
    )
    assert np.all([len(task.prompt(train[i])) <= 12 for i in range(100)])


def test_the_reward_scores_numbers_of_any_length_and_leading_zeros():
    assert calculator_reward("=" + "9" * 10_000, 12) == 0.0  # int() would refuse it.
    assert calculator_reward("=0012", 12) == 1.0
    assert calculator_reward("=-0", 0) == 1.0
    assert calculator_reward("=-12", -12) == 1.0 and calculator_reward("=12", -12) == 0.0


def test_hung_steps_past_the_bound_time_out_at_once_without_a_thread():
    guarded = GuardedEnvironment(
        Misbehaving(), "misbehaving", timeout=0.2, max_chars=64, max_abandoned=3
    )
    first = [guarded.step(None, "<hang>") for _ in range(3)]
    assert all(f.result(timeout=5)[1] == "timeout" for f in first)
    started = time.monotonic()
    more = guarded.step(None, "<x>")  # Three hung threads still run: no fourth starts.
    assert more.done() and more.result() == (Observation("error: timeout"), "timeout")
    assert time.monotonic() - started < 0.1


def test_environments_that_fail_to_import_or_build_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("def (:\n")
    (tmp_path / "needs_args.py").write_text(
        "class Env:\n    turn_end = ('>',)\n    def __init__(self, x):\n        pass\n"
    )
    (tmp_path / "bad_turn_end.py").write_text(
        "class Env:\n    turn_end = 5\n    def start(self, e): pass\n"
        "    def step(self, s, t): pass\n    def reward(self, s, t, e): return 0.0\n"
    )
    (tmp_path / "bad_tools.py").write_text(
        "class Env:\n    turn_end = ()\n    tools = {'name': 'x'}\n    def start(self, e): pass\n"
        "    def step(self, s, t): pass\n    def reward(self, s, t, e): return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, message in [
        ("broken_env:Env", "SyntaxError"),
        ("needs_args:Env", "built with no arguments"),
        ("bad_turn_end:Env", "must be a list of non-empty strings"),
        ("bad_tools:Env", "tools=.* must be a list of JSON schemas"),
    ]:
        with pytest.raises(ValueError, match=message) as error:
            resolve_environment(spec)
        assert "\n" not in str(error.value)
