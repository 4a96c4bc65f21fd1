#!/bin/bash
# A/B of the planner speed section: old (56f1458) and new (HEAD) alternated, one pinned core each.
# Run from a directory holding two exports of the repository:
#   git archive HEAD eplb benchmarks pyproject.toml | tar -x -C .snap
#   git archive 56f1458 eplb benchmarks pyproject.toml | tar -x -C .snap_old
# (2026-12-01: on the host CPU of the nvidia-h200 machine, output in ab_h200_host.txt; HEAD was 627e9e4)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
nproc; lscpu | grep -E "Model name|MHz" | head -3; python3 -c "import torch, numpy; print(torch.__version__, numpy.__version__)"
for i in 1 2 3; do
  for v in old new; do
    d=.snap; [ $v = old ] && d=.snap_old
    echo "=== $v run $i"; (cd $d && PYTHONPATH=$PWD taskset -c 3 python3 benchmarks/planner.py --only speed 2>&1 | grep -E "^\| (Deep|EP)")
  done
done
