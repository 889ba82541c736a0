"""Diagnosis: naive lagged GRPO at staleness k in {0, 1, 2, 4, 8, 16}, and k=8 with GAC.

Every run starts from the shipped countdown warm start (preset `countdown_sweep`); step t
trains on rollouts of policy version max(0, t - k), so k=0 is synchronous GRPO. The runs
live in experiments/runs/lagged, shared with cures.py: a run both need is made once.
Resumable: run it again to finish.

    python experiments/diagnosis.py            # 14 runs, 2 processes, ~25 minutes here
    python experiments/report.py               # tables and plots from all sweeps
"""

from __future__ import annotations

from gac_jax.train.sweeps import METHODS, RunSpec, sweep_main

LAGS = (0, 1, 2, 4, 8, 16)


def specs(seeds):
    runs = []
    for seed in seeds:
        runs += [RunSpec(f"naive/k{k}", (f"rollout.lag={k}",), seed) for k in LAGS]
        runs.append(RunSpec("gac/k8", ("rollout.lag=8", *METHODS["gac"]), seed))
    return runs


if __name__ == "__main__":
    sweep_main(
        __doc__.split("\n")[0],
        specs,
        script=__file__,
        default_root="experiments/runs/lagged",
        default_seeds=(0, 1),
    )
