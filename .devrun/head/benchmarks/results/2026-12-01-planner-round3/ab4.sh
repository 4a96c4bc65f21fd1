#!/bin/bash
# planner speed: 7880c3d (before the replica-count change) and the checkout in .snap alternated,
# one pinned core (RUNS alternations, default 3); then both checkouts' plans of the speed shapes compared bit for bit.
# Needs .snap_old (git archive 7880c3d eplb benchmarks pyproject.toml) and .snap (the new one).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
ROOT=$PWD
lscpu | grep -E "Model name" | head -1; python3 -c "import torch, numpy; print(torch.__version__, numpy.__version__)"
for i in $(seq ${RUNS:-3}); do
  for v in old new; do
    d=$ROOT/.snap; [ $v = old ] && d=$ROOT/.snap_old
    echo "=== $v run $i"; (cd $d && PYTHONPATH=$d taskset -c 3 python3 benchmarks/planner.py --only speed 2>&1 | grep -E "^\| (Deep|EP)")
  done
done
for v in old new; do
  d=$ROOT/.snap; [ $v = old ] && d=$ROOT/.snap_old
  (cd $d && PYTHONPATH=$d python3 $ROOT/.snap/benchmarks/results/2026-12-01-planner-round3/dump_plans.py /tmp/plans_$v.npz)
done
python3 -c "
import numpy as np
a, b = np.load('/tmp/plans_old.npz'), np.load('/tmp/plans_new.npz')
for k in a.files: print(k, 'identical' if np.array_equal(a[k], b[k]) else 'DIFFERENT')"
