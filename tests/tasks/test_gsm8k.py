"""GSM8K: offline preparation from the release files, tfds's fields, the reward on every
test problem."""

import json
from fractions import Fraction
from pathlib import Path

import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

from gac_jax.tasks import get_task
from gac_jax.tasks.builders import Gsm8k
from gac_jax.tasks.gsm8k import format_prompt, gsm8k_reward
from gac_jax.tasks.rewards import parse_number

GSM8K_DIR = Path(__file__).parents[2] / ".." / "shared" / "data" / "gsm8k"

pytestmark = pytest.mark.skipif(
    not (GSM8K_DIR / "test.jsonl").is_file(),
    reason=f"the GSM8K release files are not at {GSM8K_DIR.resolve()}",
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def test_split(data_dir, no_network_in_module):
    """The test split, prepared from the release files with the network disabled."""
    task = get_task("gsm8k", manual_dir=GSM8K_DIR)
    source = task.data_source("test", data_dir=data_dir)
    return [{k: v.decode() for k, v in ex.items()} for ex in source]


def test_prepares_offline_with_tfds_fields(data_dir, test_split):
    builder = Gsm8k(data_dir=data_dir)
    assert builder.is_prepared()
    assert builder.info.splits["train"].num_examples == 7473
    assert builder.info.splits["test"].num_examples == 1319
    # tfds's own builder: same features, and it reads the very files prepared offline.
    theirs = tfds_gsm8k.Gsm8k(data_dir=data_dir, file_format="array_record")
    assert builder.info.features.to_json() == theirs.info.features.to_json()
    assert set(test_split[0]) == {"question", "answer", "annotation", "short_answer"}
    source = theirs.as_data_source(split="test")
    assert len(source) == 1319
    assert {k: v.decode() for k, v in source[5].items()} == test_split[5]


def test_examples_are_the_release_files(test_split):
    release = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").read_text().splitlines()]
    by_question = {ex["question"]: ex for ex in test_split}
    assert len(by_question) == len(release)
    for original in release:
        ex = by_question[original["question"]]
        assert ex["answer"] == original["answer"]
        # tfds's split of the answer: annotation + "#### " + short_answer.
        assert ex["annotation"] + "#### " + ex["short_answer"] == ex["answer"]


def test_reward_accepts_every_gold_answer_and_rejects_a_changed_one(test_split):
    assert len(test_split) == 1319
    task = get_task("gsm8k", manual_dir=GSM8K_DIR)
    for ex in test_split:
        gold = ex["short_answer"]
        assert task.reward(ex["answer"], ex) == 1.0, ex["answer"]
        assert task.reward(gold, ex) == 1.0, gold
        changed = str(parse_number(gold) + 1)
        assert parse_number(changed) != parse_number(gold)
        assert task.reward(ex["annotation"] + "#### " + changed, ex) == 0.0, ex["answer"]
        assert task.reward(changed, ex) == 0.0, changed


def test_prompt_and_reference(test_split):
    task = get_task("gsm8k", manual_dir=GSM8K_DIR)
    ex = test_split[0]
    assert task.prompt(ex) == format_prompt(ex["question"])
    assert task.prompt(ex).startswith("Question: ") and task.prompt(ex).endswith("\nAnswer: ")
    assert task.reference_completion(ex) == ex["answer"]


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", 1.0),
        ("The answer is $18.", 1.0),
        ("The answer is 18.00", 1.0),
        ("Janet makes 18 dollars.", 1.0),
        ("#### 18\nSo 19 in total next week.", 1.0),
        ("The answer is 19.", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_reward(completion, reward):
    assert gsm8k_reward(completion, "18") == reward
    assert isinstance(gsm8k_reward(completion, "18"), float)


def test_reward_handles_commas_and_negative_gold():
    assert gsm8k_reward("#### 1450000", "1,450,000") == 1.0
    assert gsm8k_reward("It is $1,450,000.", "1,450,000") == 1.0
    assert gsm8k_reward("The answer is -10", "-10") == 1.0
    assert gsm8k_reward("The answer is 10", "-10") == 0.0
    assert parse_number("1,450,000") == Fraction(1_450_000)


def test_manual_dir_without_the_files_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        get_task("gsm8k", manual_dir=tmp_path)


def test_failed_download_names_the_offline_route(tmp_path, monkeypatch):
    # tfds retries a failing download for minutes; fail it at once instead.
    def fail(*args, **kwargs):
        raise OSError("cannot reach raw.githubusercontent.com")

    monkeypatch.setattr(tfds.download.DownloadManager, "download_and_extract", fail)
    builder = Gsm8k(data_dir=tmp_path)
    config = tfds.download.DownloadConfig(manual_dir=str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="manual_dir"):
        builder.download_and_prepare(download_config=config)
