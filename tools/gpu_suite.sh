#!/usr/bin/env bash
# Everything GPU-side in one device call (the device machine has no registry access):
#   - installs llm_act (and any cp312 wheels carried in .wheels/) without touching its torch,
#   - runs the gpu-marked tests and the kernel benchmark, keeping logs and tables under $OUT.
# Run through the device tool:  bash tools/gpu_suite.sh   (carry: .wheels if you need extra packages)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .wheels ]; then python3 -m pip install --no-index --no-deps .wheels/*.whl >"$OUT/pip.log" 2>&1; fi
python3 -m pip install --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/kernels 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
python3 -m llm_act.cli bench kernels --size-mib 256 --output "$OUT/kernels.md" 2>&1 | tee "$OUT/bench.log" | tail -20
