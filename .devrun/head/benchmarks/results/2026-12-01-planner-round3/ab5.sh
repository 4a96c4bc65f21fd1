#!/bin/bash
# planner speed after the speed work of 2026-12-01 (late): a592d56 (.snap_old) against the new
# checkout (.snap), interleaved per case (ab_plan_speed.py, ALT alternations, default 6), then both
# checkouts' plans compared bit for bit (dump_many_plans.py: 156 plans), the golden digests
# checked on this machine, and one `planner.py --only speed` table of the new code.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
ROOT=$PWD; R=$ROOT/.snap/benchmarks/results/2026-12-01-planner-round3
lscpu | grep -E "Model name" | head -1; python3 -c "import torch, numpy; print(torch.__version__, numpy.__version__)"; uptime
CORE=${CORE:-3} python3 $R/ab_plan_speed.py $ROOT/.snap_old $ROOT/.snap ${ALT:-6}
for v in old new; do
  d=$ROOT/.snap; [ $v = old ] && d=$ROOT/.snap_old
  (cd $d && PYTHONPATH=$d python3 $R/dump_many_plans.py /tmp/plans_$v.npz)
done
python3 $R/compare_plans.py /tmp/plans_old.npz /tmp/plans_new.npz
(cd $ROOT/.snap && PYTHONPATH=$ROOT/.snap python3 -c "
import sys; sys.path.insert(0, 'tests'); import test_planner_golden as g
got = g.plans(); bad = [k for k in g.EXPECTED if got[k] != g.EXPECTED[k]]
print('golden digests on this machine:', 'all', len(got), 'equal' if not bad else 'DIFFERENT: ' + ', '.join(bad))")
(cd $ROOT/.snap && PYTHONPATH=$ROOT/.snap taskset -c ${CORE:-3} python3 benchmarks/planner.py --only speed)
uptime
