"""Plan time with decode-aware packing (issue 29, target 5: DeepSeek-V3 shape <= 5 ms).

    python benchmarks/reads_speed.py

`plan(load, previous=...)` (a plan in force, move tolerance 0.03: the steady case) and
`plan(load)` (no plan in force; a plan after a shift, at tolerance 0, does the same work)
at the shapes of `benchmarks/planner.py --only speed`, without and with the pass
(`read_tokens` 100, `dispatch_tokens` 40, `step_choices` = GPUs x tokens per GPU x top-8
at 16 and 128 tokens per GPU: decode), the calls interleaved in one process; median (min)
ms. Also how many layers the pass changed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eplb.core.planning import plan  # noqa: E402
from planner import speed_loads  # noqa: E402

CASES = [("DeepSeek-V3 (L=58, N=256, 8 groups), 32 GPUs, 4 nodes", 58, 256, 288, 32, 4, 8),
         ("DeepSeek-V3, 32 GPUs, global (1 node)", 58, 256, 288, 32, 1, 1),
         ("DeepSeek-V3, 8 GPUs, 1 node", 58, 256, 264, 8, 1, 1),
         ("EP256: L=58, N=256, 512 slots, 256 GPUs", 58, 256, 512, 256, 1, 1)]


def main() -> None:
    print("| shape | tokens/GPU | plan(previous) ms | with reads ms | layers changed | plan() ms | "
          "with reads ms | layers changed |")
    print("|---|---|---|---|---|---|---|---|")
    for title, L, N, P, M, nodes, groups in CASES:
        load = speed_loads(L, N, seed=1)
        drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
        prev = plan(load, M, P, nodes, groups)
        reps = 31 if P < 400 else 7
        for tok in (16, 128):
            kw = dict(read_tokens=100.0, step_choices=float(M * tok * 8), dispatch_tokens=40.0)
            calls = [lambda: plan(drift, M, P, nodes, groups, previous=prev),
                     lambda: plan(drift, M, P, nodes, groups, previous=prev, **kw),
                     lambda: plan(drift, M, P, nodes, groups),
                     lambda: plan(drift, M, P, nodes, groups, **kw)]
            times = [[], [], [], []]
            for _ in range(reps):
                for i, fn in enumerate(calls):
                    t0 = time.perf_counter()
                    fn()
                    times[i].append(1e3 * (time.perf_counter() - t0))
            changed = []
            for extra in (dict(previous=prev), {}):
                a = plan(drift, M, P, nodes, groups, **extra).physical_to_logical
                b = plan(drift, M, P, nodes, groups, **extra, **kw).physical_to_logical
                changed.append(f"{int((a != b).any(1).sum())} of {L}")
            c = [f"{np.median(t):.2f} ({min(t):.2f})" for t in times]
            print(f"| {title} | {tok} | {c[0]} | {c[1]} | {changed[0]} | {c[2]} | {c[3]} | {changed[1]} |",
                  flush=True)


if __name__ == "__main__":
    main()
