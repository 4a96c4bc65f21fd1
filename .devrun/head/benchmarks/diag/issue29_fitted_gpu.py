"""Issue 29: the `--cost gpu` replay on a CPU, from the GEMM times an H200 run measured.

`benchmarks/issue29.py --cost gpu` writes `issue29.json` (whose `gpu.<model>.<preset>.fit`
is `GpuGemmCost`'s least-squares fit: seconds per launch, slot with tokens, token, 64- and
128-row tile) and `gemms.json` (every GEMM it timed). This script replays one
configuration with that fit as the expert cost (`FittedCost`), so that planner changes can
be tried against GPU-like costs without a GPU, and says why a placement is slower on it:

- the fit's error on the measured GEMMs (median and 95th percentile, relative);
- tokens/s of the default over deepseek's, and moves per rebalance, at each
  `--tolerances` move tolerance;
- with `--counts poisson --seeds S`, the ratio is the mean over S Poisson draws of the
  scored steps' counts (the breakdown below stays on the expected counts);
- with `--first-from-scratch`, also the default whose first plan (from the start-up
  placement, which no plan chose) uses tolerance 0 and later plans the tolerance, a
  variant the planner does not have (patched in here);
- for the default at each tolerance and for deepseek, over the scored steps: the busiest
  GPU's tokens over the mean (what the planner balances), its fitted cost over the mean
  (what the GPU pays), and the 128-row tiles beyond one per slot on the busiest GPU and on
  all GPUs (a slot with more than 128 tokens streams its weights again per tile).

    python benchmarks/diag/issue29_fitted_gpu.py \\
        --fit benchmarks/results/2026-12-03-issue29-gpu-ep8-64/ep8/issue29.json \\
        --gemms benchmarks/results/2026-12-03-issue29-gpu-ep8-64/ep8/gemms.json.gz \\
        --trace steady-lognormal --ep 8

Plans are made here (the CPU part); the runtime's defaults, DeepSeek-V3, the `--preset`
(decode unless told).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import eplb.core.replay as replay  # noqa: E402
import eplb.core.scale as scale  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, LinkModel  # noqa: E402
from eplb.core.scale import plan_scale, scale_replay, slot_counts  # noqa: E402
from eplb.ops.gpu_cost import FEATURES, fitted_seconds  # noqa: E402
import issue29  # noqa: E402

TILE = 128


class FittedCost:
    """An `ExpertCost` from a `GpuGemmCost` fit (`gpu_cost.fitted_seconds`) per GPU."""

    def __init__(self, fit: dict) -> None:
        self.coef = np.array([fit[k] for k in FEATURES])  # [F]

    def __call__(self, shape, counts: np.ndarray) -> np.ndarray:  # [L, M, S] -> [L, M]
        return fitted_seconds(counts, self.coef)


def fit_error(cost: FittedCost, gemms: list) -> tuple[float, float]:
    """(median, 95th percentile) of |fitted / measured - 1| over the measured GEMMs."""
    fitted = np.array([fitted_seconds(k, cost.coef) for k, _ in gemms])  # [K]
    y = np.array([t for _, t in gemms])  # [K]
    err = np.abs(fitted / y - 1)
    return float(np.median(err)), float(np.percentile(err, 95))


def breakdown(trace: np.ndarray, blocks, M: int, choices: int, cost: FittedCost, shape) -> dict:
    """Mean over the scored steps (and layers) of the busiest GPU's tokens / mean, fitted
    cost / mean, and the 128-row tiles beyond one per slot: on the busiest GPU, in all."""
    shares = trace / np.maximum(trace.sum(-1, keepdims=True), 1e-300)  # [T, L, N]
    tok, cst, top, tot = [], [], [], []
    for b in blocks:
        for t in range(b.start, b.end):
            c = slot_counts(shares[t], b.placement, choices, None)  # [L, M, S]
            g = c.sum(-1)  # [L, M]
            tok.append(np.mean(g.max(-1) / g.mean(-1)))
            f = cost(shape, c)  # [L, M]
            cst.append(np.mean(f.max(-1) / f.mean(-1)))
            extra = (np.ceil(c / TILE) - (c > 0)).sum(-1)  # [L, M] tiles beyond the first
            top.append(np.mean(extra[np.arange(len(f)), f.argmax(-1)]))
            tot.append(np.mean(extra.sum(-1)))
    return {"tokens_max_over_mean": float(np.mean(tok)), "cost_max_over_mean": float(np.mean(cst)),
            "extra_tiles_busiest": float(np.mean(top)), "extra_tiles_all": float(np.mean(tot))}


def steady_draw(seed: int) -> np.ndarray:
    """[40, 4, 256] counts: benchmarks/issue29.py's steady-lognormal family drawn again
    (lognormal(0, 1) shares, fixed over the steps, 2**17 choices per step and layer)."""
    rng = np.random.default_rng(1000 + seed)
    shares = np.repeat(rng.lognormal(0.0, 1.0, (4, 256))[None], 40, 0)  # [T, L, N]
    return issue29._sample(shares, rng)


def first_from_scratch() -> None:
    """Patch the replay: the first plan of each `default` replay uses tolerance 0."""
    pending = [False]
    tolerance, replay_policy = replay.plan_tolerance, scale.replay_policy

    def patched_tolerance(*args, **kwargs) -> float:
        if pending[0]:
            pending[0] = False
            return 0.0
        return tolerance(*args, **kwargs)

    def patched_replay(trace, initial, steps, window, name, *args, **kwargs):
        pending[0] = name == "default"
        return replay_policy(trace, initial, steps, window, name, *args, **kwargs)

    replay.plan_tolerance, scale.replay_policy = patched_tolerance, patched_replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", type=Path, required=True, help="issue29.json of a --cost gpu run")
    ap.add_argument("--gemms", type=Path, default=None, help="its gemms.json(.gz): to report the fit's error")
    ap.add_argument("--trace", default="steady-lognormal")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--preset", choices=tuple(issue29.TOKEN_PRESETS), default="decode",
                    help="token preset (the fit must come from a run of it)")
    ap.add_argument("--tolerances", default="0.03,0.01,0")
    ap.add_argument("--shared", type=Path, default=issue29.SHARED)
    ap.add_argument("--out", type=Path, default=None, help="write fitted_gpu.json here")
    ap.add_argument("--counts", choices=("expected", "poisson"), default="expected",
                    help="token counts of the scored steps: expected (rounded) or Poisson draws")
    ap.add_argument("--seeds", type=int, default=1, help="Poisson seeds 0..S-1 (the ratio is their mean)")
    ap.add_argument("--dispatch-tokens", type=float, default=issue29.READS[1],
                    help="decode-aware packing's price of a token more on the busiest GPU (default: the runtime's)")
    ap.add_argument("--steady-seed", type=int, default=None,
                    help="replay a steady-lognormal trace drawn with this seed (profile and counts, "
                         "default_rng(1000 + seed)) instead of --trace: other draws of the family")
    ap.add_argument("--first-from-scratch", action="store_true",
                    help="also replay the default with its first plan at tolerance 0 (a variant)")
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    issue29.READS[1] = a.dispatch_tokens
    model, preset = "deepseek-v3", a.preset
    shape = MODEL_PRESETS[model]
    cost = FittedCost(json.loads(a.fit.read_text())["gpu"][model][preset]["fit"])
    doc: dict = {"fit": dict(zip(FEATURES, cost.coef.tolist())), "trace": a.trace, "ep": a.ep,
                 "dispatch_tokens": a.dispatch_tokens, "rows": []}
    if a.gemms is not None:
        opener = gzip.open if a.gemms.suffix == ".gz" else open
        with opener(a.gemms, "rt") as f:
            gemms = json.load(f)[model][preset]
        doc["fit_error_median"], doc["fit_error_p95"] = fit_error(cost, gemms)
        print(f"fit on {len(gemms)} measured GEMMs: |error| median {100 * doc['fit_error_median']:.2f}%, "
              f"95th percentile {100 * doc['fit_error_p95']:.2f}%", flush=True)
    M = a.ep
    P = shape.num_experts + M
    tokens = issue29.TOKEN_PRESETS[preset]
    trace = issue29._all_loads()[a.trace] if a.steady_seed is None else steady_draw(a.steady_seed)
    if a.steady_seed is not None:
        a.trace = f"steady-lognormal draw {a.steady_seed}"
        doc["trace"] = a.trace
    variants = [(float(x), False) for x in a.tolerances.split(",")]
    if a.first_from_scratch:
        variants.append((issue29._opts(0.05, M, shape, preset).move_tolerance, True))
    for tol, first in variants:
        if first:
            first_from_scratch()
        opts = replace(issue29._opts(0.05, M, shape, preset), move_tolerance=tol)
        loads, blocks = plan_scale(trace, shape, M, P, issue29.WINDOW, issue29.INTERVAL, LinkModel(),
                                   ("deepseek", "default"), 0.0, opts)
        runs = [scale_replay(loads, shape, M, P, tokens, issue29.WINDOW, issue29.INTERVAL, cost, LinkModel(),
                             placements=("deepseek", "default"), planned=(loads, blocks), opts=opts,
                             counts=a.counts, seed=seed).rows for seed in range(a.seeds)]
        r = runs[0]
        moved = [b.record.experts_moved for b in blocks["default"] if b.record and not b.record.skipped]
        row = {"move_tolerance": tol, "first_plan_from_scratch": first, "moves_each_rebalance": moved,
               "counts": a.counts, "seeds": a.seeds,
               "default/deepseek": float(np.mean([x["default"].tokens_per_s / x["deepseek"].tokens_per_s
                                                  for x in runs])),
               "moves_per_rebalance": r["default"].experts_moved / max(1, r["default"].rebalances),
               "deepseek_moves_per_rebalance": r["deepseek"].experts_moved / max(1, r["deepseek"].rebalances),
               "default": breakdown(loads, blocks["default"], M, M * tokens * shape.top_k, cost, shape),
               "deepseek": breakdown(loads, blocks["deepseek"], M, M * tokens * shape.top_k, cost, shape)}
        doc["rows"].append(row)
        d, s = row["default"], row["deepseek"]
        print(f"{a.trace} EP {M} tolerance {tol:g}{' (first plan 0)' if first else ''}: default/deepseek {row['default/deepseek']:.4f}, moves/rebalance "
              f"{row['moves_per_rebalance']:.1f} (deepseek {row['deepseek_moves_per_rebalance']:.1f}), each: {moved}\n"
              f"  busiest GPU tokens/mean: default {d['tokens_max_over_mean']:.4f}, deepseek "
              f"{s['tokens_max_over_mean']:.4f}; cost/mean: default {d['cost_max_over_mean']:.4f}, deepseek "
              f"{s['cost_max_over_mean']:.4f}\n  extra 128-row tiles, busiest GPU: default "
              f"{d['extra_tiles_busiest']:.2f}, deepseek {s['extra_tiles_busiest']:.2f}; all GPUs: default "
              f"{d['extra_tiles_all']:.2f}, deepseek {s['extra_tiles_all']:.2f}", flush=True)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "fitted_gpu.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
