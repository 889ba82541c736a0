"""Keeps the laboratory's finished runs in git, so that a later checkout rebuilds the report.

The runs directory (experiments/runs: checkpoints, tensorboard files and every metric of
every step) is ignored by git and does not outlive a working copy. This copies, for each
finished run (one holding a summary), its summary and config, and its metrics records cut
to the keys experiments/report.py reads (`report.RECORD_KEYS`), into
experiments/results/lab_runs with the same layout:

    python experiments/lab.py && python experiments/keep_runs.py
    python experiments/report.py --root experiments/results/lab_runs   # any later checkout
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from gac_jax.lab.sweeps import SUMMARY_FILE
from gac_jax.train.cli import CONFIG_FILE
from gac_jax.train.metrics import METRICS_FILE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RECORD_KEYS  # noqa: E402  (experiments/report.py)


def kept(record: dict) -> dict:
    """The keys of `record` the report reads (values as written, nan included)."""
    return {k: v for k, v in record.items() if k in RECORD_KEYS}


def keep_run(run: Path, into: Path) -> None:
    """Copies the finished run directory `run` into `into` (summary, config, cut metrics)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in (SUMMARY_FILE, CONFIG_FILE):
        shutil.copyfile(run / name, into / name)
    lines = []
    for line in (run / METRICS_FILE).read_text().splitlines():
        if line.strip():
            record = kept(json.loads(line))
            if len(record) > 1:
                lines.append(json.dumps(record) + "\n")
    (into / METRICS_FILE).write_text("".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="experiments/runs/lab", help="the lab's runs")
    parser.add_argument("--out", default="experiments/results/lab_runs", help="the kept copy")
    args = parser.parse_args(argv)
    root, out = Path(args.root), Path(args.out)
    runs = sorted(p.parent for p in root.glob(f"**/{SUMMARY_FILE}"))
    if not runs:
        raise SystemExit(f"no finished runs (no {SUMMARY_FILE}) under {root}")
    shutil.rmtree(out, ignore_errors=True)  # Only the runs that are there now.
    for run in runs:
        keep_run(run, out / run.relative_to(root))
    print(f"kept {len(runs)} runs of {root} in {out}")


if __name__ == "__main__":
    main()
