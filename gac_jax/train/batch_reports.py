"""What each component of a run reports about a batch, beside the learner's own metrics.

`Run.start` picks the reports its config needs once (`batch_reports`); `Run.step` calls
each on the step's rollouts and merges what they return, so a new feature's metrics come
with a new report, not with another branch in the step. A report is a callable
`(rollouts, step) -> dict[str, float]`; it may raise to stop the run (`RewardFailures`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gac_jax.train import processes

logger = logging.getLogger(__name__)
BatchReport = Callable[[Sequence[Any], int], dict[str, float]]
FLAT_STEPS = 5  # The steps `FlatRewards` watches.


class RewardFailedError(RuntimeError):
    """The run's own reward failed (or timed out) on too many of a batch's completions."""


class RewardFailures:
    """``reward/failures`` and ``reward/timeouts`` of a batch (the run's own reward, run
    behind its guard); raises `RewardFailedError` when their share reaches
    `max_failure_fraction` (None: never)."""

    def __init__(self, reward: str, max_failure_fraction: float | None):
        self.reward, self.bound = reward, max_failure_fraction

    def __call__(self, rollouts, step: int) -> dict[str, float]:
        failures = sum(r.reward_failures for r in rollouts)
        timeouts = sum(r.reward_timeouts for r in rollouts)
        completions = sum(r.group_size for r in rollouts)
        if self.bound is not None and failures + timeouts >= self.bound * completions:
            raise RewardFailedError(
                f"step {step}: reward {self.reward} failed on {failures} and timed out "
                f"on {timeouts} of the batch's {completions} completions (the run stops at "
                f"reward_guard.max_failure_fraction={self.bound:g}); the first failure was "
                "logged above"
            )
        return {"reward/failures": float(failures), "reward/timeouts": float(timeouts)}


class FilteredGroups:
    """Dynamic sampling's count for a batch: the groups it discarded since the last batch
    (`groups_filtered`) and the batches' worth of groups drawn (`draws_per_batch`), from
    the rollout source's running total (a resumed run's goes on from its checkpoint)."""

    def __init__(self, source):
        self.source = source
        self.seen = source.stats().filtered

    def __call__(self, rollouts, step: int) -> dict[str, float]:
        del step
        total = self.source.stats().filtered
        filtered, self.seen = total - self.seen, total
        return {
            "groups_filtered": float(filtered),
            "draws_per_batch": (filtered + len(rollouts)) / len(rollouts),
        }


class FlatRewards:
    """One warning when every reward of a run's first `steps` steps (from step 0) was the
    same value, 0 above all: no group then has a spread to learn from, and the usual cause
    is a reward that never matches. Process 0 warns; a resumed run does not."""

    def __init__(self, steps: int, random_init: bool):
        self.steps, self.random_init = steps, random_init
        self.next, self.values = 0, set()  # The step expected next (None: stop watching).

    def __call__(self, rollouts, step: int) -> dict[str, float]:
        if self.next != step:
            self.next = None
            return {}
        self.values.update(np.unique(np.concatenate([r.rewards for r in rollouts])).tolist())
        self.next = step + 1 if len(self.values) == 1 and step + 1 < self.steps else None
        if step + 1 == self.steps and len(self.values) == 1 and processes.is_primary():
            hint = "; init=random writes noise: start from a warm start" * self.random_init
            logger.warning(
                "every reward of the first %d steps was %g: the reward never matched. Check "
                "that the answers are in the format it reads (samples.jsonl shows what the "
                "policy writes) and that it scores a right answer above 0%s.",
                self.steps, self.values.pop(), hint,
            )  # fmt: skip
        return {}


def overlong_metrics(shaped: bool) -> BatchReport:
    """``overlong/truncated``: the share of a batch's completions the length limit cut (is
    `generation.max_new_tokens` too short?). When the soft punishment is on (`shaped`), the
    learner's ``reward`` and ``accuracy`` are of the shaped rewards, and the task's own
    are ``overlong/task_reward`` and ``overlong/task_accuracy``."""

    def report(rollouts, step: int) -> dict[str, float]:
        del step
        out = {"overlong/truncated": float(np.mean([r.truncated for r in rollouts]))}
        if shaped:
            rewards = np.concatenate([r.rewards for r in rollouts])
            out["overlong/task_reward"] = float(rewards.mean())
            out["overlong/task_accuracy"] = float(np.mean(rewards >= 1.0))
        return out

    return report


def episode_metrics(rollouts, step: int | None = None) -> dict[str, float]:
    """Multi-turn telemetry of a batch: turns per episode, tool calls, errors, timeouts and
    latency, observation vs policy tokens, and the span of policy versions in an episode.
    Nothing for single answers (no observation tokens)."""
    del step
    if rollouts[0].observation_mask is None:
        return {}
    turns = np.concatenate([r.turns for r in rollouts])
    calls = sum(r.tool_calls for r in rollouts)
    answered = calls - sum(r.tool_errors + r.tool_timeouts for r in rollouts)
    spans = []
    for r in rollouts:
        if r.token_versions is None:
            spans += [0] * r.group_size
            continue
        for row_mask, row_versions in zip(r.completion_mask, r.token_versions, strict=True):
            v = row_versions[row_mask]
            spans.append(int(v.max() - v.min()) if v.size else 0)
    return {
        "episode/turns_mean": float(turns.mean()),
        "episode/turns_max": float(turns.max()),
        "episode/policy_tokens": float(sum(r.completion_mask.sum() for r in rollouts)),
        "episode/observation_tokens": float(sum(r.observation_mask.sum() for r in rollouts)),
        "episode/version_span_mean": float(np.mean(spans)),
        "tools/calls": float(calls),
        "tools/errors": float(sum(r.tool_errors for r in rollouts)),
        "tools/timeouts": float(sum(r.tool_timeouts for r in rollouts)),
        "tools/latency_ms": 1e3 * sum(r.tool_seconds for r in rollouts) / max(answered, 1),
    }


def actor_replacements(pool) -> BatchReport:
    """The Ray rollout actors replaced so far (`rollout_actor_replacements`)."""
    return lambda rollouts, step: {"rollout_actor_replacements": pool.replacements}


def batch_reports(config, source, pool=None) -> list[BatchReport]:
    """The reports a run of `config` (a `TrainConfig`) makes of each batch, given its
    rollout source and (with `rollout.backend=ray`) its actor pool."""
    reports: list[BatchReport] = [
        FlatRewards(min(FLAT_STEPS, config.steps), config.init == "random"),
        overlong_metrics(config.generation.overlong.buffer > 0),
    ]
    if config.rollout.dynamic_sampling:
        reports.append(FilteredGroups(source))
    if config.reward is not None:  # The run's own reward: how often it failed.
        reports.append(RewardFailures(config.reward, config.reward_guard.max_failure_fraction))
    reports.append(episode_metrics)
    if pool is not None:
        reports.append(actor_replacements(pool))
    return reports
