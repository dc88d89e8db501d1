#!/usr/bin/env bash
# The cp312 wheels the GPU machine lacks (megatron-core, pulp, highspy; it has torch, triton,
# einops, numpy, matplotlib and reaches no registry), into .whl/ (git-ignored) to carry.
# megatron-core 0.19.2 (Python 3.12): the newest inside our bounds, as `.ci/run`'s 3.12 venv tests.
# Run here, where pip reaches PyPI:  bash tools/fetch_gpu_wheels.sh   (about 24 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    megatron-core==0.19.2 pulp==3.3.2 highspy==1.15.1
ls -la .whl
