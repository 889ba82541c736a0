"""Real asynchrony: the methods of `gac_jax.train.sweeps.METHODS` with rollout worker threads.

Async mode (preset `countdown_sweep` with `rollout.mode=async`): one worker thread samples
with whatever policy version was published last while the learner trains, the buffer blocks
the worker beyond staleness 8 (ROLL Flash's alpha). Staleness here is what the timing makes
it, so runs are not bit-reproducible; each run's measured staleness is in its summary.
One process at a time (the worker and the learner share the two cores).

    python experiments/real_async.py           # 6 runs, ~15 minutes here
    python experiments/report.py
"""

from __future__ import annotations

from gac_jax.train.sweeps import METHODS, RunSpec, sweep_main

ASYNC = (
    "rollout.mode=async",
    "buffer.max_staleness=8",
    "buffer.stale_policy=block",
    "rollout.num_workers=1",
    "rollout.groups_per_call=16",
)


def specs(seeds):
    return [
        RunSpec(f"{name}/async", (*ASYNC, *overrides), seed)
        for seed in seeds
        for name, overrides in METHODS.items()
    ]


if __name__ == "__main__":
    sweep_main(
        __doc__.split("\n")[0],
        specs,
        script=__file__,
        default_root="experiments/runs/async",
        default_seeds=(0,),
        default_jobs=1,
    )
