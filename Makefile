# The two commands of the README: `make demo` and `make test`. Each sets up the virtual
# environment from nothing on a fresh machine (and reuses it when pyproject.toml is unchanged).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The test extra (torch, transformers, datasets, wandb, pytest: about 2.5 GB) on top, for
# `make test` and the benchmarks; `make demo` needs none of it.
TEST_STAMP := $(VENV)/.test-stamp
# Two workers (xdist), each running whole files: the loop tests share runs within a file;
# the slowest files first (tests/conftest.py, SLOWEST_FILES_FIRST).
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=20

.PHONY: install demo test lint bench bench-sampler bench-async bench-tools bench-accelerator bench-gpu bench-tunix clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

# Stale rollouts break training and a cure holds: two runs side by side, about three
# minutes (gac_jax/lab/demo.py). Afresh each time (the command keeps finished runs).
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/gac-jax demo --out runs/demo

lint: $(TEST_STAMP)
	$(BIN)/ruff check gac_jax tests benchmarks experiments

test: $(TEST_STAMP) lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/canary.py
	$(BIN)/python benchmarks/transforms.py
	$(BIN)/python benchmarks/optimizer_compile.py
	$(BIN)/python benchmarks/learner.py --quick
	$(BIN)/python benchmarks/pipeline.py --quick

# The sampler's throughput with and without slot refill, heavy-tailed and equal lengths.
bench-sampler: $(TEST_STAMP)
	$(BIN)/python benchmarks/sampler.py

# Sync vs async rollouts through the training loop, and the split layout simulated (about 3 minutes).
bench-async: $(TEST_STAMP)
	$(BIN)/python benchmarks/async_throughput.py

# Multi-turn episodes with a slow tool (median 50 ms): sync vs async, measured and simulated.
bench-tools: $(TEST_STAMP)
	$(BIN)/python benchmarks/tool_episodes.py

# The one-GPU 0.6B preset's steps at its real shapes against `plan`, then the learner's MFU,
# the sampler against its bandwidth roofline and GAC + ESS against AdamW on whatever backend
# JAX finds (a GPU or TPU: full shapes). Writes benchmarks/results/{accelerator,
# real_shapes}.{json,md}. On the offline accelerator machine, with the wheels of
# benchmarks/accelerator_wheels.sh installed: `make bench-accelerator ACCEL_PYTHON=python3`
# (that interpreter, this tree on its path, nothing installed).
ACCEL_PYTHON ?=
bench-accelerator: $(if $(ACCEL_PYTHON),,$(STAMP))
	PYTHONPATH=. $(or $(ACCEL_PYTHON),$(BIN)/python) benchmarks/real_shapes.py
	PYTHONPATH=. $(or $(ACCEL_PYTHON),$(BIN)/python) benchmarks/accelerator.py

# Issue 61's figures in one call within a time budget (benchmarks/gpu_check.py): the one-GPU
# preset's profile, learner MFU, sampler against its roofline, step and compiles, each
# against the issue's target. Writes $OUT/gpu_check.{json,md} where OUT is set, else
# benchmarks/results/. The lent GPU's command: benchmarks/ACCELERATOR.md, issue 61's section.
GPU_CHECK_ARGS ?=
bench-gpu: $(if $(ACCEL_PYTHON),,$(STAMP))
	PYTHONPATH=. $(or $(ACCEL_PYTHON),$(BIN)/python) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Tunix goes into its own environment (.venv-bench), created by the script itself.
bench-tunix:
	$(PYTHON) benchmarks/vs_tunix.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
