"""The laboratory (issue #21): every sweep behind experiments/RESULTS.md, one resumable command.

Every run starts from the preset `lab` (tiny on countdown from a 300-step warm start, lagged
mode: step t trains on rollouts of policy version max(0, t - k), so k=0 is synchronous GRPO).
The sweeps' lengths were cut to fit the whole set in about 2 hours on 2 cores, within one
3-hour session with its report:

- ``sync``: synchronous GRPO, 5 seeds, 1500 steps, evaluated every 100, with the gradient
  noise scale measured all along (mini-batch halves): does RL learn, and by how much?
- ``staleness``: naive GRPO at k in {0, 2, 8, 32, 64, 128}, at the lab's learning rate and
  at a quarter of it (the LLM-like small step), 1 seed, 500 steps: where do ESS, gradient
  norm, clip fraction and c_t turn?
- ``alignment``: the gradient noise scale and c_t at 1 to 128 prompts a batch, at k in
  {0, 8, 32}, 1 seed, 100 steps each: does c_t follow 1 / (1 + B_simple / B)?
- ``cures``: every method of `gac_jax.lab.sweeps.METHODS` at k=32, and naive GRPO at half
  the learning rate (the step-size control of VCPO's ESS scaling), 5 seeds, 200 steps
  (naive GRPO at k=32 already trails synchronous GRPO there).
- ``async``: naive GRPO and GAC with a real rollout worker thread (staleness bound 32,
  buffer room for 32 batches), 1 seed, 200 steps; one process at a time (the worker and
  the learner share the cores).

- ``v5`` (issue #62): GAC on top of PPO-clip in v4's cell, the controls that separate bias
  correction from a trust region, random skips at GAC's rate, VESPO and DPPO, 5 seeds;
  ``v5pilot`` picks the harsher cell (``V5_HARSH``) and ``v5harsh`` runs it; ``v5floor``
  re-runs PPO with a change of rounding only. Report: ``experiments/report_v5.py``.

- ``tools`` (issue #35): the `calculator` preset's multi-turn tool episodes: sync, naive,
  VCPO and GAC at k=16 in laboratory v3's regime, and the preset as it is (synchronous
  PPO-clip), 5 seeds, 100 steps.

The lagged runs live in ``ROOT/lagged``, the asynchronous ones in ``ROOT/async`` and the
tool task's in ``ROOT/tools``. Run it
again to resume; a finished run made by
other code is refused unless --rerun-stale or --allow-stale.

    python experiments/lab.py                        # everything: 2 processes, ~2 h here
    python experiments/lab.py --only sync staleness  # some sweeps
    python experiments/lab.py --only v5 --arms ppo sync  # some arms of them
    python experiments/lab.py --quick --root /tmp/lab_quick   # a few minutes: the plumbing
    python experiments/report.py                     # tables, plots and RESULTS.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gac_jax.lab.provenance import StaleRunError
from gac_jax.lab.sweeps import (
    METHODS,
    RunSpec,
    SweepProcesses,
    add_sweep_arguments,
    base_config,
    run_sweep,
    stale_setting,
)
from gac_jax.train.config import LAB_LEARNING_RATE, get_preset

SYNC_LABEL = "sync/k0"  # Its own label: longer than the staleness sweep's naive/k0.
SYNC_STEPS = 1500
STALENESS_STEPS = 500
CURE_STEPS = 200  # Naive GRPO at k=32 already trails synchronous GRPO at step 200.
LAGS = (0, 2, 8, 32, 64, 128)
SMALL_LR = LAB_LEARNING_RATE / 4  # The LLM-like small step of the staleness sweep.
CONTROL_LR = LAB_LEARNING_RATE / 2  # The step-size control of the cures.
CURE_LAG = 32
ALIGN_GROUPS = (1, 4, 16, 128)  # Prompts a batch (x 8 completions each).
ALIGN_LAGS = (0, 8, 32)
ALIGN_STEPS = 100  # c_t and B_simple need no full run; 128 prompts a step cost 8x.
NOISE_SCALE = ("learner.micro_batches=2", "learner.noise_scale=true")  # B_simple's estimator.
ASYNC_STALENESS = 32
ASYNC = (
    "rollout.mode=async",
    f"buffer.max_staleness={ASYNC_STALENESS}",
    # Room for the worker to run ASYNC_STALENESS batches ahead (the default, two batches,
    # holds the staleness at about 3).
    f"buffer.capacity={ASYNC_STALENESS * get_preset('lab').rollout.groups_per_batch}",
    "buffer.stale_policy=block",
    "rollout.num_workers=1",
    "rollout.groups_per_call=16",
)
# Laboratory v3 (issue #32): the regime where naive asynchrony fails. REINFORCE with
# sequence-level importance weights (cap 1e4: in effect uncapped), no PPO clip, 32 prompts a
# step, lr 5e-4, 150 steps; the pilot's lagged k=16 run fell to pass@1 0.000 by step 49.
V3_LR = 5e-4
V3_LAG = 16
V3_REGIME = (
    f"optimizer.learning_rate={V3_LR}",
    "loss.policy_loss=reinforce",
    "loss.correction=tis",
    "loss.correction_kwargs.level=sequence",
    "loss.correction_kwargs.cap=10000.0",
)
V3_SIZE = ("rollout.groups_per_batch=32", "steps=150", "eval_every=50", "checkpoint_every=75")
# The naive run's own loss as VCPO's authors train it (mit-han-lab/vcpo
# recipe/fully_async_policy/shell/vcpo/math/vcpo_k=32.sh): sequence TIS capped at 8,
# seq-mean-token-mean.
AUTHORS_LOSS = (
    "loss.correction_kwargs.cap=8.0",
    "loss.loss_kwargs.aggregation=seq-mean-token-mean",
)
# GAC's thresholds from the naive runs' measured c_t before their collapse (pilot, steps
# 1-39 of naive k=16: median 0.00, 75th percentile 0.16, 90th 0.27; the pilot had
# median 0.05 and 90th percentile 0.36): project above about the median, skip above the
# 90th percentile.
GAC_MEASURED = ("gac.monitor_only=false", "gac.tau_low=0.05", "gac.tau_high=0.3")
CELL = {  # label -> overrides on the regime (lag 16 unless they say).
    "sync": ("rollout.lag=0",),
    "naive": (),
    "vcpo": ("ess={}", "loss.advantage=vcpo"),
    # VCPO knob for knob: their loss, ESS square-root scaling of the raw weights, the
    # off-policy optimal baseline with their weights and exact per-sequence gradient norms.
    "vcpo_authors": (
        *AUTHORS_LOSS,
        "ess={}",
        "loss.advantage=vcpo",
        "loss.advantage_kwargs.baseline_weights=released",
        "loss.advantage_kwargs.cap=8.0",
    ),
    "naive_cap8": AUTHORS_LOSS,  # vcpo_authors' own naive run.
    "gac": GAC_MEASURED,
    "gac_adaptive": ("gac.monitor_only=false", "gac.thresholds=adaptive"),
    # The step-size controls: naive asynchrony at half and a quarter of the step (the one
    # whose per-step KL matches a cure's is its matched control; the report says which).
    f"naive_lr{V3_LR / 2:g}": (f"optimizer.learning_rate={V3_LR / 2}",),
    f"naive_lr{V3_LR / 4:g}": (f"optimizer.learning_rate={V3_LR / 4}",),
}
# The map: where does naive asynchrony lose to synchronous training at the same step? The
# papers' naive estimators (REINFORCE with sequence or token importance weights, uncapped
# and capped as VCPO's authors run it) next to PPO-clip, at several staleness levels.
MAP_LOSSES = {
    "seq_is": V3_REGIME,
    "tok_is": (*V3_REGIME, "loss.correction_kwargs.level=token"),
    "seq_tis8": (*V3_REGIME, *AUTHORS_LOSS),
    "ppo": (f"optimizer.learning_rate={V3_LR}",),  # PPO-clip against the behaviour policy.
    "seq_is_dynamic": (*V3_REGIME, "rollout.dynamic_sampling=true"),
}
MAP_LAGS = (0, 4, 16, 64)
# The tool task (issue #35): the `calculator` preset's multi-turn episodes in the v3 regime
# at k=16, where the pilot's naive run fell to reward 0 by step 26 (sync: pass@1 0.19 ->
# 0.275 after 100 steps); and the preset as it is (PPO-clip, lr 2e-4, synchronous).
TOOL_LAG = 16
TOOL_SIZE = ("steps=100", "eval_every=25", "checkpoint_every=50")
TOOL_CELL = {
    "sync": ("rollout.lag=0",),
    "naive": (),
    "vcpo": CELL["vcpo"],
    "gac": GAC_MEASURED,
    # The step-size control of VCPO's ESS scaling (on countdown, naive at half the step
    # matched VCPO's per-step KL).
    f"naive_lr{V3_LR / 2:g}": (f"optimizer.learning_rate={V3_LR / 2}",),
}
# Laboratory v4 (issue #41): the cell where alignment, not variance, fails training. Stale
# rollouts trained as if on-policy (`naive_pg`: no importance weight, the gradient of verl's
# recompute default at one update a batch), 128 prompts x 8 a step, lr 5e-4, 150 steps: the
# pilot's naive k=16 runs had c_t median 0.34-0.35 over their first 40 steps (sync 0.07-0.21),
# a per-step KL 7-8x sync's, and fell from pass@1 0.068 to 0.02-0.03 while sync rose to 0.18.
V4_LR = 5e-4
V4_LAG = 16
V4_REGIME = (
    f"optimizer.learning_rate={V4_LR}",
    "loss.policy_loss=naive_pg",
    "rollout.groups_per_batch=128",
)
V4_SIZE = ("steps=150", "eval_every=50", "checkpoint_every=50")
ACTIVE = "gac.monitor_only=false"
# Thresholds from the synchronous runs' measured c_t (pilot, 2 seeds: medians 0.11 and 0.20,
# 90th percentiles 0.35 and 0.49): project what is more aligned than synchronous training's
# median step, skip what only a tenth of its steps reach.
GAC_SYNC_BAND = (ACTIVE, "gac.tau_low=0.15", "gac.tau_high=0.45")
# On applied updates (after Adam): consecutive applied updates of synchronous training have
# a cosine of 0.88-0.91 (pilot, 10-step medians; momentum), the stale runs' 0.93-0.97.
# Project down to synchronous training's level, skip beyond what the stale runs reached.
ON_UPDATES = (ACTIVE, "gac.acts_on=update", "gac.reference=update")
GAC_UPDATE = (*ON_UPDATES, "gac.tau_low=0.9", "gac.tau_high=0.97")
V4_SMALL_LR = V4_LR / 4  # Naive's per-step KL there (pilot: 0.0074) is close to sync's.
V4_CELL = {  # label -> overrides on the regime (lag 16 unless they say).
    "sync": ("rollout.lag=0",),
    "naive": (),
    "gac": (ACTIVE,),  # The defaults, 0.2 / 0.8.
    "gac_sync_band": GAC_SYNC_BAND,
    "gac_held": (*GAC_SYNC_BAND, "gac.reference_after_skip=held"),
    "gac_adaptive": (ACTIVE, "gac.thresholds=adaptive"),
    "gac_update": GAC_UPDATE,
    "ppo": ("loss.policy_loss=ppo",),  # PPO-clip against the behaviour policy: the bar.
    # VCPO as its authors train it: sequence TIS capped at 8, seq-mean-token-mean, ESS
    # step scaling, the off-policy optimal baseline with their weights.
    "vcpo": (
        "loss.policy_loss=reinforce",
        "loss.correction=tis",
        "loss.correction_kwargs.level=sequence",
        *AUTHORS_LOSS,
        "ess={}",
        "loss.advantage=vcpo",
        "loss.advantage_kwargs.baseline_weights=released",
        "loss.advantage_kwargs.cap=8.0",
    ),
    # The controls: the step size (the one whose per-step KL matches a cure's is its
    # control; the report says which) and less momentum, at the small step (at lr 5e-4,
    # b1 0.5 moved the policy up to 1000x more a step: Adam without averaging).
    f"naive_lr{V4_LR / 2:g}": (f"optimizer.learning_rate={V4_LR / 2}",),
    f"naive_lr{V4_SMALL_LR:g}": (f"optimizer.learning_rate={V4_SMALL_LR}",),
    f"naive_b1_0.5_lr{V4_SMALL_LR:g}": (
        f"optimizer.learning_rate={V4_SMALL_LR}",
        "optimizer.b1=0.5",
    ),
    f"naive_b1_0_lr{V4_SMALL_LR:g}": (f"optimizer.learning_rate={V4_SMALL_LR}", "optimizer.b1=0.0"),
}
# The order of a seed's runs: the comparison's core first, so a partial sweep answers most.
V4_ORDER = (
    "naive",
    "sync",
    "gac_sync_band",
    "gac_update",
    "ppo",
    "gac",
    f"naive_lr{V4_SMALL_LR:g}",
    "vcpo",
    "gac_adaptive",
    f"naive_lr{V4_LR / 2:g}",
    f"naive_b1_0.5_lr{V4_SMALL_LR:g}",
    f"naive_b1_0_lr{V4_SMALL_LR:g}",
    "gac_held",
)
# Laboratory v5 (issue #62): GAC where the paper runs it, on a clipped, importance-weighted
# loss with headroom (PPO 0.122 against sync 0.182 in v4), the controls that separate bias
# correction from a trust region, random skips, the 2026 cures from their authors' code, and
# a harsher cell. v4's cell (128 prompts x 8, k=16, lr 5e-4, 150 updates), evaluated every
# 25 updates on the whole test split (500 problems x 8 samples: countdown n3_max20 holds no
# more); the score is the mean of the evaluations after 100, 125 and 150 updates.
V5_SIZE = ("steps=150", "eval_every=25", "eval_size=500", "checkpoint_every=25")
PPO = "loss.policy_loss=ppo"
# Thresholds from PPO's own cosines in v4's cell (5 seeds, 740 steps: applied updates median
# 0.919, 90th percentile 0.963; raw gradients' c_t median 0.318, 90th percentile 0.571):
# project above the median, skip above the 90th percentile.
PPO_GAC_UPDATE = (*ON_UPDATES, "gac.tau_low=0.92", "gac.tau_high=0.96")
PPO_GAC_GRAD = (ACTIVE, "gac.tau_low=0.32", "gac.tau_high=0.57")
# v4's gac_update (naive_pg) skipped 43.6% of its steps (5 seeds), in 88 streaks of mean
# length 3.7 (longest 58): the random-skip controls skip as often, i.i.d. or in streaks.
GAC_UPDATE_SKIP_RATE = 0.436
GAC_UPDATE_STREAK = 3.7
# v5's gac_update, with its skips bounded at 8 in a row, skipped less: 37.2% of its steps in
# 115 streaks of mean length 2.43 (5 seeds). `random_skip_matched` skips as it did.
V5_GAC_UPDATE_SKIP_RATE = 0.372
V5_GAC_UPDATE_STREAK = 2.43
TOKEN_TIS2 = ("loss.policy_loss=reinforce", "loss.correction=tis",
              "loss.correction_kwargs.level=token", "loss.correction_kwargs.cap=2.0")  # fmt: skip
V5_CELL = {  # label -> overrides on v4's regime (naive_pg, lag 16 unless they say).
    "sync": ("rollout.lag=0",),
    "naive": (),
    "ppo": (PPO,),
    "ppo_gac_update": (PPO, *PPO_GAC_UPDATE),
    "ppo_gac": (PPO, *PPO_GAC_GRAD),
    f"ppo_lr{V4_LR / 2:g}": (PPO, f"optimizer.learning_rate={V4_LR / 2}"),
    # Bias against drift: importance weights with no trust region; a trust region with
    # unit weights.
    "reinforce_tis2": TOKEN_TIS2,
    "naive_trust_region": ("loss.policy_loss=naive_pg_trust_region",),
    "vespo": ("loss.policy_loss=vespo",),
    "dppo_binary_tv": ("loss.policy_loss=dppo_binary_tv",),
    "vcpo": V4_CELL["vcpo"],
    "gac_update": GAC_UPDATE,
    "random_skip": (f"gac.random_skip_rate={GAC_UPDATE_SKIP_RATE}",),
    "random_skip_streaks": (
        f"gac.random_skip_rate={GAC_UPDATE_SKIP_RATE}",
        f"gac.random_skip_streak={GAC_UPDATE_STREAK}",
    ),  # fmt: skip
    "random_skip_matched": (
        f"gac.random_skip_rate={V5_GAC_UPDATE_SKIP_RATE}",
        f"gac.random_skip_streak={V5_GAC_UPDATE_STREAK}",
    ),  # fmt: skip
}
# The harsher cell, where PPO itself degrades: chosen by `v5pilot` (PPO at k=64, and at
# lr 1e-3 with k=16, beside sync at lr 1e-3), seed 0; V5_HARSH names the one taken. The
# pilot (2026-11-29, commit 852437f, held-out pass@1 after 0/25/.../150 updates): PPO k=64
# 0.062, 0.082, 0.088, 0.091, 0.100, 0.118, 0.101 (score 0.106; v4's PPO k=16 scored about
# 0.115, sync about 0.18); at lr 1e-3 sync itself swings (0.106, 0.120, 0.081, 0.126,
# 0.077, 0.137: score 0.113) and PPO read 0.079, 0.091, 0.092 by 75 updates (stopped
# there). At lr 1e-3 the bar (sync) degrades too; at k=64 it does not, so k=64 it is.
V5_HARSH_CELLS = {"k64": ("rollout.lag=64",), "lr0.001": ("optimizer.learning_rate=0.001",)}
V5_HARSH = "k64"
# At k=64 PPO's applied updates are less aligned than at k=16 (5 seeds, 745 steps: median
# 0.896, 90th percentile 0.946), so the main cell's thresholds skipped 3% of its steps:
# `ppo_gac_update_own` takes this cell's own quantiles, as the main cell's arm took its own.
V5_HARSH_ONLY = {"ppo_gac_update_own": (PPO, *ON_UPDATES, "gac.tau_low=0.90", "gac.tau_high=0.95")}
V5_HARSH_ARMS = (
    "sync",
    "ppo",
    "ppo_gac_update",
    "ppo_gac_update_own",
    "vcpo",
    "vespo",
    "dppo_binary_tv",
)
# The rounding floor: `ppo` re-run with its step in two micro-batches, which changes only
# the order of the sums (the same gradient in exact arithmetic), seeds 0-2.
V5_FLOOR = ("learner.micro_batches=2",)
V5_FLOOR_SEEDS = 3


def v5_label(name: str, cell: str = "") -> str:
    """``v5/<name>/k16`` in the main cell, ``v5_<cell>/<name>`` in a harsher one."""
    return f"v5_{cell}/{name}" if cell else f"v5/{name}/k{0 if name == 'sync' else V4_LAG}"


def v5_specs(seeds, quick=False):
    """Laboratory v5's main cell, the seeds outermost and PPO's comparisons first."""
    names = ("ppo_gac_update", "random_skip_streaks") if quick else tuple(V5_CELL)
    size = () if quick else V5_SIZE
    lag = QUICK["cure_lag"] if quick else V4_LAG
    regime = V4_REGIME[:-1] if quick else V4_REGIME
    return [
        RunSpec(v5_label(n), (*regime, *size, f"rollout.lag={lag}", *V5_CELL[n]), s)
        for s in seeds
        for n in names
    ]


def v5harsh_specs(seeds, quick=False, cell: str | None = None):
    """The harsher cell's arms (sync at the cell's step size, no lag)."""
    if quick:  # The main cell's quick runs go the same way.
        return []
    cell = cell or V5_HARSH
    return [
        RunSpec(
            # Sync at the main cell's step size is the main cell's sync run.
            v5_label(n, "" if n == "sync" and "rollout.lag" in V5_HARSH_CELLS[cell][0] else cell),
            (
                *V4_REGIME,
                *V5_SIZE,
                f"rollout.lag={V4_LAG}",
                *V5_HARSH_CELLS[cell],
                *{**V5_CELL, **V5_HARSH_ONLY}[n],
            ),
            s,
        )
        for s in seeds
        for n in V5_HARSH_ARMS
    ]


def v5pilot_specs(seeds, quick=False):
    """PPO in each candidate harsher cell, and sync at the larger step (seed 0 only)."""
    if quick:
        return []
    runs = [spec for cell in V5_HARSH_CELLS for spec in v5harsh_specs([0], cell=cell)]
    return [r for r in runs if r.label.split("/")[-1] == "ppo" or r.label == "v5_lr0.001/sync"]


def v5floor_specs(seeds, quick=False):
    """`ppo` with a flag that changes only rounding, the first seeds."""
    if quick:
        return []
    return [
        RunSpec(
            "v5/ppo_floor/k16", (*V4_REGIME, *V5_SIZE, f"rollout.lag={V4_LAG}", PPO, *V5_FLOOR), s
        )
        for s in seeds[:V5_FLOOR_SEEDS]
    ]


# The map of alignment: naive asynchrony at several batch sizes and lags, with the gradient
# noise scale measured (mini-batch halves).
V4_MAP_GROUPS = (16, 32, 64, 128, 256)
V4_MAP_LAGS = (0, 16, 64)

SEEDS = {
    "sync": 5,
    "staleness": 1,
    "alignment": 1,
    "cures": 5,
    "async": 1,
    "cell": 5,
    "map": 3,
    "tools": 5,
    "v4": 5,
    "v4map": 3,
    "v5": 5,
    "v5harsh": 5,
    "v5pilot": 1,
    "v5floor": 5,
}

# --quick: the same sweeps, cut to a few short runs from the shipped warm start.
QUICK_SETTINGS = (
    "warm_start_steps=800",
    "steps=6",
    "eval_every=3",
    "checkpoint_every=3",
    "eval_size=8",
    "eval_samples=2",
    "rollout.groups_per_batch=4",
)
QUICK = {"lags": (0, 2), "groups": (2,), "methods": ("naive", "gac"), "cure_lag": 2}


def lr_label(lr: float) -> str:
    return f"naive_lr{lr:g}"


def staleness_label(lr: float, k: int) -> str:
    """The staleness sweep's own labels: its runs are longer than the cures' naive/k32."""
    return f"stale_lr{lr:g}/k{k}"


def length(steps: int, evals: int, quick: bool) -> tuple[str, ...]:
    """Settings for a run of `steps` steps evaluated every `evals` (none under --quick)."""
    if quick:
        return ()
    return (f"steps={steps}", f"eval_every={evals}", f"checkpoint_every={steps // 2}")


def sync_specs(seeds, quick=False):
    # Mini-batch halves give the gradient noise scale along the whole run (same update).
    settings = ("rollout.lag=0", *NOISE_SCALE, *length(SYNC_STEPS, 100, quick))
    return [RunSpec(SYNC_LABEL, settings, s) for s in seeds]


def staleness_specs(seeds, quick=False):
    lags = QUICK["lags"] if quick else LAGS
    steps = length(STALENESS_STEPS, 100, quick)
    runs = []
    for s in seeds:
        runs += [
            RunSpec(staleness_label(LAB_LEARNING_RATE, k), (f"rollout.lag={k}", *steps), s)
            for k in lags
        ]
        runs += [
            RunSpec(
                staleness_label(SMALL_LR, k),
                (f"rollout.lag={k}", f"optimizer.learning_rate={SMALL_LR}", *steps),
                s,
            )
            for k in (lags[-1:] if quick else lags)
        ]
    return runs


def alignment_specs(seeds, quick=False):
    groups = QUICK["groups"] if quick else ALIGN_GROUPS
    lags = QUICK["lags"][:1] if quick else ALIGN_LAGS
    noise = (*NOISE_SCALE, *length(ALIGN_STEPS, ALIGN_STEPS, quick))
    return [
        RunSpec(
            f"align_g{g}/k{k}", (f"rollout.lag={k}", f"rollout.groups_per_batch={g}", *noise), s
        )
        for s in seeds
        for g in groups
        for k in lags
    ]


def cures_specs(seeds, quick=False):
    methods = QUICK["methods"] if quick else tuple(METHODS)
    k = QUICK["cure_lag"] if quick else CURE_LAG
    steps = length(CURE_STEPS, 100, quick)
    runs = []
    for s in seeds:
        runs += [
            RunSpec(f"{m}/k{k}", (f"rollout.lag={k}", *METHODS[m], *steps), s) for m in methods
        ]
        control = (f"rollout.lag={k}", f"optimizer.learning_rate={CONTROL_LR}", *steps)
        runs += [] if quick else [RunSpec(f"{lr_label(CONTROL_LR)}/k{k}", control, s)]
    return runs


def async_specs(seeds, quick=False):
    methods = ("naive",) if quick else ("naive", "gac")
    steps = length(CURE_STEPS, 100, quick)  # Beside the cures' lagged k=32 runs.
    return [RunSpec(f"{m}/async", (*ASYNC, *METHODS[m], *steps), s) for s in seeds for m in methods]


def cell_label(name: str, lag: int = V3_LAG) -> str:
    return f"v3/{name}/k{0 if name == 'sync' else lag}"


def cell_specs(seeds, quick=False):
    """Laboratory v3's cell: sync, naive k=16, every cure and both step-size controls, the
    seeds outermost, so a partial sweep holds every method."""
    names = ("sync", "naive", "vcpo", "gac") if quick else tuple(CELL)
    size = () if quick else V3_SIZE
    lag = QUICK["cure_lag"] if quick else V3_LAG
    return [
        RunSpec(cell_label(n, lag), (*V3_REGIME, *size, f"rollout.lag={lag}", *CELL[n]), s)
        for s in seeds
        for n in names
    ]


def map_label(loss: str, lag: int) -> str:
    """The map's label; the cell's runs where the map's are the same (sequence IS at k=0 and
    k=16 is the cell's sync and naive, sequence TIS cap 8 at k=16 its naive_cap8)."""
    if loss == "seq_is" and lag in (0, V3_LAG):
        return cell_label("sync" if lag == 0 else "naive")
    if loss == "seq_tis8" and lag == V3_LAG:
        return cell_label("naive_cap8")
    return f"v3map/{loss}/k{lag}"


