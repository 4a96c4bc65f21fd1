"""Issue 29: moves per rebalance on the steady family at EP 8-32 decode, 24 draws, split into the first plan (from the start-up placement) and the later ones. `before`: the catch-up never replaces a layer (the planner before b8c0c2b); `after`: the planner as it is. Run from the repository root: PYTHONPATH=.:benchmarks python benchmarks/results/2026-12-05-issue29-fresh-counts/steady_moves.py before|after"""
import sys, numpy as np
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/diag")
import eplb.core.policy.balanced as bal
mode = sys.argv[1]
if mode == "before":  # the catch-up never replaces a layer (the code before this change)
    orig = bal.spread_reads
    def sr(*a, **k):
        k["reference_p2l"] = None
        return orig(*a, **k)
    bal.spread_reads = sr
import issue29
from issue29_fitted_sweep import _draw
from eplb.core.cost_model import MODEL_PRESETS, LinkModel
from eplb.core.scale import plan_scale
class A: pass
for model in ("qwen3-235b", "deepseek-v3"):
    for M in (8, 16, 32):
        a = A(); a.model = model; a.trace = "steady-lognormal"
        shape = MODEL_PRESETS[model]; P = shape.num_experts + M
        first, rest = [], []
        for seed in range(29, 53):
            trace = _draw(a, seed)
            opts = issue29._opts(0.05, M, shape, "decode")
            _, planned = plan_scale(trace, shape, M, P, issue29.WINDOW, issue29.INTERVAL, LinkModel(), ("default",), opts=opts)
            mv = [b.record.experts_moved for b in planned["default"] if b.record]
            first.append(mv[0]); rest.extend(mv[1:])
        print(f"| {mode} | {model} | {M} | {np.mean(first):.1f} | {np.mean(rest):.1f} | {np.mean(first + rest):.1f} |", flush=True)
