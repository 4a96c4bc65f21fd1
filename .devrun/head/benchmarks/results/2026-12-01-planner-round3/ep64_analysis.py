"""Why `default` is below `deepseek` at EP 64 in the Large EP cost replay (DeepSeek-V3 shape,
8 nodes of 8 GPUs, 8 expert groups: one group per node). Balance only (max/mean GPU load
per step), no cost model. Run from the repository root with ../shared present:

    python benchmarks/results/2026-12-01-planner-round3/ep64_analysis.py > out.txt
"""
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
import scale as S  # noqa: E402  benchmarks/scale.py: the traces and the window of the replay

from eplb.core.placement import Placement  # noqa: E402
from eplb.core.planning import plan  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, LinkModel  # noqa: E402
from eplb.core.scale import stack_experts, topology  # noqa: E402

TR = S.traces(S.SHARED)
SHAPE = MODEL_PRESETS["deepseek-v3"]
W = S.WINDOW  # plan every W steps on the last W (window = interval = 4)


def setup(name, M):
    loads = stack_experts(TR[name], SHAPE.num_experts)  # [T, L, 256]
    nodes, groups = topology(SHAPE, M, LinkModel())
    return loads, 256 + M, nodes, groups


def per_step(p, loads, start):  # mean over the next W steps of the layer-mean max/mean
    return [float((1 / p.balancedness(loads[t])).mean()) for t in range(start, min(start + W, loads.shape[0]))]


print("## 1. tolerance: default with previous (tolerance 0, 0.01, 0.03), default and deepseek from scratch")
for name in ("esft", "olmoe"):
    for M in (32, 64):
        loads, P, nodes, groups = setup(name, M)
        T, L, N = loads.shape
        res = {}
        for tol in (0.0, 0.01, 0.03):
            prev, oos = Placement.initial(L, N, P, M, nodes), []
            for start in range(W, T, W):
                p = plan(loads[start - W:start].sum(0), M, P, nodes, groups, previous=prev, move_tolerance=tol)
                oos += per_step(p, loads, start)
                prev = p
            res[f"default tol {tol}"] = np.mean(oos)
        for pol in ("default", "deepseek"):
            oos = []
            for start in range(W, T, W):
                oos += per_step(plan(loads[start - W:start].sum(0), M, P, nodes, groups, policy=pol), loads, start)
            res[f"{pol} from scratch"] = np.mean(oos)
        print(f"{name} EP {M} ({nodes} nodes): " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()))

print("\n## 2. olmoe EP 64, window by window: in sample (the planning window) and the next 4 steps")
loads, P, nodes, groups = setup("olmoe", 64)
T, L, N = loads.shape
prev = Placement.initial(L, N, P, 64, nodes)
for start in range(W, T, W):
    win = loads[start - W:start].sum(0)
    p = plan(win, 64, P, nodes, groups, previous=prev)
    d = plan(win, 64, P, nodes, groups, policy="deepseek")
    kind = "next domain" if start % 8 == 0 else "same domain"
    print(f"step {start:2d} ({kind}): default in {(1 / p.balancedness(win)).mean():.3f} next {np.mean(per_step(p, loads, start)):.3f}"
          f" | deepseek in {(1 / d.balancedness(win)).mean():.3f} next {np.mean(per_step(d, loads, start)):.3f}")
    prev = p

print("\n## 3. inside the nodes (esft EP 64, from scratch): max/mean GPU load of every node over its own mean")
loads, P, nodes, groups = setup("esft", 64)
T, L, N = loads.shape
s = P // 64
for pol in ("deepseek", "default"):
    ins, oos = [], []
    for start in range(W, T, W):
        win = loads[start - W:start].sum(0)
        p2l = plan(win, 64, P, nodes, groups, policy=pol).physical_to_logical  # [L, P]
        c = np.stack([np.bincount(r, minlength=N) for r in p2l])  # [L, N]

        def within(x):  # [L, nodes] max GPU / mean GPU inside every node
            g = np.take_along_axis(x / np.maximum(c, 1), p2l, 1).reshape(L, nodes, 64 // nodes, s).sum(-1)
            return g.max(-1) / g.mean(-1)
        ins.append(within(win).mean())
        oos += [within(loads[t]).mean() for t in range(start, min(start + W, T))]
    print(f"{pol}: in sample {np.mean(ins):.4f}, next steps {np.mean(oos):.4f}")

print("\n## 4. shrinking the window's load toward the layer mean before planning (from scratch)")
for name in ("esft", "olmoe"):
    loads, P, nodes, groups = setup(name, 64)
    T = loads.shape[0]
    res = {}
    for pol, beta in (("deepseek", 0.0), ("default", 0.0), ("default", 0.25), ("default", 0.5)):
        oos = []
        for start in range(W, T, W):
            win = loads[start - W:start].sum(0)
            x = (1 - beta) * win + beta * win.mean(1, keepdims=True)
            oos += per_step(plan(x, 64, P, nodes, groups, policy=pol), loads, start)
        res[f"{pol} shrink {beta}"] = np.mean(oos)
    print(f"{name} EP 64: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()))
