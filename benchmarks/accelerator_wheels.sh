#!/usr/bin/env bash
# The wheels the accelerator machine lacks (it is offline; its image holds JAX with CUDA,
# flax, optax, orbax, chex, tokenizers, safetensors, jinja2, matplotlib: KINDS.md of the
# device tool), for its Python 3.12, into .accelerator-wheels/ (ignored by git). Ray is left
# out: only the Ray rollout actors import it, and the benchmarks use none.
#
#   benchmarks/accelerator_wheels.sh             # here, with network to PyPI
#   # there, with .accelerator-wheels carried:
#   python3 -m pip install --no-index --find-links .accelerator-wheels --no-deps \
#       .accelerator-wheels/*.whl && make bench-accelerator ACCEL_PYTHON=python3
set -euo pipefail
out=${1:-.accelerator-wheels}
rm -rf "$out" && mkdir -p "$out"
# Binary wheels for CPython 3.12 on x86-64 Linux.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$out" array-record==0.8.6 dm-tree==0.1.10
# Pure-Python packages (any interpreter): built here when PyPI has only a source archive.
python3 -m pip wheel --quiet --no-deps -w "$out" \
    draccus==0.11.6 docstring-parser==0.18.0 mergedeep==1.3.4 toml==0.10.2 \
    tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0 googleapis-common-protos==1.76.0 \
    immutabledict==4.3.1 importlib-resources==7.1.0 promise==2.3 simple-parsing==0.1.9 \
    termcolor==3.3.0 tensorboardX==2.6.5
du -sh "$out"
