#!/usr/bin/env bash
# Everything GPU-side in one device call (the device machine reaches no registry):
#   here, once:   bash tools/fetch_gpu_wheels.sh        (cp312 wheels into .whl/)
#   device tool:  run(command="bash tools/gpu_suite.sh", carry=[".whl"])
# Installs the carried wheels beside the machine's own torch, llm_act without its deps, then
# runs the gpu-marked tests, the kernel bandwidth benchmark and `llm-act bench gpu` (throughput
# against micro-batch size for stock / selective / full recompute / ours), keeping every log
# and table under $OUT. Each step has its own time limit so one slow step leaves the others.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
timeout 120 python3 -m llm_act.cli bench kernels --size-mib 256 --output "$OUT/kernels.md" 2>&1 \
    | tee "$OUT/bench_kernels.log" | tail -25
timeout 420 python3 -m llm_act.cli bench gpu --output-dir "$OUT" 2>&1 | tee "$OUT/bench_gpu.log" | tail -40
