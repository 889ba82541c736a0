"""A short run with DAPO's overlong filtering and soft punishment (issue #63): each step's
learner metrics are those of the shaped rewards and the filtered masks, computed again here
from the step's samples (the task's rewards, lengths and truncation of every completion)."""

import json
import math

import numpy as np

from gac_jax.train.cli import main
from gac_jax.train.metrics import read_metrics

LIMIT, BUFFER, PENALTY = 6, 3, 0.5
SMALL = [
    "task=arithmetic/add2", "init=random", "steps=3", "eval_every=0", "checkpoint_every=0",
    "rollout.mode=sync", "rollout.groups_per_batch=2", "generation.group_size=4",
    "generation.prompt_length=12", f"generation.max_new_tokens={LIMIT}", "mesh.data=1",
    "samples_every=1", "samples_per_log=null", "reward=last_number",
    "generation.overlong.filter=true", f"generation.overlong.buffer={BUFFER}",
    f"generation.overlong.penalty={PENALTY}",
    "generation.stop=[1,7]",  # Stop strings end some of a random policy's completions early.
]  # fmt: skip


def test_a_run_trains_on_shaped_rewards_and_leaves_truncated_completions_out(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--set", *SMALL, f"data_dir={tmp_path}", "--out", str(run)]) == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    records = read_metrics(run / "metrics.jsonl")
    assert len(records) == 3
    seen = set()
    for record in records:
        step = [s for s in samples if s["step"] == record["step"]]
        assert len(step) == 8
        task = np.array([s["reward"] for s in step], np.float64)
        length = np.array([s["length"] for s in step])
        truncated = np.array([s["truncated"] for s in step])
        assert np.all(length[truncated] == LIMIT)  # Only a full completion is cut.
        punishment = -PENALTY * np.clip((length - (LIMIT - BUFFER)) / BUFFER, 0, 1)
        assert math.isclose(record["reward"], np.mean(task + punishment), abs_tol=1e-6)
        assert math.isclose(record["overlong/task_reward"], task.mean(), abs_tol=1e-6)
        assert math.isclose(record["overlong/truncated"], truncated.mean(), abs_tol=1e-6)
        trained = np.mean(np.where(truncated, 0, length))  # The learner's view.
        assert math.isclose(record["response_length"], trained, abs_tol=1e-5)
        assert math.isfinite(record["loss"])
        seen |= set(truncated.tolist())
    assert seen == {True, False}  # Both kinds were met, so the filter was tested.
