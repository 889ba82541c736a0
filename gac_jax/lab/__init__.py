"""The laboratory: seeded sweeps of training runs and the numbers reported from them.

For ``experiments/``: `sweeps` trains lists of seeded runs resumably and in parallel
processes, `summary` turns a run's metric records into its reported numbers, `provenance`
records the code version that made each run; `demo` is `gac-jax demo`. It builds on
`gac_jax.train`, which imports it only for the CLI's ``demo`` command.
"""
