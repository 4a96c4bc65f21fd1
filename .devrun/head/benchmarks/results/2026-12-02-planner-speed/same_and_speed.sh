#!/bin/bash
# The same plans as a592d56 (.snap_old) on this machine (156 plans, golden digests), then
# RUNS (default 2) `planner.py --only speed` tables of this checkout on one pinned core.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
ROOT=$PWD; R=$ROOT/benchmarks/results/2026-12-01-planner-round3
uptime
(cd $ROOT/.snap_old && PYTHONPATH=$ROOT/.snap_old python3 $R/dump_many_plans.py /tmp/plans_old.npz)
(cd $ROOT && PYTHONPATH=$ROOT python3 $R/dump_many_plans.py /tmp/plans_new.npz)
python3 $R/compare_plans.py /tmp/plans_old.npz /tmp/plans_new.npz
(cd $ROOT && PYTHONPATH=$ROOT python3 -c "
import sys; sys.path.insert(0, 'tests'); import test_planner_golden as g
got = g.plans(); bad = [k for k in g.EXPECTED if got[k] != g.EXPECTED[k]]
print('golden digests on this machine:', 'all', len(got), 'equal' if not bad else 'DIFFERENT: ' + ', '.join(bad))")
for i in $(seq ${RUNS:-2}); do
  (cd $ROOT && PYTHONPATH=$ROOT taskset -c ${CORE:-3} python3 benchmarks/planner.py --only speed)
  uptime
done
