#!/usr/bin/env bash
# Everything GPU-side in one run, on a GPU host that reaches no package registry:
#   on a machine with the registry: bash tools/fetch_gpu_wheels.sh   (cp312 wheels into .whl/)
#   then copy the tree and .whl/ to a GPU host with Python 3.12, and there: bash tools/gpu_suite.sh
# One run writes under $OUT everything docs/benchmarks.md's GPU section needs; SUMMARY.md
# gathers it (device, versions, the commands, the tables, the targets, the training logs):
#   gpu.txt            device (nvidia-smi), torch/triton/megatron-core versions
#   pytest_gpu.log     the gpu-marked tests
#   kernels.md         `llm-act bench kernels --size-mib 256`: codec bandwidth vs copy
#   gpu.md gpu.json gpu_throughput.png   `llm-act bench gpu`: GPT ~1.3B, stock / Megatron
#                      selective / full recompute / ours keep / compress / auto at full
#                      recompute's memory / ours at the card's memory: tokens/s, peak memory,
#                      largest micro-batch, the issue's targets as PASS/FAIL lines
#   train_*.log        our training loop (llm_act/train/gpu.py: megatron-core DDP + optimizer)
#                      for 10 iterations under torchrun, without and with --act-compress
# Every step has its own `timeout`, so one slow step leaves the others; worst case in all
# (the sum of the limits) is 545 s, under 10 minutes:
#   pip 40 + tests 100 + kernels 60 + bench gpu 240 + train 30 + 30 + 45 + summary ~0.
# Without a GPU it stops at once with a message and exit code 3.
set -uo pipefail
# A caller may read back only a few files from $OUT: every log is written under $LOGS and
# packed into $OUT/logs.tar.gz after each step (a cut-off run still returns what it did); the
# section's files (SUMMARY.md, gpu.md, gpu.json, gpu_throughput.png, kernels.md) go to $OUT.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/llm_act_gpu_logs.XXXXXX)
pack() { tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
START=$(date +%s)
# STEPS picks what runs (default all): a rerun after a fix can take only the parts that failed
STEPS=${STEPS:-"tests kernels bench train"}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS LOGFILE CMD...: run CMD under `timeout`, log, record rc and time
    local name=$1 limit=$2 log=$3; shift 3
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOGS/steps.txt"
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    local why=""; [ "$rc" = 124 ] || [ "$rc" = 137 ] && why=" (TIMED OUT)"
    echo "   $name: rc=$rc$why, $(( $(date +%s) - t0 )) s" | tee -a "$LOGS/steps.txt"
    tail -n "${TAIL:-15}" "$log"
    pack
    return 0
}

if ! command -v nvidia-smi >/dev/null 2>&1 \
   || ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    msg="gpu_suite.sh: no GPU here (nvidia-smi missing or torch.cuda.is_available() is False); nothing measured. Copy the tree and .whl/ (bash tools/fetch_gpu_wheels.sh) to a GPU host with Python 3.12 and run bash tools/gpu_suite.sh there."
    echo "$msg" | tee "$OUT/NO_GPU.txt" >&2
    exit 3
fi

if [ -d .whl ]; then
    timeout 40 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$LOGS/pip.log" 2>&1 || { tail "$LOGS/pip.log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    echo "gpu_suite.sh: no .whl/ carried; megatron-core, pulp and highspy must already be installed" | tee "$LOGS/pip.log"
fi
python3 -m pip install --no-deps --no-build-isolation -e . >>"$LOGS/pip.log" 2>&1 || { tail "$LOGS/pip.log"; exit 1; }

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 - <<'EOF'
import platform, torch
parts = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"cuda {torch.version.cuda}"]
for mod in ("triton", "megatron.core", "pulp", "highspy"):
    try:
        m = __import__(mod, fromlist=["__version__"])
        parts.append(f"{mod} {getattr(m, '__version__', '?')}")
    except Exception as err:
        parts.append(f"{mod}: absent ({err.__class__.__name__})")
print(", ".join(parts))
print("device:", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
EOF
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo '?') (working tree as carried; git status below)"
    git status --short 2>/dev/null | head -40
} 2>&1 | tee "$LOGS/gpu.txt"

want tests && step "gpu tests" 100 "$LOGS/pytest_gpu.log" \
    python3 -m pytest -q -rfE -m gpu -p no:cacheprovider ${PYTEST_ARGS:-tests}
want kernels && step "bench kernels" 60 "$LOGS/bench_kernels.log" \
    python3 -m llm_act.cli bench kernels --size-mib 256 --output "$OUT/kernels.md"
# the bench stops measuring after LLM_ACT_GPU_BENCH_SECONDS and then writes its tables
BENCH_SECONDS=${BENCH_SECONDS:-180}
want bench && TAIL=70 step "bench gpu" $(( BENCH_SECONDS + 60 )) "$LOGS/bench_gpu.log" \
    env LLM_ACT_GPU_BENCH_SECONDS=$BENCH_SECONDS python3 -m llm_act.cli bench gpu --output-dir "$OUT"

# our training loop on the GPU: megatron-core DDP + its optimizer (llm_act/train/gpu.py)
TRAIN=(--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
       --position-embedding-type rope --micro-batch-size 4 --train-iters 10 --lr 3e-4 --bf16
       --log-interval 1 --eval-interval 5 --eval-iters 1)
RUN=(python3 -m torch.distributed.run --standalone --nproc_per_node 1 launch/pretrain_gpt.py)
want train && step "train stock" 30 "$LOGS/train_stock.log" "${RUN[@]}" "${TRAIN[@]}" \
    --save /tmp/llm_act_ckpt_stock --save-interval 10
want train && step "train act-compress (auto)" 30 "$LOGS/train_act_compress.log" "${RUN[@]}" "${TRAIN[@]}" \
    --act-compress
want train && step "train act-compress (compress plan)" 45 "$LOGS/train_act_compress_plan.log" "${RUN[@]}" "${TRAIN[@]}" \
    --act-compress --act-compress-plan compress --save /tmp/llm_act_ckpt_compress --save-interval 10

{
    echo "# GPU suite summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - START )) s)"
    echo; echo '## Device and versions'; echo; echo '```'; cat "$LOGS/gpu.txt"; echo '```'
    echo; echo '## Steps (commands, exit codes, seconds)'; echo; echo '```'; cat "$LOGS/steps.txt"; echo '```'
    echo; echo '## gpu tests (tail)'; echo; echo '```'; tail -n 25 "$LOGS/pytest_gpu.log"; echo '```'
    echo; echo '## Kernels'; echo
    if [ -s "$OUT/kernels.md" ]; then cat "$OUT/kernels.md"; else echo '(none: see bench_kernels.log)'; fi
    echo; echo '## Throughput and memory (llm-act bench gpu)'; echo
    if [ -s "$OUT/gpu.md" ]; then cat "$OUT/gpu.md"; else echo '(none: see bench_gpu.log)'; tail -n 40 "$LOGS/bench_gpu.log"; fi
    for f in train_stock train_act_compress train_act_compress_plan; do
        echo; echo "## $f (tail)"; echo; echo '```'; tail -n 20 "$LOGS/$f.log"; echo '```'
    done
} >"$OUT/SUMMARY.md" 2>&1
cp "$OUT/SUMMARY.md" "$LOGS/"; pack
echo "gpu_suite.sh: done in $(( $(date +%s) - START )) s; see $OUT/SUMMARY.md"
