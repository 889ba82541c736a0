"""A researcher's own data and rewards: JSONL tasks, rewards by import path, the built-in
strict and lenient answer matchers, and a raising reward counted as 0 and logged once."""

import dataclasses
import json
import logging
import sys
import textwrap
import time

import numpy as np
import pytest

from gac_jax.tasks import get_task
from gac_jax.tasks.custom import GuardedReward, RewardGuardConfig, resolve_reward
from gac_jax.tasks.rewards import (
    MATCHERS,
    answer_tag_match,
    boxed_match,
    hashes_match,
    last_number_match,
    lenient_match,
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": f"What is {i}+1?", "answer": str(i + 1), "id": i, "tags": ["sum"]} for i in range(20)
]


# --- JSONL tasks -------------------------------------------------------------------------


def test_one_file_holds_out_its_last_tenth_as_test(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", ROWS)
    task = get_task(f"jsonl:{path}")
    train = task.data_source("train", data_dir=tmp_path / "unused")
    test = task.data_source("test")
    assert [ex["id"] for ex in train] == list(range(18))
    assert [ex["id"] for ex in test] == [18, 19]
    assert train[3] == ROWS[3]  # every field kept, values as JSON gave them
    assert task.name == f"jsonl:{path}"


def test_two_files_are_train_and_test(tmp_path):
    train_path = _write_jsonl(tmp_path / "train.jsonl", ROWS[:5])
    test_path = _write_jsonl(tmp_path / "test.jsonl", ROWS[5:7])
    task = get_task(f"jsonl:{train_path},{test_path}")
    assert [ex["id"] for ex in task.data_source("train")] == [0, 1, 2, 3, 4]
    assert [ex["id"] for ex in task.data_source("test")] == [5, 6]


def test_prompt_system_reference_and_default_reward(tmp_path):
    rows = [
        {"prompt": "2+3=", "answer": 5, "system": "Reply with a number."},
        {"prompt": "Capital of France?", "answer": "Paris"},
    ]
    task = get_task(f"jsonl:{_write_jsonl(tmp_path / 'd.jsonl', rows)}")
    with_system, plain = task.data_source("train")[0], task.data_source("test")[0]
    assert task.prompt(with_system) == "Reply with a number.\n\n2+3="
    assert task.prompt(plain) == "Capital of France?"
    assert task.reference_completion(with_system) == "5"
    assert task.reward("It is 5.", with_system) == 1.0  # lenient: the last number
    assert task.reward("It is 6.", with_system) == 0.0
    assert task.reward("I think it is\nparis", plain) == 1.0


def test_a_missing_file_or_bad_line_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"no JSONL file '.*nope.jsonl'"):
        get_task(f"jsonl:{tmp_path / 'nope.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field\(s\) \['answer'\]"):
        get_task(f"jsonl:{bad}").data_source("train")
    bad.write_text('{"prompt": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        get_task(f"jsonl:{bad}").data_source("train")
    one = _write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="needs two or more"):
        get_task(f"jsonl:{one}").data_source("train")
    with pytest.raises(ValueError, match="Unknown split 'validation'"):
        get_task(f"jsonl:{_write_jsonl(tmp_path / 'ok.jsonl', ROWS)}").data_source("validation")


def test_unknown_names_list_the_jsonl_form():
    with pytest.raises(ValueError, match=r"jsonl:TRAIN_PATH\[,TEST_PATH\]"):
        get_task("csv:data.csv")


