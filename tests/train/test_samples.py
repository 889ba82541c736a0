"""Sampled completions of a run: `samples.jsonl`, the TensorBoard text table and W&B.

A JSONL task with a reward module written here is trained 3 steps through the CLI with
every completion logged at every step: each step's `reward` metric is the mean of the
module's reward recomputed here on the logged completions, the TensorBoard table holds the
same rows, and the offline W&B run holds the metrics and the tables.
"""

import json
import re
import struct
import sys

import numpy as np
import pytest

from gac_jax import models
from gac_jax.rollout.record import Rollout
from gac_jax.tasks import get_task
from gac_jax.train.cli import main
from gac_jax.train.config import TrainConfig
from gac_jax.train.metrics import NullMetricWriter, read_metrics, start_wandb
from gac_jax.train.samples import SAMPLES_FILE, SampleLogger, sample_logger, sample_records

SMALL = [
    "init=random",
    "steps=3",
    "eval_every=0",
    "checkpoint_every=0",
    "rollout.mode=sync",
    "rollout.groups_per_batch=2",
    "generation.group_size=3",
    "generation.prompt_length=24",
    "generation.max_new_tokens=6",
    "mesh.data=1",
]

# Depends on the completion's text and on a field only the JSONL carries.
REWARD_MODULE = """
def stars_and_bonus(completion, example):
    return completion.count("*") + len(completion) / 10 + example["bonus"]
"""

ROWS = [{"prompt": f"{i}*{i}=", "answer": str(i * i), "bonus": 0.25 * (i % 4)} for i in range(12)]


