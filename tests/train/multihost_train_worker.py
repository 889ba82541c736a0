"""One process of a two-process `gac-jax train` run, launched by `test_multihost_loop.py`.

    python tests/train/multihost_train_worker.py RECORD.npz -- train --config C.yaml \
        --out RUN --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I

Runs the real CLI (which starts `jax.distributed`) and records, for the test: the
(group id, prompt id) pairs this process trained on, and the final params gathered in
full (`process_allgather`), so the test can compare the processes bit for bit.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np


def main() -> int:
    record, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    from gac_jax.train import build, cli, loop, run

    consumed, runs = [], []
    real_collate, real_build_run = run.collate, loop.build_run

    def recording_collate(rollouts, prompt_length, *overlong):
        consumed.extend((r.group_id, r.prompt_id, r.policy_version) for r in rollouts)
        return real_collate(rollouts, prompt_length, *overlong)

    def recording_build_run(config):
        runs.append(real_build_run(config))
        return runs[-1]

    # A reward a random model earns some of (the share of digits), so training moves the
    # params and the comparison between processes is not between initial values.
    task = build.get_task("arithmetic/add2")
    digits = dataclasses.replace(
        task, reward=lambda text, example: sum(c.isdigit() for c in text) / max(len(text), 1)
    )
    build.get_task = lambda name: digits
    run.collate, loop.build_run = recording_collate, recording_build_run
    status = cli.main(rest)
    if status == 0:
        import jax
        from jax.experimental import multihost_utils

        params = multihost_utils.process_allgather(runs[0].learner.params, tiled=True)
        leaves = {f"param_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
        np.savez(record, consumed=np.asarray(consumed, np.int64).reshape(-1, 3), **leaves)
    return status


if __name__ == "__main__":
    sys.exit(main())