# --- rewards by import path --------------------------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_task_rewards.py").write_text(
        textwrap.dedent(
            """
            def by_length(completion, example):
                return len(completion) / 10 + example["bonus"]

            def broken(completion, example):
                raise RuntimeError("boom " + completion)

            not_callable = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_task_rewards"
    sys.modules.pop("my_task_rewards", None)


def test_resolve_reward_by_path_and_by_short_name(reward_module):
    fn = resolve_reward(f"{reward_module}:by_length")
    assert fn("abcd", {"bonus": 1.0}) == pytest.approx(1.4)
    assert resolve_reward("boxed") is boxed_match
    assert resolve_reward("gac_jax.tasks.rewards:boxed_match") is boxed_match
    assert set(MATCHERS) == {"boxed", "hashes", "answer_tag", "last_number", "lenient"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
        ("my_task_rewards:missing", r"module 'my_task_rewards' has no attribute 'missing'"),
        ("my_task_rewards:not_callable", r"is not callable"),
        ("bxoed", r"neither a built-in reward \(boxed, .*\) nor 'package.module:function'"),
    ],
)
def test_a_bad_reward_path_fails_with_one_line(reward_module, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        resolve_reward(spec)
    assert "\n" not in str(info.value)


def test_a_raising_reward_counts_zero_and_its_first_traceback_names_the_line(
    reward_module, tmp_path, caplog
):
    reward = GuardedReward(resolve_reward(f"{reward_module}:broken"), "my_task_rewards:broken")
    with caplog.at_level(logging.WARNING, logger="gac_jax.tasks.custom"):
        values = [reward(f"c{i}", {}) for i in range(5)]
    assert values == [0.0] * 5
    assert reward.failures == 5 and reward.timeouts == 0
    records = [r for r in caplog.records if "my_task_rewards:broken" in r.getMessage()]
    assert len(records) == 1  # Later failures are only counted.
    message = records[0].getMessage()
    assert "raised RuntimeError: boom c0" in message and "\n" not in message
    assert "reward/failures" in message
    source = tmp_path / "my_task_rewards.py"
    line = source.read_text().splitlines().index('    raise RuntimeError("boom " + completion)') + 1
    assert f'File "{source}", line {line}, in broken' in caplog.text
    assert caplog.text.count("Traceback") == 1


def test_the_first_raise_is_traced_even_after_another_kind_of_failure(caplog):
    answers = iter(["not a number", ZeroDivisionError("late"), ZeroDivisionError("later")])

    def odd(completion, example):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    reward = GuardedReward(odd, "odd")
    with caplog.at_level(logging.WARNING, logger="gac_jax.tasks.custom"):
        assert [reward("x", {}) for _ in range(3)] == [0.0] * 3
    assert [r.exc_info is not None for r in caplog.records] == [False, True]
    assert "raised ZeroDivisionError: late" in caplog.records[1].getMessage()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.5", None, [1.0], True], ids=repr)
def test_what_is_not_a_finite_number_is_a_failure(value):
    reward = GuardedReward(lambda c, ex: value, "odd_reward")
    assert reward("x", {}) == 0.0 and reward.failures == 1


def test_numbers_of_any_numeric_type_are_scores():
    for value, expected in ((3, 3.0), (np.float32(0.25), 0.25), (np.int64(2), 2.0)):
        assert GuardedReward(lambda c, ex, v=value: v, "n")("abc", {}) == expected


def test_a_hanging_reward_times_out_per_group_not_per_call():
    config = RewardGuardConfig(timeout=0.3, failure_score=-1.0)

    def sleepy(completion, example):
        if completion.startswith("hang"):
            time.sleep(30)
        if completion == "boom":
            raise ValueError("no")
        return 1.0

    reward = GuardedReward(sleepy, "sleepy", config)
    started = time.monotonic()
    scores = reward.score_group(["hang1", "ok", "hang2", "boom", "hang3"], {})
    elapsed = time.monotonic() - started
    assert elapsed < 2.0  # One deadline for the group, not 0.3 s x 3 hung calls in a row.
    np.testing.assert_array_equal(scores.rewards, [-1.0, 1.0, -1.0, -1.0, -1.0])
    assert (scores.failures, scores.timeouts) == (1, 3)
    assert (reward.failures, reward.timeouts) == (1, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout", 0),
        ("timeout", -1.0),
        ("max_failure_fraction", 0.0),
        ("max_failure_fraction", 1.5),
    ],
)
def test_reward_guard_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(RewardGuardConfig(), **{field: value}).validate()


# --- matchers: strict vs lenient ---------------------------------------------------------

# (completion, gold, boxed, hashes, answer_tag, last_number, lenient)
CASES = [
    (r"so the total is \boxed{18}.", "18", 1, 0, 0, 1, 1),
    (r"\boxed{18 eggs}", "18", 0, 0, 0, 1, 1),  # strict wants the answer alone
    (r"\boxed{\$1,080}", "1080", 0, 0, 0, 1, 1),  # "\$" is not a currency sign
    (r"\boxed{$1,080}", "1080", 1, 0, 0, 1, 1),
    (r"\boxed{17} wait, \boxed{18}", "18", 1, 0, 0, 1, 1),  # the last box
    (r"\boxed{18} wait, \boxed{17}", "18", 0, 0, 0, 0, 0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1, 0, 0, 0, 1),  # nested braces, text gold
    ("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", "18", 0, 1, 0, 1, 1),
    ("#### 18 eggs", "18", 0, 0, 0, 1, 1),
    ("#### 18.", "18", 0, 1, 0, 1, 1),
    ("#### -3", "-3", 0, 1, 0, 1, 1),
    ("<answer>0.5</answer>", "1/2", 0, 0, 1, 1, 1),
    ("<answer> 42 </answer> and later 7", "42", 0, 0, 1, 0, 1),  # lenient reads the tag
    ("<answer>Paris</answer>", "Paris", 0, 0, 1, 0, 1),
    ("<answer>paris</answer>", "Paris", 0, 0, 0, 0, 1),  # strict keeps case
    ("The answer is 18", "18", 0, 0, 0, 1, 1),
    ("18 is not it, 19", "18", 0, 0, 0, 0, 0),
    ("no number here", "18", 0, 0, 0, 0, 0),
    ("", "18", 0, 0, 0, 0, 0),
]
MATCHER_ORDER = (boxed_match, hashes_match, answer_tag_match, last_number_match, lenient_match)


@pytest.mark.parametrize("case", CASES, ids=[c[0][:30] for c in CASES])
def test_matchers_on_hand_written_cases(case):
    completion, gold, *expected = case
    example = {"answer": gold}
    got = []
    for matcher in MATCHER_ORDER:
        if matcher is last_number_match and gold in ("Paris", r"\frac{1}{2}"):
            got.append(0.0)  # no number in the gold: checked below
            continue
        got.append(matcher(completion, example))
    assert got == [float(e) for e in expected]


def test_numeric_gold_values_and_non_text_completions():
    assert boxed_match(r"\boxed{1,080}", {"answer": 1080}) == 1.0
    assert hashes_match("#### 2.5", {"answer": 2.5}) == 1.0
    for matcher in MATCHER_ORDER:
        assert matcher(None, {"answer": "1"}) == 0.0
        assert matcher(b"#### 1", {"answer": "1"}) in (0.0, 1.0)
    with pytest.raises(ValueError, match="holds no number"):
        last_number_match("Paris", {"answer": "Paris"})


def test_matchers_stay_fast_on_hostile_text():
    import time

    hostile = "\\boxed{" * 20_000 + "<answer>" * 20_000 + "####" * 20_000
    start = time.monotonic()
    for matcher in MATCHER_ORDER:
        assert matcher(hostile, {"answer": "1"}) == 0.0
    assert time.monotonic() - start < 2.0


# --- Hugging Face datasets saved to disk -------------------------------------------------


@pytest.fixture
def saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = {
        "train": datasets.Dataset.from_list(ROWS[:10]),
        "test": datasets.Dataset.from_list(ROWS[10:13]),
        "extra": datasets.Dataset.from_list(ROWS[13:20]),
    }
    datasets.disable_progress_bars()
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "dict")
    splits["train"].save_to_disk(tmp_path / "single")
    renamed = splits["train"].rename_column("prompt", "question")
    renamed.save_to_disk(tmp_path / "renamed")
    return tmp_path


def _ids(source):
    return [source[i]["id"] for i in range(len(source))]


def test_hf_dataset_dict_splits(saved_datasets):
    task = get_task(f"hf:{saved_datasets / 'dict'}")
    train, test = task.data_source("train"), task.data_source("test")
    assert _ids(train) == list(range(10)) and _ids(test) == [10, 11, 12]
    assert train[2] == ROWS[2]  # every column kept
    named = get_task(f"hf:{saved_datasets / 'dict'}:extra,test")
    assert _ids(named.data_source("train")) == list(range(13, 20))
    assert _ids(named.data_source("test")) == [10, 11, 12]
    one = get_task(f"hf:{saved_datasets / 'dict'}:extra")  # holds out its last tenth
    assert _ids(one.data_source("train")) == list(range(13, 19))
    assert _ids(one.data_source("test")) == [19]
    example = test[0]
    assert task.prompt(example) == "What is 10+1?"
    assert task.reward("so 11", example) == 1.0 and task.reward("so 12", example) == 0.0


def test_hf_single_dataset_holds_out_its_last_tenth(saved_datasets):
    task = get_task(f"hf:{saved_datasets / 'single'}")
    assert _ids(task.data_source("train")) == list(range(9))
    assert _ids(task.data_source("test")) == [9]


def test_hf_errors_name_the_place(saved_datasets):
    with pytest.raises(ValueError, match=r"'.*nowhere' is not a dataset saved by save_to_disk"):
        get_task(f"hf:{saved_datasets / 'nowhere'}")
    with pytest.raises(ValueError, match=r"no split\(s\) \['valid'\]; the dataset has"):
        get_task(f"hf:{saved_datasets / 'dict'}:valid").data_source("train")
    with pytest.raises(ValueError, match=r"no column\(s\) \['prompt'\].*rename_column"):
        get_task(f"hf:{saved_datasets / 'renamed'}").data_source("train")
    with pytest.raises(ValueError, match="holds one dataset, not named splits"):
        get_task(f"hf:{saved_datasets / 'single'}:train").data_source("train")
