"""Side-by-side speed of two versions of the planner in ONE process, calls interleaved
(before, after, before, after, ...), so both see the same machine load.

    OMP_NUM_THREADS=1 taskset -c 0 python speed_before_after.py BEFORE_ROOT AFTER_ROOT [--reads]

Each root holds an `eplb/` package; the shape is DeepSeek-V3 (58 x 256, 288 slots, 32
GPUs), hierarchical (4 nodes, 8 groups) and global, the load and drift of
benchmarks/planner.py section 4. `previous` uses each version's default move_tolerance.
With `--reads`: the shapes of benchmarks/reads_speed.py with decode-aware packing on
(`read_tokens` 100, `dispatch_tokens` 40, 16 and 128 tokens per GPU), 15 interleaved
calls each, and whether the two versions' plans are identical.
"""
import importlib
import sys
import time

import numpy as np
import torch

torch.set_num_threads(1)


def load_version(root):
    for k in [k for k in sys.modules if k == "eplb" or k.startswith("eplb.")]:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        try:  # the layout since 0.2, else the flat one of older trees
            planning = importlib.import_module("eplb.core.planning")
        except ImportError:
            planning = importlib.import_module("eplb.planning")
    finally:
        sys.path.remove(root)
    return planning.plan


def speed_loads(L, N, seed):  # = benchmarks/planner.py speed_loads
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((L, N)), 1) + 1.0
    return np.round(1e5 / ranks ** 0.9 * rng.uniform(0.5, 1.5, (L, N)))


def reads_main(versions):
    """The --reads comparison (see the module docstring)."""
    cases = [("DeepSeek-V3, 32 GPUs, 4 nodes", 58, 256, 288, 32, 4, 8),
             ("DeepSeek-V3, 32 GPUs, global", 58, 256, 288, 32, 1, 1),
             ("DeepSeek-V3, 8 GPUs, global", 58, 256, 264, 8, 1, 1),
             ("EP256: 512 slots, 256 GPUs", 58, 256, 512, 256, 1, 1)]
    print(f"load average at start: {open('/proc/loadavg').read().strip()}")
    print("| shape | tokens/GPU | call | before ms | after ms | after / before | identical plans |")
    print("|---|---|---|---|---|---|---|")
    for title, L, N, P, M, nodes, groups in cases:
        load = speed_loads(L, N, 1)
        drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
        for tok in (16, 128):
            kw = dict(read_tokens=100.0, step_choices=float(M * tok * 8), dispatch_tokens=40.0)
            fns = {}
            for name, plan in versions.items():
                prev = plan(load, M, P, nodes, groups)
                fns[name, "plan(previous)"] = (lambda plan=plan, prev=prev:
                                               plan(drift, M, P, nodes, groups, previous=prev, **kw))
                fns[name, "plan()"] = (lambda plan=plan: plan(drift, M, P, nodes, groups, **kw))
            out = {k: f().physical_to_logical for k, f in fns.items()}
            times = {k: [] for k in fns}
            for _ in range(15):
                for k, f in fns.items():
                    t = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
            for what in ("plan(previous)", "plan()"):
                b, a = (1e3 * np.median(times[v, what]) for v in versions)
                same = np.array_equal(out["before", what], out["after", what])
                print(f"| {title} | {tok} | {what} | {b:.2f} | {a:.2f} | {a / b:.2f} | {'yes' if same else 'NO'} |",
                      flush=True)
    print(f"load average at end: {open('/proc/loadavg').read().strip()}")


def main():
    versions = {"before": load_version(sys.argv[1]), "after": load_version(sys.argv[2])}
    if "--reads" in sys.argv[3:]:
        return reads_main(versions)
    L, N, P, M = 58, 256, 288, 32
    load = speed_loads(L, N, 1)
    drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
    print(f"load average at start: {open('/proc/loadavg').read().strip()}")
    for nodes, groups in ((4, 8), (1, 1)):
        fns = {}
        for name, plan in versions.items():
            prev = plan(load, M, P, nodes, groups)
            fns[name, "plan()"] = (lambda plan=plan: plan(drift, M, P, nodes, groups))
            fns[name, "plan(previous)"] = (lambda plan=plan, prev=prev: plan(drift, M, P, nodes, groups, previous=prev))
        times = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(61):
            for k, f in fns.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        print(f"V3 shape, {nodes} node(s), {groups} group(s): median (min) ms over 61 interleaved calls")
        for what in ("plan()", "plan(previous)"):
            cells = [f"{name} {1e3 * np.median(times[name, what]):.2f} ({1e3 * min(times[name, what]):.2f})"
                     for name in versions]
            print(f"  {what:15s} " + "   ".join(cells))
    print(f"load average at end: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
