"""Whether re-runs reproduce kept runs bit for bit: every non-timing value they share.

For each `metrics.jsonl` under NEW_ROOT, the run at the same relative path under
KEPT_ROOT is read, and every value of every step the two records share is compared
exactly (NaN equals NaN), timings aside (wall-clock seconds and throughputs differ from
run to run by nature). Metrics that only one side logs (a newer version logs more) are
counted, not compared. Exits 1 if any value differs or a re-run has no kept run.

    python experiments/rerun_check.py experiments/results/tools_runs/tools /tmp/check/tools/tools
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gac_jax.train.metrics import read_metrics

#: Metric names that hold a timing: never compared.
TIMING = re.compile(r"seconds|_per_s$|per_second|tok/s|wall|latency", re.I)


@dataclass
class Comparison:
    """How one re-run compares with its kept run."""

    steps: tuple[int, int]  # Records in the kept run and in the re-run.
    compared: int = 0  # Values both sides hold (timings aside).
    differing: list[tuple[int, str, object, object]] = field(default_factory=list)
    only_kept: set[str] = field(default_factory=set)  # Metrics only the kept run logs.
    only_new: set[str] = field(default_factory=set)


def _same(a, b) -> bool:
    nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return a == b or nan


def compare_runs(kept_dir: str | Path, new_dir: str | Path) -> Comparison:
    """The step-by-step comparison of two run directories (the re-run may be shorter)."""
    kept, new = read_metrics(kept_dir), read_metrics(new_dir)
    result = Comparison(steps=(len(kept), len(new)))
    for a, b in zip(kept, new, strict=False):
        result.only_kept |= a.keys() - b.keys()
        result.only_new |= b.keys() - a.keys()
        for key in sorted(a.keys() & b.keys()):
            if TIMING.search(key):
                continue
            result.compared += 1
            if not _same(a[key], b[key]):
                result.differing.append((a["step"], key, a[key], b[key]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kept_root", type=Path)
    parser.add_argument("new_root", type=Path)
    args = parser.parse_args(argv)
    runs = sorted(p.parent for p in args.new_root.glob("**/metrics.jsonl"))
    if not runs:
        print(f"no metrics.jsonl under {args.new_root}", file=sys.stderr)
        return 1
    failed = False
    for run in runs:
        relative = run.relative_to(args.new_root)
        if not (args.kept_root / relative / "metrics.jsonl").is_file():
            print(f"{relative}: no kept run under {args.kept_root}")
            failed = True
            continue
        c = compare_runs(args.kept_root / relative, run)
        failed |= bool(c.differing)
        print(
            f"{relative}: {c.steps[1]} of {c.steps[0]} steps, {c.compared} values compared, "
            f"{len(c.differing)} differ; {len(c.only_new)} metrics only in the re-run, "
            f"{len(c.only_kept)} only in the kept run"
        )
        for step, key, a, b in c.differing[:3]:
            print(f"  first: step {step} {key}: kept {a!r}, re-run {b!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
