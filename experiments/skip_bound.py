"""The evidence for GAC's default bound on consecutive skips (`max_consecutive_skips`).

The README's chain (clip, GAC around AdamW) on the noisy quadratic of
`gac_jax.toys.delayed_quadratic` (signal above noise, no staleness), GAC on raw gradients at
0.2 / 0.8 and on applied updates at 0.9 / 0.97, for bounds 1, 2, 4, 8, 16 and none:
the loss after 300 / 1000 / 3000 steps, the first step below 5% of the initial loss, and
the steps that left the loss unchanged (skipped) with their longest run.

    python experiments/skip_bound.py [--steps 3000]
"""

import argparse

import numpy as np
import optax

from gac_jax.toys import DelayedQuadratic, delayed_losses
from gac_jax.transforms import alignment_controlled, gradient_alignment_control

RATES = (1e-2, 1e-3)
BOUNDS = (1, 2, 4, 8, 16, None)
LEVELS = {
    "gradient 0.2/0.8": (dict(tau_low=0.2, tau_high=0.8), "gradient"),
    "update 0.9/0.97": (dict(tau_low=0.9, tau_high=0.97, reference="update"), "update"),
}


def chain(level=None, bound=None):
    def make(lr):
        inner = optax.adamw(lr)
        if level is not None:
            kwargs, acts_on = LEVELS[level]
            control = gradient_alignment_control(**kwargs, max_consecutive_skips=bound)
            inner = alignment_controlled(inner, control, acts_on=acts_on)
        return optax.chain(optax.clip_by_global_norm(1.0), inner)

    return make


def describe(losses, initial):
    marks = " / ".join(f"{losses[t - 1]:.4g}" for t in (300, 1000, 3000) if t <= len(losses))
    below = np.nonzero(losses < 0.05 * initial)[0]
    still = "".join("s" if same else "." for same in losses[1:] == losses[:-1])
    longest = max(len(run) for run in still.split("."))
    first = below[0] + 1 if below.size else None
    return f"{marks}; below 5% from step {first}; {still.count('s')} still, longest {longest}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    problem = DelayedQuadratic(steps=parser.parse_args().steps)
    adamw = delayed_losses(chain(), 0, RATES, problem)
    rows = {
        (level, bound): delayed_losses(chain(level, bound), 0, RATES, problem)
        for level in LEVELS
        for bound in BOUNDS
    }
    initial = problem.initial_loss()
    print(f"{problem.steps} steps, initial loss {initial:.4g}")
    for i, lr in enumerate(RATES):
        print(f"lr {lr:g}: AdamW {describe(adamw[i], initial)}")
        for (level, bound), losses in rows.items():
            print(f"  {level:17s} bound {bound!s:4s}: {describe(losses[i], initial)}")


if __name__ == "__main__":
    main()