def map_specs(seeds, quick=False):
    """Each naive loss at each staleness level (the cell's runs where they are the same)."""
    losses = ("seq_is", "ppo") if quick else tuple(MAP_LOSSES)
    lags = QUICK["lags"] if quick else MAP_LAGS
    size = () if quick else V3_SIZE
    return [
        RunSpec(
            map_label(loss, k) if not quick else f"v3map/{loss}/k{k}",
            (*MAP_LOSSES[loss], *size, f"rollout.lag={k}"),
            s,
        )
        for s in seeds
        for loss in losses
        for k in lags
        if loss != "seq_is_dynamic" or k in (0, V3_LAG)  # Dynamic sampling: sync and k=16.
    ]


def tools_specs(seeds, quick=False):
    """The tool task's cell (sync, naive, VCPO, GAC at k=16 in the v3 regime) and the
    `calculator` preset's own synchronous runs, the seeds outermost."""
    names = ("sync", "naive") if quick else tuple(TOOL_CELL)
    # --quick: the plumbing, from random weights (the calculator's warm start would train).
    size = ("init=random",) if quick else TOOL_SIZE
    lag = QUICK["cure_lag"] if quick else TOOL_LAG
    regime = ("rollout.mode=lagged", *V3_REGIME, *size, f"rollout.lag={lag}")
    runs = []
    for s in seeds:
        runs += [
            RunSpec(f"tools/{n}/k{0 if n == 'sync' else lag}", (*regime, *TOOL_CELL[n]), s)
            for n in names
        ]
        runs.append(RunSpec("tools/preset/sync", size, s))
    return runs


