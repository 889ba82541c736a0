"""Cures: every method of `gac_jax.train.sweeps.METHODS` at staleness k=8 and k=16, and sync.

Lagged mode from the shipped countdown warm start (preset `countdown_sweep`), 3 seeds; sync
is naive GRPO at k=0. The runs live in experiments/runs/lagged, shared with diagnosis.py: a
run both need is made once. Resumable: run it again to finish.

    python experiments/cures.py                # 39 runs, 2 processes, ~60 minutes here
    python experiments/report.py
"""

from __future__ import annotations

from gac_jax.train.sweeps import METHODS, RunSpec, sweep_main

LAGS = (8, 16)


def specs(seeds):
    runs = []
    for seed in seeds:
        runs.append(RunSpec("naive/k0", ("rollout.lag=0",), seed))
        for k in LAGS:
            runs += [
                RunSpec(f"{name}/k{k}", (f"rollout.lag={k}", *overrides), seed)
                for name, overrides in METHODS.items()
            ]
    return runs


if __name__ == "__main__":
    sweep_main(
        __doc__.split("\n")[0],
        specs,
        script=__file__,
        default_root="experiments/runs/lagged",
        default_seeds=(0, 1, 2),
    )
