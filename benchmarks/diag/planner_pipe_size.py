"""The planner process's call time against the size of its pipes, side by side.

Two `PlannerProcess` children plan the DeepSeek-V3 shape (58 layers, 256 experts, 32 GPUs,
4 nodes, `plan(previous)`, decode-aware at 16 tokens per GPU): one with the pipes as the
runtime makes them (`planner_process.PIPE_BYTES`), one shrunk back to Linux's default
64 KiB. Calls go round-robin with an in-process `plan()` as the third column, so that load
from other processes slows all three alike. Median ms over `--reps` calls.

    OMP_NUM_THREADS=1 python benchmarks/diag/planner_pipe_size.py            # any cores
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/diag/planner_pipe_size.py  # parent and child on one core
"""
from __future__ import annotations

import argparse
import fcntl
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

from eplb.core.planning import plan  # noqa: E402
from eplb.runtime import planner_process  # noqa: E402
from planner import speed_loads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=61)
    args = ap.parse_args()
    load = speed_loads(58, 256, seed=1)  # [L, N]
    drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)  # the next window
    kw = dict(num_gpus=32, num_slots=288, num_nodes=4, num_groups=8, previous=plan(load, 32, 288, 4, 8),
              read_tokens=100.0, step_choices=32 * 16 * 8.0)
    grown, small = planner_process.PlannerProcess(), planner_process.PlannerProcess()
    for pipe in (small._proc.stdin, small._proc.stdout):
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, 64 << 10)
    sizes = {name: [fcntl.fcntl(p.fileno(), fcntl.F_GETPIPE_SZ) >> 10 for p in (c._proc.stdin, c._proc.stdout)]
             for name, c in (("grown", grown), ("small", small))}
    calls = {"planner process, pipes grown": lambda: grown.plan(drift, **kw),
             "planner process, 64 KiB pipes": lambda: small.plan(drift, **kw),
             "in this process": lambda: plan(drift, **kw)}
    try:
        same = all(np.array_equal(f().physical_to_logical, plan(drift, **kw).physical_to_logical)
                   for f in calls.values())  # also the warm-up
        times = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, f in calls.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    finally:
        grown.close()
        small.close()
    print(f"pipe sizes KiB (to child, from child): {sizes}; same placement: {same}")
    for name, ts in times.items():
        print(f"{name:32s} {1e3 * np.median(ts):.2f} ms (min {1e3 * min(ts):.2f})")


if __name__ == "__main__":
    main()