def v4_label(name: str) -> str:
    return f"v4/{name}/k{0 if name == 'sync' else V4_LAG}"


def v4_specs(seeds, quick=False):
    """Laboratory v4's cell (issue #41), the seeds outermost and the core runs first."""
    names = ("sync", "naive", "gac_update") if quick else V4_ORDER
    size = () if quick else V4_SIZE
    lag = QUICK["cure_lag"] if quick else V4_LAG
    regime = V4_REGIME[:-1] if quick else V4_REGIME
    return [
        RunSpec(
            v4_label(n) if not quick else f"v4/{n}/k{0 if n == 'sync' else lag}",
            (*regime, *size, f"rollout.lag={lag}", *V4_CELL[n]),
            s,
        )
        for s in seeds
        for n in names
    ]


def v4map_label(groups: int, lag: int) -> str:
    return f"v4map/g{groups}/k{lag}"


def v4map_specs(seeds, quick=False):
    """Naive asynchrony (`naive_pg`) at each batch size and lag, with the noise scale; the
    cell's own runs are not repeated (128 prompts at k=0 and k=16 add the noise scale)."""
    groups = QUICK["groups"] if quick else V4_MAP_GROUPS
    lags = QUICK["lags"] if quick else V4_MAP_LAGS
    size = () if quick else V4_SIZE
    return [
        RunSpec(
            v4map_label(g, k),
            (
                *V4_REGIME[:-1],
                *size,
                *NOISE_SCALE,
                f"rollout.groups_per_batch={g}",
                f"rollout.lag={k}",
            ),
            s,
        )
        for s in seeds
        for g in groups
        for k in lags
    ]


