"""Host-side rollout system: version-tagged groups, versioned params, a bounded buffer.

`Rollout` records carry the policy version that sampled them; `ParamStore` holds published
versions; `RolloutBuffer` bounds memory and staleness; `RolloutWorker` threads generate in
asynchronous mode; `SyncRollouts`, `LaggedRollouts` and `AsyncRollouts` give the learner one
call, `next_batch(step)`, for the three modes.
"""

from gac_jax.rollout.buffer import (
    STALE_POLICIES,
    BufferStats,
    RolloutBuffer,
    RolloutBufferClosed,
    RolloutWorkerError,
)
from gac_jax.rollout.param_store import ParamStore
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.sources import AsyncRollouts, LaggedRollouts, SyncRollouts
from gac_jax.rollout.worker import (
    GenerateGroups,
    GroupRequest,
    PromptOrder,
    RolloutWorker,
    group_key,
)

__all__ = [
    "STALE_POLICIES",
    "AsyncRollouts",
    "BufferStats",
    "GenerateGroups",
    "GroupRequest",
    "LaggedRollouts",
    "ParamStore",
    "PromptOrder",
    "Rollout",
    "RolloutBuffer",
    "RolloutBufferClosed",
    "RolloutWorker",
    "RolloutWorkerError",
    "SyncRollouts",
    "group_key",
]
