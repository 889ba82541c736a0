"""The laboratory: seeded sweeps of training runs and the numbers reported from them.

This package serves ``experiments/`` (lab.py, report.py, keep_runs.py): `sweeps` trains
lists of seeded runs resumably and in parallel processes, `summary` turns a run's metric
records into its reported numbers, and `provenance` records the code version that made
each run, so results of older code are not mixed with today's; `demo` is `gac-jax demo`.
It builds on `gac_jax.train` (the loop and its metrics); nothing in `gac_jax.train` imports
it but the CLI's ``demo`` command.
"""
