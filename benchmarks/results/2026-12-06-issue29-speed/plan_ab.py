"""Median ms of one decode-aware plan(previous) and of the plain plan(previous), 41 calls each
alternating, DeepSeek-V3 shape, 32 GPUs (benchmarks/planner.py's speed loads).

    cd <checkout> && PYTHONPATH=$PWD OMP_NUM_THREADS=1 taskset -c 1 python <this file> nodes|global TOKENS_PER_GPU
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for planner.speed_loads
from planner import speed_loads  # noqa: E402
from eplb.core.planning import plan  # noqa: E402  (from PYTHONPATH: the checkout timed)
from eplb.core.policy.base import DEFAULT_READ_TOKENS  # noqa: E402

case, tok = sys.argv[1], int(sys.argv[2])
L, N, P, M = 58, 256, 288, 32
nodes, groups = (4, 8) if case == "nodes" else (1, 1)
load = speed_loads(L, N, seed=1)
drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
prev = plan(load, M, P, nodes, groups)
kw = dict(previous=prev, read_tokens=DEFAULT_READ_TOKENS, step_choices=float(M * tok * 8))
reads = lambda: plan(drift, M, P, nodes, groups, **kw)  # noqa: E731
plain = lambda: plan(drift, M, P, nodes, groups, previous=prev)  # noqa: E731
for _ in range(5):
    reads(), plain()
ts, tp = [], []
for _ in range(41):
    t = time.perf_counter(); reads(); ts.append(time.perf_counter() - t)
    t = time.perf_counter(); plain(); tp.append(time.perf_counter() - t)
print(f"{case} {tok} tokens/GPU: decode-aware {1e3 * np.median(ts):.2f} ms, plain {1e3 * np.median(tp):.2f} ms, "
      f"difference {1e3 * (np.median(ts) - np.median(tp)):.2f} ms")
