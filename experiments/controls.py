"""Controls: does a method's result come from staleness, from its loss, or from its step size?

- M2PO and sequence TIS without staleness (k=0): both are clip-free objectives, so a failure
  at k=8 or 16 may be theirs at this learning rate rather than staleness's.
- Naive GRPO at learning rate 4e-4 (k=0, 8, 16): VCPO's ESS scaling shrinks the step by
  sqrt(ESS/B), about 0.65-0.8 here, so part of its effect may be a smaller learning rate.

Lagged mode from the shipped countdown warm start (preset `countdown_sweep`), seeds 0 1. The
runs live in experiments/runs/lagged. Resumable: run it again to finish.

    python experiments/controls.py             # 10 runs, 2 processes, ~12 minutes here
    python experiments/report.py
"""

from __future__ import annotations

from gac_jax.train.sweeps import METHODS, RunSpec, sweep_main

SMALLER_LR = 4e-4


def specs(seeds):
    runs = []
    for seed in seeds:
        runs += [
            RunSpec(f"{m}/k0", ("rollout.lag=0", *METHODS[m]), seed) for m in ("m2po", "seq_tis")
        ]
        runs += [
            RunSpec(
                f"naive_lr{SMALLER_LR:g}/k{k}",
                (f"rollout.lag={k}", f"optimizer.learning_rate={SMALLER_LR}"),
                seed,
            )
            for k in (0, 8, 16)
        ]
    return runs


if __name__ == "__main__":
    sweep_main(
        __doc__.split("\n")[0],
        specs,
        script=__file__,
        default_root="experiments/runs/lagged",
        default_seeds=(0, 1),
    )
