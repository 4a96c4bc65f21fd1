"""How far can the global decode-aware plan of the DeepSeek-V3 shape (32 GPUs, 1 node) get
below 5 ms by speeding up `reads.swap_down` alone (issue 29, target 5)?

Times, round-robin, median ms over 61 calls each (one core): the plain plan(previous) and
the decode-aware one at 16 and 128 tokens per GPU, in this process and through the planner
process (the runtime's path); in this process also the part of the decode-aware call spent
in `swap_down` (a timing wrapper around it). The decode-aware call less its `swap_down`
time is what it would take if `swap_down` cost nothing.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/diag/issue29_global_bound.py
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for planner.speed_loads
from planner import speed_loads  # noqa: E402

import eplb.core.policy.balanced.reads as reads  # noqa: E402
from eplb.core.planning import plan  # noqa: E402
from eplb.core.policy.base import DEFAULT_READ_TOKENS  # noqa: E402
from eplb.runtime.planner_process import PlannerProcess  # noqa: E402

L, N, P, M, REPS = 58, 256, 288, 32, 61
load = speed_loads(L, N, seed=1)
drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
prev = plan(load, M, P)
spent = [0.0]  # seconds in swap_down since the last reset
inner = reads.swap_down


def timed_swap_down(*a, **k):
    t = time.perf_counter()
    try:
        return inner(*a, **k)
    finally:
        spent[0] += time.perf_counter() - t


reads.swap_down = timed_swap_down  # spread_reads looks it up in the module at each call
child = PlannerProcess()
kws = {"plain": dict(previous=prev)}
for tok in (16, 128):
    kws[f"decode-aware {tok}"] = dict(previous=prev, read_tokens=DEFAULT_READ_TOKENS, step_choices=float(M * tok * 8))
fns = {}
for name, kw in kws.items():
    fns[(name, "in process")] = lambda kw=kw: plan(drift, M, P, **kw)
    fns[(name, "planner process")] = lambda kw=kw: child.plan(drift, M, P, **kw)
try:
    for key, fn in fns.items():  # warm up; the child's plans are this process's
        want = plan(drift, M, P, **kws[key[0]]).physical_to_logical
        for _ in range(5):
            got = fn()
        assert np.array_equal(got.physical_to_logical, want), key
    times = {key: [] for key in fns}
    swap = {key: [] for key in fns if key[1] == "in process"}
    for _ in range(REPS):
        for key, fn in fns.items():
            spent[0] = 0.0
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
            if key in swap:
                swap[key].append(spent[0])
finally:
    child.close()
print(f"DeepSeek-V3 shape, {M} GPUs, global (1 node): median ms over {REPS} calls each, round-robin\n")
print("| plan | in process | of it in swap_down | in process less swap_down | planner process | "
      "planner process less swap_down |")
print("|---|---|---|---|---|---|")
for name in kws:
    t_in = 1e3 * np.median(times[(name, "in process")])
    t_pr = 1e3 * np.median(times[(name, "planner process")])
    sw = 1e3 * np.median(swap[(name, "in process")])
    less = 1e3 * np.median(np.subtract(times[(name, "in process")], swap[(name, "in process")]))
    print(f"| {name} | {t_in:.2f} | {sw:.2f} | {less:.2f} | {t_pr:.2f} | {t_pr - sw:.2f} |")