def _tensorboard_texts(tb_dir):
    """{(step, tag): text} of the text summaries in the event files of `tb_dir` (TFRecords:
    u64 length, u32 crc, an `Event` proto, u32 crc)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    texts = {}
    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert files
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    texts[(event.step, value.tag)] = value.tensor.string_val[0].decode()
    return texts


def _table_rows(markdown):
    """The cells of a markdown table, unescaped (``\\x`` -> ``x``, ``<br>`` -> newline)."""
    lines = markdown.split("\n")
    assert re.fullmatch(r"\|(---\|)+", lines[1]), lines[1]

    def unescape(cell):
        return "" if cell == " " else re.sub(r"\\(.)|<br>", lambda m: m.group(1) or "\n", cell)

    return [[unescape(c) for c in line[2:-2].split(" | ")] for line in lines]


def _wandb_history(run_file):
    """The history rows ({key: JSON value}) of an offline W&B run file: a LevelDB-style log
    (32 KiB blocks of records: u32 crc, u16 length, u8 type; type 1 whole, 2-4 pieces) of
    `Record` protos after a 7-byte ``:W&B`` header."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk, rows = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # A block's tail too short for a header is padding.
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                )
    return rows


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A 3-step run of the JSONL task logging every completion of every step, with W&B
    offline: (out dir, task name, the reward module)."""
    tmp = tmp_path_factory.mktemp("samples")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp / "sample_rewards.py").write_text(REWARD_MODULE)
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_CONSOLE": "off"}
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))
        for key, value in env.items():
            mp.setenv(key, value)
        import sample_rewards

        out = tmp / "run"
        argv = ["train", "--config", "countdown_sync", "--set", f"task=jsonl:{data}"]
        argv += ["reward=sample_rewards:stars_and_bonus", *SMALL, "samples_every=1"]
        argv += ["samples_per_log=null", "wandb_project=gac-jax-test", "wandb_mode=offline"]
        assert main([*argv, "--out", str(out)]) == 0
        yield out, f"jsonl:{data}", sample_rewards
    sys.modules.pop("sample_rewards", None)


def test_the_logged_completions_are_what_the_reward_metric_averages(logged_run):
    out, task, rewards = logged_run
    train = get_task(task).data_source("train")
    samples = read_metrics(out / SAMPLES_FILE)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for record in metrics:
        step_samples = [s for s in samples if s["step"] == record["step"]]
        assert len(step_samples) == 6  # The whole batch: 2 groups of 3.
        assert len({s["group_id"] for s in step_samples}) == 2
        recomputed = [
            rewards.stars_and_bonus(s["completion"], train[s["prompt_id"]]) for s in step_samples
        ]
        np.testing.assert_allclose([s["reward"] for s in step_samples], recomputed, rtol=1e-6)
        np.testing.assert_allclose(record["reward"], np.mean(recomputed), rtol=1e-6)
        for s in step_samples:
            assert s["prompt"] == ROWS[s["prompt_id"]]["prompt"]
            assert s["version_gap"] == 0 and s["policy_version"] == record["step"]  # sync
            assert 1 <= s["length"] <= 6 and len(s["completion"]) <= s["length"]


def test_tensorboard_holds_each_step_as_a_table(logged_run):
    out, _, _ = logged_run
    samples = read_metrics(out / SAMPLES_FILE)
    texts = _tensorboard_texts(out / "tensorboard")
    assert sorted(texts) == [(step, "samples/text_summary") for step in range(3)]
    for step in range(3):
        header, _, *rows = _table_rows(texts[(step, "samples/text_summary")])
        assert header == ["group_id", "version_gap", "reward", "prompt", "completion"]
        expected = [s for s in samples if s["step"] == step]
        assert len(rows) == len(expected)
        for row, s in zip(rows, expected, strict=True):
            assert row[3:] == [s["prompt"], s["completion"]]
            assert [int(row[0]), int(row[1])] == [s["group_id"], s["version_gap"]]
            np.testing.assert_allclose(float(row[2]), s["reward"], rtol=1e-3)


def test_the_offline_wandb_run_holds_the_metrics_and_tables(logged_run):
    out, _, _ = logged_run
    run_files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history = _wandb_history(run_files[0])
    metrics = read_metrics(out / "metrics.jsonl")
    by_step = {int(row["_step"]): row for row in history}
    assert sorted(by_step) == [0, 1, 2]
    for record in metrics:
        row = by_step[record["step"]]
        assert {"reward", "loss", "samples/_type"} <= set(row)
        np.testing.assert_allclose(float(row["reward"]), record["reward"], rtol=1e-6)
        assert json.loads(row["samples/_type"]) == "table-file"
        assert int(row["samples/nrows"]) == 6


def _rollout(group_id, version, prompt, completions, rewards, tokenizer, length=5):
    """A group of `completions` (texts), padded to `length` tokens, EOS after each."""
    ids = [tokenizer.encode(c, add_eos=True) for c in completions]
    tokens = np.zeros((len(ids), length), np.int32)
    mask = np.zeros((len(ids), length), bool)
    for i, row in enumerate(ids):
        tokens[i, : len(row)], mask[i, : len(row)] = row, True
    return Rollout(
        prompt_id=group_id + 100,
        group_id=group_id,
        prompt_tokens=np.asarray(tokenizer.encode(prompt, add_bos=True), np.int32),
        completion_tokens=tokens,
        completion_mask=mask,
        behaviour_logp=np.zeros((len(ids), length), np.float32),
        rewards=np.asarray(rewards, np.float32),
        policy_version=version,
    )


@pytest.fixture
def two_groups():
    tokenizer = models.CharTokenizer()
    return tokenizer, [
        _rollout(7, 3, "1+2=", ["3", "12"], [1.0, 0.0], tokenizer),
        _rollout(8, 5, "2*2=", ["4*", "2 2"], [0.5, 0.25], tokenizer),
    ]


def test_sample_records_decode_each_completion_with_its_version_gap(two_groups):
    tokenizer, rollouts = two_groups
    records = sample_records(6, rollouts, tokenizer)
    expected = [
        (7, 107, 3, 3, 1.0, 2, "1+2=", "3"),
        (7, 107, 3, 3, 0.0, 3, "1+2=", "12"),
        (8, 108, 5, 1, 0.5, 3, "2*2=", "4*"),
        (8, 108, 5, 1, 0.25, 4, "2*2=", "2 2"),
    ]
    keys = ("group_id", "prompt_id", "policy_version", "version_gap", "reward", "length")
    keys += ("prompt", "completion")
    assert [tuple(r[k] for k in keys) for r in records] == expected
    assert all(r["step"] == 6 for r in records)
    assert sample_records(6, rollouts, tokenizer, limit=3) == records[:3]


class _Tables:
    """A `MetricWriter` stand-in recording `write_table` calls."""

    def __init__(self):
        self.calls = []

    def write_table(self, step, tag, columns, rows):
        self.calls.append((step, tag, tuple(columns), rows))


def test_the_logger_writes_due_steps_and_truncates_on_resume(tmp_path, two_groups):
    tokenizer, rollouts = two_groups
    tables = _Tables()
    with SampleLogger(tmp_path, tables, tokenizer, every=2, limit=None) as logger:
        for step in range(6):
            logger.write(step, rollouts)
    records = read_metrics(tmp_path / SAMPLES_FILE)
    assert [r["step"] for r in records] == [0] * 4 + [1] * 4 + [3] * 4 + [5] * 4  # And step 0.
    assert [(c[0], c[1]) for c in tables.calls] == [(s, "samples") for s in (0, 1, 3, 5)]
    assert tables.calls[1][3][3] == [8, -4, 0.25, "2*2=", "2 2"]  # version gap 1 - 5
    # A run resumed at step 3 writes steps 3 and 5 again: the old ones go, steps 0-1 stay.
    with SampleLogger(tmp_path, tables, tokenizer, every=2, limit=1, start_step=3) as logger:
        logger.write(3, rollouts)
    assert [r["step"] for r in read_metrics(tmp_path / SAMPLES_FILE)] == [0] * 4 + [1] * 4 + [3]


def test_a_run_shorter_than_the_cadence_writes_its_first_and_last_steps(tmp_path, two_groups):
    tokenizer, rollouts = two_groups
    with SampleLogger(tmp_path, _Tables(), tokenizer, every=25, limit=1) as logger:
        for step in range(4):
            logger.write(step, rollouts, last=step == 3)
    assert [r["step"] for r in read_metrics(tmp_path / SAMPLES_FILE)] == [0, 3]


def test_sampling_off_or_another_process_writes_nothing(tmp_path, two_groups):
    tokenizer, rollouts = two_groups
    for config, primary in ((TrainConfig(samples_every=0), True), (TrainConfig(), False)):
        with sample_logger(config, tmp_path, NullMetricWriter(), tokenizer, 0, primary) as logger:
            assert logger.write(24, rollouts) == []
    assert not (tmp_path / SAMPLES_FILE).exists()


def test_sampling_off_drops_an_earlier_runs_samples_of_the_steps_it_makes(tmp_path, two_groups):
    tokenizer, rollouts = two_groups
    with SampleLogger(tmp_path, _Tables(), tokenizer, every=1) as logger:
        for step in range(3):
            logger.write(step, rollouts)
    off = TrainConfig(samples_every=0)
    sample_logger(off, tmp_path, NullMetricWriter(), tokenizer, 2, True)  # resumed at 2
    assert [r["step"] for r in read_metrics(tmp_path / SAMPLES_FILE)] == [0] * 4 + [1] * 4
    sample_logger(off, tmp_path, NullMetricWriter(), tokenizer, 0, True)  # a new run
    assert not (tmp_path / SAMPLES_FILE).exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("samples_every=-1", "samples_every=-1 must be an int >= 0."),
        ("samples_per_log=0", "samples_per_log=0 must be an int >= 1."),
        ("wandb_mode=cloud", "wandb_mode='cloud' must be one of ['online', 'offline']."),
        ("wandb_project=''", "wandb_project='' must be a non-empty string or null."),
    ],
)
def test_bad_logging_settings_fail_with_one_line(override, message, capsys):
    with pytest.raises(SystemExit):
        main(["show-config", "--set", "init=random", override])
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_wandb_missing_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name)
    )
    with pytest.raises(ValueError, match=r"wandb_project='p' needs the wandb package: pip"):
        TrainConfig(init="random", wandb_project="p").validate()
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'gac_jax\[wandb\]'"):
        start_wandb("p", mode="offline", out_dir=tmp_path, config={})
