"""Issue 29: why the default trails deepseek on real GEMM times at EP 8 decode on the
steady family (benchmarks/README.md, "Issue 29, target 3 ... on by default").

    python benchmarks/diag/issue29_tiles.py

Replays the plans of `benchmarks/issue29.py` (DeepSeek-V3, `steady-lognormal`, EP 8, 128
tokens per GPU, expected counts) and prints, averaged over every scored step and layer,
the busiest GPU's tokens over the mean and its row tiles of 64 tokens (the grouped GEMM's
unit of work), for deepseek and the default at move tolerance 0.03 and 0.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

from eplb.core.cost_model import MODEL_PRESETS, LinkModel  # noqa: E402
from eplb.core.scale import PlanOptions, plan_scale, slot_counts  # noqa: E402
import issue29  # noqa: E402

TILE = 64


def main() -> None:
    loads = issue29.synthetic()["steady-lognormal"]
    shape = MODEL_PRESETS["deepseek-v3"]
    M, tokens = 8, 128
    P = shape.num_experts + M
    for tol in (0.03, 0.0):
        stacked, blocks = plan_scale(loads, shape, M, P, 4, 4, LinkModel(), ("static", "deepseek", "default"),
                                     opts=PlanOptions(move_tolerance=tol))
        for kind in ("deepseek", "default"):
            over, tiles = [], []
            for b in blocks[kind]:
                for t in range(b.start, b.end):
                    shares = stacked[t] / stacked[t].sum(-1, keepdims=True)  # [L, N]
                    c = slot_counts(shares, b.placement, M * tokens * shape.top_k)  # [L, M, S]
                    tok = c.sum(-1)  # [L, M]
                    over.append((tok.max(1) / tok.mean(1)).mean())
                    tiles.append(np.ceil(c / TILE).sum(-1).max(1).mean())
            print(f"move tolerance {tol:g}  {kind:<8}  busiest GPU tokens / mean {np.mean(over):.4f}  "
                  f"busiest GPU tiles {np.mean(tiles):.2f}")


if __name__ == "__main__":
    main()
