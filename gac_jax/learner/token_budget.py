"""Micro-batches by token budget: trim a batch's padding, then split it so that no
micro-batch holds more than a budget of (padded) tokens on one device.

A rollout batch is as wide as its longest possible completion (prompt_length +
max_new_tokens); with heavy-tailed response lengths most columns are padding in most
batches. `trim_padding` cuts the columns no row uses (rounded up to a multiple, so a run
compiles the step for a handful of widths, not one per batch), and `budget_micro_batches`
picks the fewest micro-batches whose rows fit the budget: a batch of short completions
runs in one or two, the batch with one very long completion in more, and the memory of a
micro-batch stays bounded either way. Trimming changes no result: the model is causal, the
cut columns are masked everywhere, and positions come from the attention mask.

On XLA:CPU a step's temporaries are one buffer, faulted in page by page on every call, so
a large step runs faster split: `cpu_tokens_per_micro_batch` is the token budget that
keeps a micro-batch's activations under `CPU_ACTIVATION_BYTES` (the learner's default).

`MicroBatching` is the one place that turns these rules and a `LearnerConfig` into a
step's micro-batch count.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gac_jax.learner.batch import TrainBatch
from gac_jax.models.config import ModelConfig

# Fields of a `TrainBatch` laid out [N, T].
TOKEN_FIELDS = ("tokens", "attention_mask", "loss_mask", "behaviour_logp")
# A CPU micro-batch's temporaries, and its fewest tokens (smaller matmuls run slower): the
# fastest splits measured (benchmarks/README.md, b371f34).
CPU_ACTIVATION_BYTES = 64 << 20
CPU_MIN_TOKENS = 512


def cpu_tokens_per_micro_batch(model: ModelConfig, width: int) -> int:
    """Tokens of rows `width` wide whose step temporaries fit in `CPU_ACTIVATION_BYTES`
    (at least `CPU_MIN_TOKENS`): per token ``L (6D + 6F + 5NH + 2KH + 1.5NT) + 3V``
    float32s, 0.8x-1.25x XLA:CPU's arena for the models measured (tests)."""
    m, n = model, model.num_heads
    per_layer = 6 * (m.embed_dim + m.mlp_dim) + (5 * n + 2 * m.num_kv_heads) * m.head_dim
    per_layer += 3 * n * width // 2  # Attention's scores and probabilities.
    per_token = 4 * (m.num_layers * per_layer + 3 * m.vocab_size)
    return max(CPU_MIN_TOKENS, CPU_ACTIVATION_BYTES // per_token)


def used_columns(attention_mask: np.ndarray) -> tuple[int, int]:
    """[first, end) of the columns some row attends to ((0, 0) when none does)."""
    used = np.flatnonzero(np.asarray(attention_mask).any(axis=0))
    return (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)


def trim_padding(batch: TrainBatch, multiple: int, columns: tuple[int, int] | None = None):
    """`batch` (host arrays) without the padding columns outside `columns` (default
    `used_columns`), its width rounded up to a multiple of `multiple` by keeping padding
    columns on the right (or on the left where the right has too few)."""
    width = batch.tokens.shape[1]
    first, end = used_columns(batch.attention_mask) if columns is None else columns
    keep = min(width, max(multiple, -(-(end - first) // multiple) * multiple))
    end = min(width, first + keep)
    first = end - keep
    return dataclasses.replace(
        batch, **{name: np.asarray(getattr(batch, name))[:, first:end] for name in TOKEN_FIELDS}
    )


def budget_micro_batches(
    rows: int, width: int, max_tokens: int, *, minimum: int = 1, devices: int = 1
) -> int:
    """The fewest micro-batches m (a divisor of `rows`, at least `minimum`, leaving each
    device whole rows) with rows / (m * devices) * width <= `max_tokens`; the most there
    are (one row per device) when even that exceeds the budget. A `minimum` above that
    most is refused: it cannot be honoured."""
    candidates = [m for m in range(1, rows + 1) if rows % m == 0 and (rows // m) % devices == 0]
    if not candidates:
        raise ValueError(f"{rows} rows cannot be split evenly over {devices} devices.")
    if minimum > candidates[-1]:
        raise ValueError(
            f"micro_batches={minimum} leaves less than one row a device: {rows} rows over "
            f"{devices} devices split into at most {candidates[-1]} micro-batches."
        )
    for m in candidates:
        if m >= minimum and rows // (m * devices) * width <= max_tokens:
            return m
    return candidates[-1]


@dataclasses.dataclass(frozen=True)
class MicroBatching:
    """How many micro-batches a step splits a batch into, decided here and only here."""

    least: int = 1  # Every batch is split into at least this many (`micro_batches`).
    max_tokens: int | None = None  # Per device and micro-batch (`max_tokens_per_micro_batch`).
    cpu_model: ModelConfig | None = None  # Whose XLA:CPU budget applies, if any.
    mini_batches: int = 1  # Optimizer steps per batch: a micro-batch splits one of them.
    devices: int = 1  # The devices a batch's rows are split over.

    @classmethod
    def of(cls, config, *, cpu_model: ModelConfig | None = None, devices: int = 1):
        """The rule of a `LearnerConfig`: at least its `micro_batches` (1 unset), within its
        token budget; with neither set, within `cpu_model`'s XLA:CPU budget, if given."""
        m, budget = config.micro_batches, config.max_tokens_per_micro_batch
        return cls(m or 1, budget, None if m or budget else cpu_model, config.mini_batches, devices)

    def count(self, rows: int, width: int) -> int:
        """Micro-batches for a batch of `rows` x `width` tokens (`budget_micro_batches`)."""
        budget = self.max_tokens
        if self.cpu_model is not None:
            budget = cpu_tokens_per_micro_batch(self.cpu_model, width)
        if not budget:
            return self.least
        rows = rows // self.mini_batches  # One optimizer step's.
        return budget_micro_batches(rows, width, budget, minimum=self.least, devices=self.devices)

    def __str__(self) -> str:
        """The rule that gives the count, in one line."""
        if self.cpu_model is None and not self.max_tokens:
            return f"micro_batches={self.least}"
        budget = f"max_tokens_per_micro_batch={self.max_tokens}"
        if self.cpu_model is not None:
            budget = f"XLA:CPU's {CPU_ACTIVATION_BYTES >> 20} MiB of temporaries"
        return f"the fewest micro-batches (at least {self.least}) within {budget} a device"
