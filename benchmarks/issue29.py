"""Issue 29: default against deepseek and the oracle in tokens/s, EP 8 to 256, every trace.

    python benchmarks/issue29.py --cost analytic --out /tmp/i29        # CPU roofline
    python benchmarks/issue29.py --cost gpu --out $OUT                 # expert work timed on a GPU

Runs `eplb.core.scale` (what `eplb simulate --cost` runs; window and interval 4, one
spare slot per GPU, decode 128 and prefill 4,096 tokens per GPU) over:

- the shared traces of benchmarks/scale.py (`esft`, `olmoe`) on DeepSeek-V3 and Qwen3-235B
  shapes (64-expert traces stacked to 256 and 128 experts);
- synthetic families (256 experts, 4 layers, 40 steps, each step 2**17 token-expert
  choices per layer drawn from the step's shares, fixed seeds):
  `shift-zipf` (Zipf 1.0 popularity whose expert order is redrawn every 8 steps: a domain
  change at every second rebalance), `shift-lognormal` (lognormal(0, 1), redrawn every 12
  steps: shifts between rebalances), `steady-lognormal` (lognormal(0, 1), fixed),
  `drift` (a smooth cosine mix of two Zipf 1.0 profiles);

with the default planner shift-aware (`--shift-threshold`, default the runtime's) and not
(`0`), against deepseek (schedule only, as published) and the oracle. Prints one table per
model, trace and preset: tokens/s ratios default/deepseek and default/oracle, and the
moves per rebalance. Writes `issue29.json` under `--out`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eplb.core.planning import DEFAULT_SHIFT_THRESHOLD  # noqa: E402
from eplb.core.scale import (MODEL_PRESETS, TOKEN_PRESETS, LinkModel, PlanOptions,  # noqa: E402
                             plan_scale, scale_replay)
from eplb.ops.scale_report import make_cost  # noqa: E402
from scale import traces as shared_traces  # noqa: E402

EP_SIZES = (8, 16, 32, 64, 128, 256)
WINDOW = INTERVAL = 4
KINDS = ("static", "deepseek", "default", "oracle")


def _sample(shares: np.ndarray, rng: np.random.Generator, choices: int = 2 ** 17) -> np.ndarray:
    """[T, L, N] shares -> [T, L, N] counts: `choices` multinomial draws per step and layer."""
    T, L, N = shares.shape
    out = np.empty(shares.shape)
    for t in range(T):
        for layer in range(L):
            p = shares[t, layer]
            out[t, layer] = rng.multinomial(choices, p / p.sum())
    return out


def synthetic(T: int = 40, L: int = 4, N: int = 256) -> dict[str, np.ndarray]:
    """name -> [T, L, N] counts (see the module docstring)."""
    rng = np.random.default_rng(29)

    def zipf() -> np.ndarray:  # [L, N]
        return 1.0 / (np.argsort(rng.random((L, N)), 1) + 1.0)

    def lognormal() -> np.ndarray:  # [L, N]
        return rng.lognormal(0.0, 1.0, (L, N))

    out = {}
    out["shift-zipf"] = np.concatenate([np.repeat(zipf()[None], 8, 0) for _ in range(T // 8)])
    out["shift-lognormal"] = np.concatenate([np.repeat(lognormal()[None], 12, 0)
                                             for _ in range(-(-T // 12))])[:T]
    out["steady-lognormal"] = np.repeat(lognormal()[None], T, 0)
    a, b = zipf(), zipf()
    x = (1 - np.cos(np.pi * np.arange(T) / T)) / 2  # [T] 0 -> 1
    out["drift"] = (1 - x)[:, None, None] * a / a.sum(1, keepdims=True) + x[:, None, None] * b / b.sum(1, keepdims=True)
    return {k: _sample(v, rng) for k, v in out.items()}


def run(cost_kind: str, out: Path, shift: float, eps, models, names) -> dict:
    link = LinkModel()
    loads = shared_traces()
    loads.update(synthetic())
    doc = {"date": datetime.date.today().isoformat(), "cost": cost_kind, "shift_threshold": shift,
           "rows": []}
    for model in models:
        shape = MODEL_PRESETS[model]
        costs = {p: make_cost(cost_kind, shape, 1 + shape.num_experts // 8 + 1, t)
                 for p, t in TOKEN_PRESETS.items()}
        for name in names:
            trace = loads[name]
            if shape.num_experts % trace.shape[-1]:
                continue
            for M in eps:
                P = shape.num_experts + M
                t0 = time.perf_counter()
                variants = {}
                for label, thr in (("shift", shift), ("noshift", 0.0)):
                    kinds = KINDS if label == "shift" else ("static", "default")
                    variants[label] = plan_scale(trace, shape, M, P, WINDOW, INTERVAL, link, kinds,
                                                 opts=PlanOptions(shift_threshold=thr))
                t_plan = time.perf_counter() - t0
                for preset, tokens in TOKEN_PRESETS.items():
                    res = {label: scale_replay(trace, shape, M, P, tokens, WINDOW, INTERVAL,
                                               costs[preset], link, planned=pl,
                                               opts=PlanOptions(shift_threshold=thr))
                           for (label, pl), thr in zip(variants.items(), (shift, 0.0))}
                    r, r0 = res["shift"].rows, res["noshift"].rows
                    tps = {k: v.tokens_per_s for k, v in r.items()}
                    blocks = variants["shift"][1]["default"]
                    blocks0 = variants["noshift"][1]["default"]
                    row = {"model": model, "trace": name, "ep": M, "preset": preset,
                           "tokens_per_s": tps, "default_noshift": r0["default"].tokens_per_s,
                           "default/deepseek": tps["default"] / tps["deepseek"],
                           "default/oracle": tps["default"] / tps["oracle"],
                           "noshift/deepseek": r0["default"].tokens_per_s / tps["deepseek"],
                           "noshift/oracle": r0["default"].tokens_per_s / tps["oracle"],
                           "moves_per_rebalance": _moves(blocks), "moves_per_rebalance_noshift": _moves(blocks0),
                           "early_rebalances": sum(b.record.early for b in blocks if b.record),
                           "shifted_plans": sum(b.record.shifted for b in blocks if b.record),
                           "plan_s": round(t_plan, 1)}
                    doc["rows"].append(row)
                    print(f"{model:<12} {name:<17} EP {M:>3} {preset:<7} default/deepseek "
                          f"{row['default/deepseek']:.3f} (no shift {row['noshift/deepseek']:.3f})  "
                          f"default/oracle {row['default/oracle']:.3f} (no shift {row['noshift/oracle']:.3f})  "
                          f"moves/rebalance {row['moves_per_rebalance']:.1f} (no shift "
                          f"{row['moves_per_rebalance_noshift']:.1f}), early {row['early_rebalances']}, "
                          f"shifted {row['shifted_plans']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "issue29.json").write_text(json.dumps(doc) + "\n")
    return doc


def _moves(blocks) -> float:
    """Mean remote expert receives per rebalance that moved something."""
    moved = [b.record.experts_moved for b in blocks if b.record and not b.record.skipped]
    return float(np.mean(moved)) if moved else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", choices=["analytic", "gpu"], default="analytic")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shift-threshold", type=float, default=DEFAULT_SHIFT_THRESHOLD)
    ap.add_argument("--ep", default=",".join(map(str, EP_SIZES)))
    ap.add_argument("--models", default="deepseek-v3,qwen3-235b")
    ap.add_argument("--traces", default="esft,olmoe,shift-zipf,shift-lognormal,steady-lognormal,drift")
    a = ap.parse_args()
    run(a.cost, a.out, a.shift_threshold, [int(x) for x in a.ep.split(",")], a.models.split(","),
        a.traces.split(","))


if __name__ == "__main__":
    main()
