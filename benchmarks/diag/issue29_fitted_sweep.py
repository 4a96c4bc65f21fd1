"""Issue 29: default/deepseek on a GPU's GEMM fit, over the synthetic families' draws.

Plans a synthetic family (benchmarks/issue29.py, 40 steps, 4 layers) afresh for each
`--family-seeds` draw (or a shared trace, `--trace esft|olmoe`, once), with the runtime's
settings (`issue29._opts`) or a variant of them, and replays it three ways: on the fit of
a `--cost gpu` run with expected counts (what a GPU row scores) and with Poisson counts
(mean over 4 seeds), and on the analytic cost. Variants are PlanOptions fields (`--set
read_tokens=300`), or `--first-from-scratch` (the first plan from the start-up placement at
tolerance 0, patched in by `issue29_fitted_gpu.first_from_scratch`; not in the planner).

    python benchmarks/diag/issue29_fitted_sweep.py --model qwen3-235b --ep 8 --trace steady-lognormal \\
        --family-seeds 29,30,31,32 [--preset prefill] [--fit RUN/issue29.json] [--set read_tokens=300]

The fits: `issue29_row_time.fit_for` (H200 runs: DeepSeek-V3 decode from the EP 16 run of
2026-12-03, prefill from the EP 128-256 run of 2026-12-04, Qwen3-235B decode from the EP 8
run of 2026-12-04 (c6); Qwen3-235B prefill has none of its own and takes DeepSeek-V3's
scaled by expert size), or `--fit`: the fit stored in another run's issue29.json.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import issue29  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, AnalyticCost, LinkModel  # noqa: E402
from eplb.core.policy.balanced.read_cost import expert_tokens, layer_cost  # noqa: E402
from eplb.core.policy.balanced.rows import counts_of  # noqa: E402
from eplb.core.scale import plan_scale, scale_replay, slot_counts  # noqa: E402
from eplb.ops.gpu_cost import FEATURES  # noqa: E402
from issue29_fitted_gpu import FittedCost, first_from_scratch  # noqa: E402
from issue29_row_time import fit_for  # noqa: E402

POISSON_SEEDS = 4


def ratio(rows) -> float:
    return rows["default"].tokens_per_s / rows["deepseek"].tokens_per_s


def _draw(a, seed: int) -> np.ndarray:  # [T, L, N]
    """`a.trace` drawn with family seed `seed` (a shared trace is the same whatever the seed)."""
    issue29.FAMILIES[0] = seed
    issue29._DRAWN.clear()
    issue29._LOADS.clear()
    return issue29._trace(a.model, a.trace)


def fresh_windows(a, shape, cost) -> None:
    """Fresh plans of every 4-step window, default (decode-aware, the runtime's settings)
    and deepseek, scored on the next 4 steps' expected counts with the fit."""
    from eplb.core.planning import plan
    M, P = a.ep, shape.num_experts + a.ep
    choices = M * issue29.TOKEN_PRESETS[a.preset] * shape.top_k
    opts = issue29._opts(0.05, M, shape, a.preset)
    busiest = {"deepseek": [], "default": []}
    for seed in (int(x) for x in a.family_seeds.split(",")):
        trace = _draw(a, seed)
        shares = trace / trace.sum(-1, keepdims=True)  # [T, L, N]
        for w0 in range(0, trace.shape[0] - 4, 4):
            window = trace[w0:w0 + 4].sum(0)  # [L, N]
            plans = {"deepseek": plan(window, M, P, policy="deepseek"),
                     "default": plan(window, M, P, read_tokens=opts.read_tokens, step_choices=choices,
                                     dispatch_tokens=opts.dispatch_tokens, tile_rows=opts.tile_rows)}
            for kind, pl in plans.items():
                for t in range(w0 + 4, w0 + 8):
                    busiest[kind].append(cost(shape, slot_counts(shares[t], pl, choices, None)).max(-1).mean())
    d, s = np.mean(busiest["default"]), np.mean(busiest["deepseek"])
    print(f"{a.model} EP {M} {a.preset} {a.trace}, fresh plans per window, draws {a.family_seeds}: "
          f"{len(busiest['default']) // 4} windows, busiest GPU fitted cost default {1e6 * d:.2f} us, "
          f"deepseek {1e6 * s:.2f} us, deepseek/default {s / d:.4f}")


def blocks(a, shape, cost, changes) -> None:
    """The replay of the first draw block by block, and one layer of its first block."""
    M, P = a.ep, shape.num_experts + a.ep
    N, choices = shape.num_experts, M * issue29.TOKEN_PRESETS[a.preset] * shape.top_k
    trace = _draw(a, int(a.family_seeds.split(",")[0]))
    opts = replace(issue29._opts(0.05, M, shape, a.preset), **changes)
    loads, planned = plan_scale(trace, shape, M, P, issue29.WINDOW, issue29.INTERVAL, LinkModel(),
                                ("deepseek", "default"), opts=opts)
    shares = loads / loads.sum(-1, keepdims=True)  # [T, L, N]
    print(f"{a.model} EP {M} {a.preset} {a.trace}: per block, per layer, deepseek's busiest GPU fitted cost over "
          "the default's (below 1: the default is slower)")
    for bd, bs in zip(planned["default"], planned["deepseek"]):
        f = [np.mean([cost(shape, slot_counts(shares[t], b.placement, choices, None)).max(-1)
                      for t in range(b.start, b.end)], axis=0) for b in (bd, bs)]  # [L] each
        moved = bd.record.experts_moved if bd.record else 0
        print(f"  steps {bd.start:2d}-{bd.end:2d}: {np.round(f[1] / f[0], 4)}, default moved {moved}")
    layer = a.blocks
    bd, bs = planned["default"][0], planned["deepseek"][0]
    window = loads[bd.start - issue29.WINDOW:bd.start].sum(0)  # [L, N] what the first plans saw
    lam_e = expert_tokens(window, choices)  # [L, N]
    for kind, b in (("default", bd), ("deepseek", bs)):
        p2l = b.placement.physical_to_logical  # [L, P]
        c = counts_of(p2l, N)  # [L, N]
        lam = lam_e[layer][p2l[layer]] / c[layer][p2l[layer]]  # [P] tokens per step of each slot
        cnt = slot_counts(shares[bd.start], b.placement, choices, None)[layer]  # [M, S]
        model = layer_cost(window, p2l, M, choices, opts.read_tokens, opts.tile_rows)[0][layer]
        print(f"  first block, layer {layer}, {kind}: planner's model {model:.1f}; tokens per GPU "
              f"{np.round(lam.reshape(M, -1).sum(1)).astype(int).tolist()}; tiles per GPU (expected counts of "
              f"step {bd.start}) {np.ceil(cnt / 128).sum(1).astype(int).tolist()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-235b", choices=("deepseek-v3", "qwen3-235b"))
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--trace", default="steady-lognormal", choices=issue29.SYNTHETIC + ("esft", "olmoe"),
                    help="a family (one row per draw) or a shared trace (one row)")
    ap.add_argument("--shared", type=Path, default=issue29.SHARED, help="the shared traces' npy folder")
    ap.add_argument("--family-seeds", default="29,30,31,32")
    ap.add_argument("--preset", default="decode", choices=tuple(issue29.TOKEN_PRESETS),
                    help="tokens per GPU per step (issue29.TOKEN_PRESETS) and the fit of that preset")
    ap.add_argument("--fit", type=Path, default=None,
                    help="an issue29.json of a `--cost gpu` run whose fit to use for --model and --preset "
                         "(default: issue29_row_time.DEFAULT_FITS; Qwen3-235B prefill: DeepSeek-V3's scaled)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a PlanOptions field of the default's plans (repeatable)")
    ap.add_argument("--first-from-scratch", action="store_true")
    ap.add_argument("--fresh-windows", action="store_true",
                    help="instead: fresh plans only (no previous placement), default and deepseek per window "
                         "of 4 steps, each scored on the next 4 steps (busiest GPU's fitted cost, mean)")
    ap.add_argument("--blocks", type=int, default=None, metavar="LAYER",
                    help="instead: the first draw's replay block by block (per layer, deepseek's fitted "
                         "cost over the default's), then LAYER of the first block per GPU")
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    if a.first_from_scratch:
        first_from_scratch()
    shape = MODEL_PRESETS[a.model]
    M, P, tokens = a.ep, shape.num_experts + a.ep, issue29.TOKEN_PRESETS[a.preset]
    coef, source = fit_for(a.model, a.preset, {} if a.fit is None else {(a.model, a.preset): a.fit})
    cost, analytic, link = FittedCost(dict(zip(FEATURES, coef))), AnalyticCost(), LinkModel()
    changes = {k: type(getattr(issue29._opts(0.05, M, shape, a.preset), k))(v)
               for k, v in (s.split("=", 1) for s in a.set)}
    parts = [f"{k}={v}" for k, v in changes.items()] + (["first plan from scratch"] if a.first_from_scratch else [])
    label = ", ".join(parts) or "runtime defaults"
    if a.fresh_windows:
        return fresh_windows(a, shape, cost)
    if a.blocks is not None:
        return blocks(a, shape, cost, changes)
    print(f"{a.model} EP {M} {a.preset} {a.trace}, {label}; fit: {source}")
    print("| draw (families) | fit, expected counts | fit, Poisson (4 seeds) | analytic | moves/rebalance |")
    print("|---|---|---|---|---|")
    seeds = [int(x) for x in a.family_seeds.split(",")] if a.trace in issue29.SYNTHETIC else [issue29.FAMILY_SEED]
    for seed in seeds:
        trace = _draw(a, seed)  # [T, L, N]
        opts = replace(issue29._opts(0.05, M, shape, a.preset), **changes)
        planned = plan_scale(trace, shape, M, P, issue29.WINDOW, issue29.INTERVAL, link, ("deepseek", "default"),
                             opts=opts)

        def replay(c, **kw):
            return scale_replay(planned[0], shape, M, P, tokens, issue29.WINDOW, issue29.INTERVAL, c, link,
                                placements=("deepseek", "default"), planned=planned, opts=opts, **kw).rows
        exp = replay(cost)
        pois = np.mean([ratio(replay(cost, counts="poisson", seed=s)) for s in range(POISSON_SEEDS)])
        d = exp["default"]
        print(f"| {seed} | {ratio(exp):.4f} | {pois:.4f} | {ratio(replay(analytic)):.4f} | "
              f"{d.experts_moved / max(1, d.rebalances):.1f} |", flush=True)


if __name__ == "__main__":
    main()
