#!/bin/bash
# Issue 17 Target 4 side by side on one pinned core: plan() of four checkouts alternated per
# case (ab_plan_speed.py, ALT alternations, default 4): 7ec5cb0 (.snap_r2, the end of planner
# round 2, whose "4.2-4.8 ms" the issue quotes), 56f1458 (.snap_file, the code when the issue
# was filed), a592d56 (.snap_old, before the speed work of 2026-12-01) and this checkout.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
ROOT=$PWD; R=$ROOT/benchmarks/results/2026-12-01-planner-round3
lscpu | grep -E "Model name" | head -1; python3 -c "import torch, numpy; print(torch.__version__, numpy.__version__)"; uptime
CORE=${CORE:-3} python3 $R/ab_plan_speed.py $ROOT/.snap_r2 $ROOT/.snap_file $ROOT/.snap_old $ROOT ${ALT:-4} ${CASES:-v3h_prev,v3g_prev,ep256_prev,ep256_plan}
uptime
