"""GAC's settings compared at staleness k=16: thresholds, projection, reference, scope.

Lagged mode from the shipped countdown warm start (preset `countdown_sweep`), 3 seeds; the
default GAC run (tau_low 0.2, tau_high 0.8, partial projection, gradient reference, global
scope) and naive k=16 are the cures sweep's. The runs live in experiments/runs/lagged.
Resumable: run it again to finish.

    python experiments/gac_defaults.py         # 24 runs, 2 processes, ~25 minutes here
    python experiments/report.py
"""

from __future__ import annotations

from gac_jax.train.sweeps import RunSpec, sweep_main

LAG = 16
VARIANTS = {
    "gac_tau0.0": ("gac.tau_low=0.0",),
    "gac_tau0.1": ("gac.tau_low=0.1",),
    "gac_tau0.4": ("gac.tau_low=0.4",),
    "gac_full": ("gac.projection=full",),
    "gac_ref_update": ("gac.reference=update",),
    "gac_ref_ema": ("gac.reference=ema",),
    "gac_adaptive": ("gac.thresholds=adaptive",),
    "gac_per_leaf": ("gac.scope=per_leaf",),
}


def specs(seeds):
    return [
        RunSpec(
            f"{name}/k{LAG}", (f"rollout.lag={LAG}", "gac.monitor_only=false", *overrides), seed
        )
        for seed in seeds
        for name, overrides in VARIANTS.items()
    ]


if __name__ == "__main__":
    sweep_main(
        __doc__.split("\n")[0],
        specs,
        script=__file__,
        default_root="experiments/runs/lagged",
        default_seeds=(0, 1, 2),
    )
