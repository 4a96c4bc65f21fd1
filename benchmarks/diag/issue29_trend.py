"""Issue 29, the prototype of `trend.DriftTrend`: on a drifting load, plan on the window's trend.

A scheduled plan on a drifting load (`planning.drifting`: the plans in force kept falling
below their predictions by more than the move tolerance and the routing noise) plans on
the window summed, so it balances the load as it was around the window's middle, while
the interval it serves lies `(window + interval) / 2` steps later. Here such a plan plans
instead on each expert's count extrapolated linearly to the middle of the interval it will
serve (a least-squares slope over the window's steps, at least `FLOOR` of the window mean,
rescaled to the window's tokens per layer). Variants:

- `trend`: whenever the drift rule fires (and the plan is not after a shift);
- `trend-skill`: the same, per layer, only when on the layer's last interval the previous
  trend prediction was closer (L1 of the shares) to what came than the window was;
- `product`: what the planner now does (`EplbConfig.drift_trend`, no patch): slopes
  within routing noise shrunk, the trend's move carried over to the plan's load, in
  layers that pass the skill gate where the drift rule fires or the layer was on the
  trend at the last plan.

`off`, `trend` and `trend-skill` run with `drift_trend` off and the replay
(`eplb.core.replay.replay_policy`) patched here; deepseek and the oracle are untouched. Prints default/deepseek (analytic tokens/s, expected counts) per
configuration for the runtime's default and the variants, and how many plans used the
trend.

    python benchmarks/diag/issue29_trend.py --traces drift --family-seeds 29,30,31,32 --ep 8,32,128
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

import eplb.core.replay as replay  # noqa: E402
import eplb.core.scale as scale  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, TOKEN_PRESETS, LinkModel  # noqa: E402
from eplb.core.planning import SteadyMemory  # noqa: E402
import issue29  # noqa: E402

FLOOR = 0.1  # an expert's extrapolated count is at least this share of its window mean
STATE = {"variant": "off", "trace": None, "window": None, "last": None, "prev": None, "fired": 0, "plans": 0}


def trend(steps: np.ndarray, ahead: float) -> np.ndarray:  # [W, L, N] -> [L, N]
    """Each expert's count per step extrapolated `ahead` steps past the window's middle,
    at least FLOOR of its mean, rescaled to the window's tokens per layer (the sum)."""
    W = steps.shape[0]
    x = np.arange(W) - (W - 1) / 2.0  # [W]
    mean = steps.mean(0)  # [L, N]
    slope = np.tensordot(x, steps, 1) / max(np.sum(x * x), 1e-300)  # [L, N] per step
    pred = np.maximum(mean + slope * ahead, FLOOR * mean)
    total = steps.sum((0, 2))[:, None]  # [L, 1]
    return pred * total / np.maximum(pred.sum(-1, keepdims=True), 1e-300)


def _shares(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(x.sum(-1, keepdims=True), 1e-300)


def patch() -> None:
    window_load, plan_tolerance, memory_plan = replay.window_load, replay.plan_tolerance, SteadyMemory.plan
    replay_policy = scale.replay_policy

    def patched_window_load(trace, step, window, decay=1.0):
        STATE["trace"], STATE["window"] = (trace, step, window), None
        return window_load(trace, step, window, decay)

    def patched_tolerance(shifted, move_tolerance, variation=None, window_noise=0.0):
        STATE["last"] = (shifted, replay.drifting(move_tolerance, variation, window_noise))
        return plan_tolerance(shifted, move_tolerance, variation, window_noise)

    def patched_memory_plan(self, window, steady):
        load, memory, used = memory_plan(self, window, steady)
        trace, step, w = STATE["trace"]
        shifted, drift = STATE["last"]
        steps = trace[max(0, step - w):step]  # [W, L, N] the window's steps
        STATE["plans"] += 1
        # only scheduled plans (an early plan's load is the load since its last plan, not the window)
        scheduled = steps.shape[0] == w and np.allclose(steps.sum(0), window)
        if STATE["variant"] == "off" or not scheduled or shifted or not drift:
            STATE["prev"] = None
            return load, memory, used
        pred = trend(steps, (w + w) / 2.0)  # [L, N] window == interval in this replay
        use = np.ones(pred.shape[0], dtype=bool)  # [L]
        if STATE["variant"] == "trend-skill":
            prev = STATE["prev"]
            if prev is None:
                use[:] = False
            else:
                got = _shares(steps.sum(0))
                use = np.abs(_shares(prev[0]) - got).sum(-1) < np.abs(_shares(prev[1]) - got).sum(-1)
        STATE["prev"] = (pred, steps.sum(0))
        STATE["fired"] += int(use.any())
        return np.where(use[:, None], pred, load), memory, used

    def patched_replay(trace, initial, steps, window, name, *args, **kwargs):
        STATE["prev"] = None
        return replay_policy(trace, initial, steps, window, name, *args, **kwargs)

    replay.window_load, replay.plan_tolerance = patched_window_load, patched_tolerance
    SteadyMemory.plan = patched_memory_plan
    scale.replay_policy = patched_replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="drift")
    ap.add_argument("--family-seeds", default="29")
    ap.add_argument("--ep", default="8,32,128")
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--preset", default="decode")
    ap.add_argument("--variants", default="off,trend,trend-skill,product")
    ap.add_argument("--shared", type=Path, default=issue29.SHARED)
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    patch()
    shape = MODEL_PRESETS[a.model]
    tokens = TOKEN_PRESETS[a.preset]
    for seed in [int(s) for s in a.family_seeds.split(",")]:
        issue29.FAMILIES[0] = seed
        issue29._LOADS.clear()
        loads_all = issue29._all_loads()
        for name in a.traces.split(","):
            if name not in issue29.SYNTHETIC and seed != int(a.family_seeds.split(",")[0]):
                continue  # a shared trace is no draw: once
            for M in [int(x) for x in a.ep.split(",")]:
                P = shape.num_experts + M
                cells = []
                for variant in a.variants.split(","):
                    STATE.update(variant="off" if variant == "product" else variant, fired=0, plans=0)
                    opts = replace(issue29._opts(0.05, M, shape, a.preset), drift_trend=variant == "product")
                    kinds = ("deepseek", "default")
                    planned = scale.plan_scale(loads_all[name], shape, M, P, issue29.WINDOW, issue29.INTERVAL,
                                               LinkModel(), kinds, opts=opts)
                    r = scale.scale_replay(loads_all[name], shape, M, P, tokens, issue29.WINDOW, issue29.INTERVAL,
                                           issue29.make_cost("analytic", shape, 1 + shape.num_experts // 8 + 1, tokens),
                                           LinkModel(), placements=kinds, planned=planned, opts=opts).rows
                    moved = [b.record.experts_moved for b in planned[1]["default"] if b.record and not b.record.skipped]
                    cells.append(f"{variant} {r['default'].tokens_per_s / r['deepseek'].tokens_per_s:.4f} "
                                 f"(trend in {STATE['fired']} plans, moves {np.sum(moved):.0f})")
                print(f"{a.model} {name} f{seed} EP {M} {a.preset}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
