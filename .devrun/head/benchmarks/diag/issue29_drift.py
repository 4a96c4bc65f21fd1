"""Issue 29, target 1 at `drift` EP 128: default against deepseek under several move tolerances.

    python benchmarks/diag/issue29_drift.py 128 0.03,0.0,0.01

Plans the `drift` family (benchmarks/issue29.py) on the DeepSeek-V3 shape at the given EP
size with deepseek and with default at each move tolerance (shift-aware, routing noise of
decode's tokens, decode-aware packing off), then prints tokens/s default/deepseek (analytic cost, decode and
prefill) and the moves of each rebalance.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import issue29  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, AnalyticCost, LinkModel  # noqa: E402
from eplb.core.scale import PlanOptions, plan_scale, scale_replay  # noqa: E402


def main() -> None:
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    tolerances = [float(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "0.03,0.0").split(",")]
    loads = issue29.synthetic()["drift"]
    shape = MODEL_PRESETS["deepseek-v3"]
    P = shape.num_experts + M
    base = plan_scale(loads, shape, M, P, 4, 4, LinkModel(), ("static", "deepseek"))
    for tol in tolerances:
        t0 = time.time()
        opts = PlanOptions(move_tolerance=tol, step_choices=M * 128 * float(shape.top_k))
        pl = plan_scale(loads, shape, M, P, 4, 4, LinkModel(), ("static", "default"), opts=opts)
        blocks = dict(base[1], default=pl[1]["default"])
        for tokens in (128, 4096):
            r = scale_replay(loads, shape, M, P, tokens, 4, 4, AnalyticCost(), planned=(base[0], blocks))
            tps = {k: v.tokens_per_s for k, v in r.rows.items()}
            print(f"EP {M} tolerance {tol:g} {tokens} tok/GPU: default/deepseek "
                  f"{tps['default'] / tps['deepseek']:.4f}; moves per rebalance "
                  f"{[b.record.experts_moved for b in pl[1]['default']]} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
