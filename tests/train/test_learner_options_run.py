"""The learner's options through the CLI: trajectory balance (which needs the reference
model) trains, and a run with PPO mini-batches, a KL penalty, an entropy bonus and a warm-up
writes one metrics record per optimizer step. The task's reward is the share of digits
(`digit_task`), which a random model earns some of, so there is something to learn."""

import numpy as np

from gac_jax.train.cli import main
from gac_jax.train.metrics import read_metrics

SMALL = [
    "task=arithmetic/add2",
    "init=random",
    "steps=3",
    "eval_every=0",
    "checkpoint_every=0",
    "rollout.mode=sync",
    "rollout.groups_per_batch=2",
    "generation.group_size=4",
    "generation.prompt_length=24",
    "generation.max_new_tokens=6",
    "mesh.data=1",
]


def _train(tmp_path, *settings):
    argv = ["train", "--out", str(tmp_path / "run")]
    for setting in [*SMALL, *settings]:
        argv += ["--set", setting]
    assert main(argv) == 0
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_trajectory_balance_trains_three_steps(tmp_path, digit_task):
    records = _train(tmp_path, "loss.policy_loss=tb", "loss.advantage=grpo")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert np.isfinite(record["loss"]) and record["nonfinite_step"] == 0.0
        assert np.isfinite(record["loss/log_z_mean"])
    assert records[-1]["update_norm"] > 0.0


def test_mini_batches_kl_and_entropy_log_every_optimizer_step(tmp_path, digit_task):
    records = _train(
        tmp_path,
        "loss.policy_loss=decoupled_ppo",
        "loss.kl_coef=0.05",
        "loss.entropy_coef=0.01",
        "learner.mini_batches=2",
        "optimizer.schedule=warmup_linear",
        "optimizer.warmup_steps=4",
    )
    assert [(r["step"], r["mini_batch"], r["optimizer_step"]) for r in records] == [
        (s, j, 2 * s + j) for s in range(3) for j in range(2)
    ]
    rates = [r["learning_rate"] for r in records]
    assert rates[:4] == sorted(rates[:4]) and rates[0] < rates[3]  # The warm-up.
    assert all(r["loss/kl"] >= 0.0 and r["loss/entropy_bonus"] > 0.0 for r in records)
    assert records[0]["loss/kl"] == 0.0  # The reference is the initial policy.
    assert records[-1]["loss/kl"] > 0.0
    # Batch metrics go with each batch's last record.
    assert "reward" in records[1] and "train_tokens_per_s" in records[1]
