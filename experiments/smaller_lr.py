"""Every method again at learning rate 4e-4: are the cures' differences more than step size?

`controls.py` found naive GRPO at 4e-4 better than every method at the sweeps' 6e-4, and
VCPO's ESS scaling shrinks the step by about as much. This sweep runs every method of
`gac_jax.train.sweeps.METHODS` at 4e-4, at staleness k=8 and k=16, and sync (k=0), so the
methods are compared at a step size that suits this policy; and naive GRPO at 3e-4 at k=16,
about VCPO's effective step there.

Lagged mode from the shipped countdown warm start (preset `countdown_sweep`), 3 seeds. The
runs live in experiments/runs/lagged (naive at 4e-4 is shared with controls.py). Resumable:
run it again to finish.

    python experiments/smaller_lr.py           # 42 runs, 2 processes, ~40 minutes here
    python experiments/report.py
"""

from __future__ import annotations

from gac_jax.train.sweeps import METHODS, RunSpec, sweep_main

LEARNING_RATE = 4e-4
LAGS = (8, 16)
# Control: naive GRPO at about VCPO's effective step at k=16 (sqrt(ESS/B) ~ 0.73 x 4e-4).
CONTROL_LEARNING_RATE = 3e-4
CONTROL_LAG = 16


def label(method: str, lag: int, learning_rate: float = LEARNING_RATE) -> str:
    return f"{method}_lr{learning_rate:g}/k{lag}"


def specs(seeds):
    lr = f"optimizer.learning_rate={LEARNING_RATE}"
    runs = []
    for seed in seeds:
        runs.append(RunSpec(label("naive", 0), ("rollout.lag=0", lr), seed))
        for k in LAGS:
            runs += [
                RunSpec(label(name, k), (f"rollout.lag={k}", lr, *overrides), seed)
                for name, overrides in METHODS.items()
            ]
        runs.append(
            RunSpec(
                label("naive", CONTROL_LAG, CONTROL_LEARNING_RATE),
                (f"rollout.lag={CONTROL_LAG}", f"optimizer.learning_rate={CONTROL_LEARNING_RATE}"),
                seed,
            )
        )
    return runs


if __name__ == "__main__":
    sweep_main(
        __doc__.split("\n")[0],
        specs,
        script=__file__,
        default_root="experiments/runs/lagged",
        default_seeds=(0, 1, 2),
    )
