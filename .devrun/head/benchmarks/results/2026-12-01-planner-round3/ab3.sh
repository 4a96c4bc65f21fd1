#!/bin/bash
# planner speed: 56f1458 (before round 3), d93b686 (round 3), HEAD (70acdd6, align change) alternated, one pinned core.
# Needs three exports: .snap_old (git archive 56f1458), .snap/prev (git archive d93b686), .snap (git archive HEAD).
# 2026-12-01, host CPU of the nvidia-h200 machine: output in ab3_h200_host.txt
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
lscpu | grep -E "Model name" | head -1; python3 -c "import torch, numpy; print(torch.__version__, numpy.__version__)"
for i in 1 2 3; do
  for v in old prev new; do
    d=$PWD/.snap; [ $v = old ] && d=$PWD/.snap_old; [ $v = prev ] && d=$PWD/.snap/prev
    echo "=== $v run $i"; (cd $d && PYTHONPATH=$d taskset -c 3 python3 benchmarks/planner.py --only speed 2>&1 | grep -E "^\| (Deep|EP)")
  done
done