SWEEPS = {
    "sync": sync_specs,
    "staleness": staleness_specs,
    "alignment": alignment_specs,
    "cures": cures_specs,
    "async": async_specs,
    "cell": cell_specs,
    "map": map_specs,
    "tools": tools_specs,
    "v4": v4_specs,
    "v4map": v4map_specs,
    "v5": v5_specs,
    "v5harsh": v5harsh_specs,
    "v5pilot": v5pilot_specs,
    "v5floor": v5floor_specs,
}
# Sweeps whose base is another preset than `lab` (--config), and their folder under --root.
OWN_BASE = {"tools": "calculator"}


def specs_of(
    names: Sequence[str], seeds: Sequence[int] | None, quick: bool, arms: Sequence[str] = ()
) -> list[RunSpec]:
    """The runs of the sweeps `names` (each with its own seeds unless `seeds`), once each;
    with `arms`, only the runs whose arm (the label's second part) is one of them."""
    found: dict[tuple[str, int], RunSpec] = {}
    for name in names:
        chosen = seeds if seeds is not None else range(1 if quick else SEEDS[name])
        for spec in SWEEPS[name](list(chosen), quick):
            if not arms or spec.label.split("/")[1] in arms:
                found.setdefault((spec.label, spec.seed), spec)
    return list(found.values())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sweep_arguments(parser, default_root="experiments/runs/lab", default_seeds=())
    parser.set_defaults(seeds=None, config="lab")
    parser.add_argument("--only", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    parser.add_argument(
        "--quick", action="store_true", help="a few short runs of every sweep (the plumbing)"
    )
    parser.add_argument(
        "--arms", nargs="+", default=(), help="only these arms of the sweeps, e.g. ppo sync"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.set = [*QUICK_SETTINGS, *args.set]
    lagged = [n for n in args.only if n != "async" and n not in OWN_BASE]
    # Lagged runs side by side; the asynchronous ones alone (their worker needs a core).
    groups = [
        (lagged, "lagged", args.jobs, base_config(args)),
        (["async"] if "async" in args.only else [], "async", 1, base_config(args)),
    ]
    for name, preset in OWN_BASE.items():
        if name in args.only:
            own = argparse.Namespace(**{**vars(args), "config": preset})
            groups.append(([name], name, args.jobs, base_config(own)))
    try:
        for names, folder, jobs, base in groups:
            if not names:
                continue
            if args.shard is not None and set(names) != set(args.only):
                continue  # A child runs the group its parent started.
            run_sweep(
                specs_of(names, args.seeds, args.quick, args.arms),
                base,
                Path(args.root) / folder,
                # The last --only wins (argparse).
                processes=SweepProcesses(__file__, jobs, argv=[*argv, "--only", *names]),
                shard_arg=args.shard,
                stale=stale_setting(args),
            )
    except StaleRunError as e:
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
