"""Train the warm-started tiny policy and print its pass@1, pass@8 and run time.

With no arguments this writes the checkpoint shipped in
gac_jax/assets/warm_start/countdown_n3_max20_tiny (so it fails if that exists: pass
--overwrite to reproduce it in place, or --out to write elsewhere). Any
`WarmStartConfig` field is overridden by name:

    python experiments/warm_start.py --out /tmp/ws --steps 500 --eval_problems 100
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from gac_jax.train.checkpoint import read_metadata  # noqa: E402
from gac_jax.train.warm_start import (  # noqa: E402
    SHIPPED_WARM_START_DIR,
    WarmStartConfig,
    config_hash,
    warm_start,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default=str(SHIPPED_WARM_START_DIR), help="checkpoint directory to write"
    )
    parser.add_argument("--data_dir", default=None, help="tfds data directory")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--json", action="store_true", help="also print the metrics as JSON")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the warm start already in --out"
    )
    defaults = WarmStartConfig()
    for field in dataclasses.fields(WarmStartConfig):
        default = getattr(defaults, field.name)
        parser.add_argument(
            f"--{field.name}", type=type(default), default=default, help=f"(default {default})"
        )
    return parser


def main() -> None:
    args = _parser().parse_args()
    config = WarmStartConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(WarmStartConfig)}
    )
    out = Path(args.out)
    if args.overwrite and out.exists():
        if read_metadata(out).get("kind") != "gac_jax.warm_start":
            raise SystemExit(f"--overwrite: {out} holds no warm start; not deleting it.")
        shutil.rmtree(out)
    print(f"warm start {config_hash(config)}: {config}", flush=True)
    metrics = warm_start(config, out, data_dir=args.data_dir, progress=not args.quiet)
    wall = time.perf_counter() - _STARTED
    n = config.eval_samples
    print()
    print(f"task / model         {config.task} / {config.model} ({metrics['num_params']:,} params)")
    print(
        f"evaluated on         {metrics['eval_problems']} test problems x {n} samples "
        "(temperature 1) + 1 greedy"
    )
    print(f"pass@1               {metrics['pass@1']:.3f}")
    print(f"pass@{n:<16d}{metrics[f'pass@{n}']:.3f}")
    print(f"greedy accuracy      {metrics['greedy_accuracy']:.3f}")
    print(
        f"train loss           {metrics['first_train_loss']:.3f} -> "
        f"{metrics['final_train_loss']:.3f} ({config.steps} steps, "
        f"{metrics['epochs']:.1f} epochs)"
    )
    print(
        f"run time             {wall:.0f} s total: train {metrics['train_seconds']:.0f} s "
        f"({metrics['train_tokens_per_second']:,.0f} tokens/s), "
        f"eval {metrics['eval_seconds']:.0f} s"
    )
    print(f"checkpoint size      {metrics['checkpoint_bytes'] / 1e6:.2f} MB")
    print(f"written to           {metrics['checkpoint_dir']}")
    if args.json:
        print(json.dumps({**metrics, "wall_seconds": wall}, indent=2))


if __name__ == "__main__":
    main()
