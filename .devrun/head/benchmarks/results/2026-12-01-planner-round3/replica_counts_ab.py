"""replica_counts before (bisection, 7880c3d) and after (candidate partition): median ms of
200 calls at the speed shapes, and the same counts. Run from the repository root:
git show 7880c3d:eplb/core/policy/balanced/replicas.py > /tmp/replicas_old.py
OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/results/2026-12-01-planner-round3/replica_counts_ab.py /tmp/replicas_old.py"""
import importlib.util
import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
from planner import speed_loads  # noqa: E402

from eplb.core.policy.balanced.replicas import replica_counts  # noqa: E402

spec = importlib.util.spec_from_file_location("replicas_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
w = speed_loads(58, 256, 1)
for name, ww, p, cap in [("V3 global", w, 288, 32), ("V3 hierarchical rows", w.reshape(232, 64), 72, 8),
                         ("EP256", w, 512, 256)]:
    for f, label in [(old.replica_counts, "before"), (replica_counts, "after")]:
        f(ww, p, cap)
        ts = []
        for _ in range(200):
            t = time.perf_counter()
            f(ww, p, cap)
            ts.append(time.perf_counter() - t)
        print(f"{name} {label} {1e3 * np.median(ts):.3f} ms")
    assert (old.replica_counts(ww, p, cap) == replica_counts(ww, p, cap)).all()
print("same counts at every shape")
