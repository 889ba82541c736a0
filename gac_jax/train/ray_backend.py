"""`rollout.backend=ray`: the run's rollout workers as Ray actor processes.

The learner process (or processes) keep the buffer, the staleness bound and the group
numbering (`AsyncRollouts`); each worker thread hands its sampler calls to one actor
(`RayRolloutPool`), which builds the run's model, sampler and task on its own devices from
the same `TrainConfig` (`ActorGenerator`) and receives each version's params through Ray's
object store. Ray is joined here if the caller has not: at `RAY_ADDRESS`, or on a new
local cluster started from a clean interpreter (`LocalRayCluster`, so no Python runs in a
forked child of this JAX process) and stopped when the process exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from typing import Any

import jax

from gac_jax.rollout.ray_cluster import LocalRayCluster
from gac_jax.rollout.ray_rollouts import RayRolloutPool
from gac_jax.train.config import TrainConfig

# The driver's JAX settings the actors inherit (so a CPU run's actors stay on the CPU,
# with the same fake device count).
INHERITED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS")


@dataclasses.dataclass(frozen=True)
class ActorGenerator:
    """Picklable factory run inside each rollout actor: the run's `TaskGroupGenerator` on
    the actor's local devices (tensor-parallel by `rollout.tensor_parallel`), and the
    function that places a host copy of the params there."""

    config: TrainConfig

    def __call__(self) -> tuple[Any, Any]:
        from flax import nnx

        from gac_jax import models
        from gac_jax.rollout import TaskGroupGenerator, make_sampler
        from gac_jax.rollout.placement import RolloutPlacement, rollout_mesh
        from gac_jax.train.loop import build_model, build_task

        c = self.config
        task = build_task(c)
        examples = task.data_source("train", data_dir=c.data_dir)
        mesh = rollout_mesh(jax.local_devices(), c.rollout.tensor_parallel)
        model, tokenizer = build_model(c, mesh)
        model = models.with_compute(model, c.compute)
        graphdef, _ = nnx.split(model)
        sampler = make_sampler(model.config, tokenizer, c.generation)
        del model  # The learner sends every version's params; these only gave the layout.
        placement = RolloutPlacement(mesh, mesh)
        generator = TaskGroupGenerator(
            graphdef, sampler, task, examples, tokenizer, c.generation, placement=placement
        )
        return generator, placement.to_rollout


def make_pool(config: TrainConfig) -> RayRolloutPool:
    """The run's `RayRolloutPool`: `rollout.num_workers` actors, started on the Ray
    cluster `RAY_ADDRESS` names (a new local one if it names none)."""
    import ray

    if not ray.is_initialized():
        if "RAY_ADDRESS" in os.environ:
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            cluster = LocalRayCluster().start()
            atexit.register(cluster.stop)  # Runs after Ray's own shutdown (atexit is LIFO).
            cluster.connect()
    env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
    return RayRolloutPool(
        ActorGenerator(config),
        config.rollout.num_workers,
        on_actor_failure=config.rollout.on_actor_failure,
        actor_options={"num_gpus": config.rollout.actor_gpus}
        if config.rollout.actor_gpus
        else None,
        env=env,
    )
