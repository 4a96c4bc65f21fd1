#!/usr/bin/env bash
# Issue 29 on one GPU (H200): the --cost gpu replays of the targets, in about 8 minutes.
#   OUT=/some/dir bash benchmarks/issue29_gpu.sh
# 1. plans every configuration on the CPU cores (the planning does not depend on the cost
#    model): deepseek-v3 on every trace and family at EP 8-256, qwen3-235b on the shared
#    traces at EP 8-256 (at most 4.5 minutes; what is planned by then is kept);
# 2. times the grouped GEMMs of every planned configuration on the GPU (at most 3 minutes;
#    issue29.json is rewritten after every row, so a cut run keeps what it scored);
# 3. one `eplb simulate --cost gpu` run to show the CLI's header, ratio columns and progress.
# Everything goes under $OUT: plans/, gpu/issue29.json and the logs.
set -u
OUT=${OUT:?set OUT to the output folder}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
mkdir -p "$OUT/plans" "$OUT/gpu"
JOBS=$(nproc)
# the shared traces (olmoe): ../shared/traces/npy beside the repository, or ./shared/traces/npy
SHARED=${SHARED:-$( [ -d ../shared/traces/npy ] && echo ../shared/traces/npy || echo shared/traces/npy )}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout 270 $PY benchmarks/issue29.py --plan-only --plans "$OUT/plans" --jobs "$JOBS" --shared "$SHARED" \
    2>&1 | tee "$OUT/plan.log"
timeout 170 $PY benchmarks/issue29.py --cost gpu --plans "$OUT/plans" --out "$OUT/gpu" --shared "$SHARED" \
    2>&1 | tee "$OUT/gpu.log"
timeout 40 $PY -m eplb simulate esft --aggregate 8 --layers 8 --cost gpu --num-gpus 8,64 \
    --window-size 4 --rebalance-interval 4 --min-gain 0 --json "$OUT/cli.json" \
    > "$OUT/cli.log" 2> "$OUT/cli.err"
echo "exit codes: see the logs; results in $OUT/gpu/issue29.json" | tee -a "$OUT/gpu.log"
