"""Host-side rollout system: version-tagged groups, versioned params, a bounded buffer.

`Rollout` records carry the policy version that sampled them; `ParamStore` holds published
versions; `RolloutBuffer` bounds memory and staleness; `RolloutWorker` threads generate in
asynchronous mode; `SyncRollouts`, `LaggedRollouts` and `AsyncRollouts` give the learner one
call, `next_batch(step)`, for the three modes. `collate` lays groups out as the arrays of a
train step; the staleness and reservation rules are the pure functions of
`gac_jax.rollout.staleness`. `evaluate_policy` scores a policy on held-out problems through
the same generation path as training.
"""

from gac_jax.rollout.batching import BATCH_KEYS, OverlongConfig, collate
from gac_jax.rollout.buffer import (
    STALE_POLICIES,
    BufferConfig,
    BufferStats,
    RolloutBuffer,
    RolloutBufferClosed,
    RolloutWorkerError,
)
from gac_jax.rollout.episodes import EpisodeConfig, EpisodeRunner
from gac_jax.rollout.evaluation import EvalSettings, evaluate_policy, pass_at_k
from gac_jax.rollout.generation import (
    DecodeSetup,
    GenerationConfig,
    TaskGroupGenerator,
    make_sampler,
)
from gac_jax.rollout.param_store import ParamStore
from gac_jax.rollout.placement import PlacementConfig, RolloutPlacement
from gac_jax.rollout.ray_cluster import LocalRayCluster, RayConfig
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.sources import (
    ROLLOUT_MODES,
    AsyncRollouts,
    LaggedRollouts,
    Partition,
    RolloutConfig,
    SyncRollouts,
    make_source,
    store_history,
)
from gac_jax.rollout.worker import (
    GenerateGroups,
    GroupNumbering,
    GroupRequest,
    PromptOrder,
    RolloutWorker,
    group_key,
)

__all__ = ["EpisodeConfig", "EpisodeRunner", "LocalRayCluster", "PlacementConfig", "RayConfig",
           "RolloutPlacement", "EvalSettings", "evaluate_policy", "pass_at_k", "BATCH_KEYS",
           "ROLLOUT_MODES", "STALE_POLICIES", "AsyncRollouts", "BufferConfig", "BufferStats",
           "GenerationConfig", "RolloutConfig", "DecodeSetup", "TaskGroupGenerator", "make_sampler",
           "make_source", "store_history", "GenerateGroups", "GroupNumbering", "GroupRequest",
           "LaggedRollouts", "Partition", "ParamStore", "PromptOrder", "Rollout", "RolloutBuffer",
           "RolloutBufferClosed", "RolloutWorker", "RolloutWorkerError", "SyncRollouts", "collate",
           "group_key", "OverlongConfig"]  # fmt: skip
