"""Issue 29: does counting 64-row tiles (not only non-empty slots) close the GPU-only gap
of the default against deepseek at EP 8 decode? A prototype, not the planner: the
decode-aware pass's per-slot cost `lam + R * P(slot not empty)` is replaced by
`lam + R * E[ceil(C / 64)]` (C ~ Poisson(lam): every 64-row tile of a grouped GEMM streams
the expert's weights again) and applied to every row, warm or not; also the default at
move tolerance 0.

    python benchmarks/diag/issue29_tiles_gpu.py --cost gpu --shared .devshared/traces/npy --out DIR

Prints one line per configuration: tokens/s over deepseek's of the default, the default
at tolerance 0, the default with the pass (R 100, D 40) and with the tile prototype
(Poisson counts, mean of `--seeds`)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import eplb.core.policy.balanced as balanced  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, LinkModel  # noqa: E402
from eplb.core.policy.balanced import reads  # noqa: E402
from eplb.core.scale import PlanOptions, plan_scale, scale_replay  # noqa: E402
from eplb.ops.scale_report import make_cost  # noqa: E402
import issue29  # noqa: E402

TILE = 64
_LGAMMA = np.frompyfunc(math.lgamma, 1, 1)


def expected_tiles(lam: np.ndarray) -> np.ndarray:
    """E[ceil(C / TILE)] for C ~ Poisson(lam), elementwise (exact sums up to lam + 12 sd)."""
    lam = np.asarray(lam, dtype=np.float64)
    out = np.zeros_like(lam)
    for idx in np.ndindex(lam.shape):
        x = lam[idx]
        if x <= 0:
            continue
        top = int(x + 12 * math.sqrt(x) + TILE + 10)
        c = np.arange(top + 1, dtype=np.float64)
        logp = c * math.log(x) - x - _LGAMMA(c + 1).astype(np.float64)
        out[idx] = float((np.exp(logp) * np.ceil(c / TILE)).sum())
    return out


def tile_spread(w, p2l, m, step_choices, read_tokens, rows_per_layer=1, min_gain=0.0,
                dispatch_tokens=float("inf")):
    """`reads.spread_reads` with tiles in place of reads, on every row."""
    if read_tokens <= 0 or step_choices <= 0 or m < 2:
        return p2l
    n = w.shape[1]
    wr = np.repeat(w, rows_per_layer, axis=0)
    total = wr.sum(1, keepdims=True)
    c = reads.counts_of(p2l, n)
    share = np.divide(wr, total * np.maximum(c, 1), out=np.zeros_like(wr), where=total > 0)
    lam = share * step_choices
    cost = lam + read_tokens * expected_tiles(lam)
    new = reads.swap_down(cost, lam, p2l, m, n, reads.READ_ITERS, dispatch_tokens)
    before = reads.objective(cost, lam, p2l, m, dispatch_tokens)
    after = reads.objective(cost, lam, new, m, dispatch_tokens, p2l)
    keep = after < before * (1.0 - min_gain)
    out = p2l.copy()
    out[keep] = new[keep]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost", choices=["analytic", "gpu"], default="analytic")
    ap.add_argument("--shared", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--traces", default="steady-lognormal,olmoe,esft")
    ap.add_argument("--tokens", default="128,16")
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args()
    if a.shared:
        issue29.SHARED_DIR[0] = a.shared
    loads = issue29._all_loads()
    shape, M, link = MODEL_PRESETS["deepseek-v3"], 8, LinkModel()
    P = shape.num_experts + M
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.traces.split(","):
        for tok in [int(x) for x in a.tokens.split(",")]:
            cost = make_cost(a.cost, shape, P // M + 1, tok)
            choices = M * tok * shape.top_k
            kw = dict(read_tokens=100.0, step_choices=choices, dispatch_tokens=40.0)
            plans = {"default": plan_scale(loads[name], shape, M, P, 4, 4, link, ("static", "deepseek", "default")),
                     "tolerance 0": plan_scale(loads[name], shape, M, P, 4, 4, link, ("static", "default"),
                                               opts=PlanOptions(move_tolerance=0.0)),
                     "reads": plan_scale(loads[name], shape, M, P, 4, 4, link, ("static", "default"),
                                         opts=PlanOptions(**kw))}
            saved = balanced.spread_reads
            balanced.spread_reads = tile_spread
            try:
                plans["tiles"] = plan_scale(loads[name], shape, M, P, 4, 4, link, ("static", "default"),
                                            opts=PlanOptions(**kw))
            finally:
                balanced.spread_reads = saved
            tps = {}
            for label, pl in plans.items():
                runs = [scale_replay(loads[name], shape, M, P, tok, 4, 4, cost, link, planned=pl,
                                     counts="poisson", seed=s).rows for s in range(a.seeds)]
                for kind in ("deepseek", "default"):
                    if kind in runs[0]:
                        tps[f"{label}/{kind}"] = float(np.mean([r[kind].tokens_per_s for r in runs]))
            ds = tps["default/deepseek"]
            row = {"trace": name, "tokens_per_gpu": tok,
                   **{label: tps[f"{label}/default"] / ds for label in plans}}
            rows.append(row)
            print(f"{name:<16} {tok:>4} tok/GPU  " + "  ".join(f"{k}/deepseek {v:.4f}" for k, v in row.items()
                                                            if k in plans), flush=True)
            (a.out / "issue29_tiles_gpu.json").write_text(json.dumps({"cost": a.cost, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
