"""Sampled completions of a run, to read what the policy writes as it trains.

Every `samples_every` steps, at step 0 and at the last step, `SampleLogger.write(step,
rollouts, last)` turns the step's rollout groups into one record per completion
(`sample_records`) and appends them to ``out_dir/samples.jsonl`` (flushed at once) and,
through the run's `MetricWriter`, as a table to TensorBoard's text tab (and W&B when on). A
record answers "what does the policy write, how is it scored, and how stale was the policy
that wrote it":

``{"step", "group_id", "prompt_id", "policy_version", "version_gap", "reward", "length",
"truncated", "prompt", "completion"}`` (and, for a multi-turn episode, ``"turns"``: the
transcript as ``{"role": "policy" | "environment", "text"}`` runs; ``completion`` is then
the whole transcript)

`version_gap` is the learner's version at `step` (which is `step`) minus the version that
sampled the group; `length` counts the completion's tokens (EOS included); `truncated`:
the length limit cut it (`Rollout.truncated`). Texts are the text the reward saw: the
decoded tokens the learner trained on (special tokens skipped), cut before a stop string of
`generation.stop` (`cut_at_stop`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gac_jax._closing import Closing
from gac_jax.models.tokenizers import decode_completion
from gac_jax.rollout.sampling import cut_at_stop
from gac_jax.train.metrics import keep_before, to_json_scalar

SAMPLES_FILE = "samples.jsonl"
TABLE_TAG = "samples"
# The table's columns, in order (the JSONL records hold them all).
TABLE_COLUMNS = ("group_id", "version_gap", "reward", "prompt", "completion")


def sample_records(
    step: int,
    rollouts: Sequence[Any],
    tokenizer,
    *,
    limit: int | None = None,
    stop: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """One record per completion of `rollouts` (`Rollout`s trained at `step`), in batch order,
    the first `limit` of them (None: all); texts are cut before a stop string of `stop`."""
    records = []
    for rollout in rollouts:
        prompt = decode_completion(tokenizer, rollout.prompt_tokens)
        observed = rollout.observation_mask
        for row, (tokens, mask, reward) in enumerate(
            zip(rollout.completion_tokens, rollout.completion_mask, rollout.rewards, strict=True)
        ):
            if limit is not None and len(records) >= limit:
                return records
            record = {
                "step": int(step),
                "group_id": int(rollout.group_id),
                "prompt_id": int(rollout.prompt_id),
                "policy_version": int(rollout.policy_version),
                "version_gap": rollout.staleness(step),
                "reward": to_json_scalar(reward, "reward"),
                "length": int(mask.sum()),
                "truncated": bool(rollout.truncated[row]),
                "prompt": prompt,
            }
            if observed is None:
                record["completion"] = cut_at_stop(tokenizer, tokens, mask, stop)[0]
            else:  # An episode: the whole transcript, and each turn with its author.
                context = mask | observed[row]
                record["completion"] = decode_completion(tokenizer, tokens[context])
                record["turns"] = _turns(tokenizer, tokens[context], observed[row][context])
            records.append(record)
    return records


def _turns(tokenizer, tokens, observed) -> list[dict[str, str]]:
    """An episode's context cut into runs of policy and environment tokens."""
    turns, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or observed[end] != observed[start]:
            role = "environment" if observed[start] else "policy"
            turns.append({"role": role, "text": decode_completion(tokenizer, tokens[start:end])})
            start = end
    return turns


class SampleLogger(Closing):
    """Writes sampled completions every `every` steps (see the module docstring).

    Args:
      out_dir: the run directory.
      writer: the run's `MetricWriter` (it writes the tables).
      tokenizer: decodes the rollouts' tokens.
      every: log at steps with ``(step + 1) % every == 0``, step 0 and the last; 0 never.
      limit: completions per log (None: the whole batch).
      stop: the run's stop strings (`generation.stop`).
      start_step: as `MetricWriter`'s: None starts a new file, an int keeps the records of
        earlier steps (a resumed run).
    """

    def __init__(self, out_dir: str | os.PathLike, writer, tokenizer, *, every: int,
                 limit: int | None = None, start_step: int | None = None,
                 stop: Sequence[str] = ()):  # fmt: skip
        self.path = Path(out_dir) / SAMPLES_FILE
        self.writer, self.tokenizer = writer, tokenizer
        self.every, self.limit, self.stop = every, limit, tuple(stop)
        if start_step is not None and self.path.exists():
            keep_before(self.path, start_step)
        self._file = self.path.open("a" if start_step is not None else "w", encoding="utf-8")

    def write(self, step: int, rollouts: Sequence[Any], last: bool = False) -> list[dict[str, Any]]:
        """Logs the completions of `step`'s rollouts if `step` is due (by `every`, step 0:
        what the policy wrote first, or the run's `last` step); returns the records."""
        if not self.every or ((int(step) + 1) % self.every and step and not last):
            return []
        records = sample_records(step, rollouts, self.tokenizer, limit=self.limit, stop=self.stop)
        for record in records:
            self._file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._file.flush()
        rows = [[record[c] for c in TABLE_COLUMNS] for record in records]
        self.writer.write_table(step, TABLE_TAG, TABLE_COLUMNS, rows)
        return records

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class NullSampleLogger(Closing):
    """`SampleLogger`'s interface, writing nothing (sampling off, or not process 0)."""

    def write(self, step: int, rollouts: Sequence[Any], last: bool = False) -> list[dict[str, Any]]:
        del step, rollouts, last
        return []

    def close(self) -> None:
        pass


def sample_logger(config, out_dir, writer, tokenizer, start_step: int | None, primary: bool):
    """The run's logger of `config.samples_every` and `config.samples_per_log` (a
    `TrainConfig`); process 0 writes the samples of its share of each batch. With sampling
    off, the records an earlier run in `out_dir` wrote of the steps this run makes go."""
    if not primary:
        return NullSampleLogger()
    if not config.samples_every:
        path = Path(out_dir) / SAMPLES_FILE
        if path.exists():
            keep_before(path, start_step or 0)
            if not path.stat().st_size:
                path.unlink()
        return NullSampleLogger()
    every, limit, stop = config.samples_every, config.samples_per_log, config.generation.stop
    return SampleLogger(out_dir, writer, tokenizer, every=every, limit=limit,
                        start_step=start_step, stop=stop)  # fmt: skip
