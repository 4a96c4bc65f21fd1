"""Issue 29: where a drifting load's replay loses, block by block.

For one cached configuration of `benchmarks/issue29.py` (its `--plans` folder), prints the
mean max/mean GPU load (expected counts) of every block each placement kind serves (out
of sample: deepseek, the default, the oracle, the default without shift detection) and
of each plan on the window it was planned on (in sample), and the default's rebalances
(experts moved, early, shifted).

    python benchmarks/diag/issue29_drift_blocks.py --plans P --family-seed 31 --ep 128 --preset decode
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

from eplb.core.replay import block_imbalance, step_imbalance  # noqa: E402
import issue29  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=Path, required=True, help="issue29.py's plan cache")
    ap.add_argument("--trace", default="drift")
    ap.add_argument("--family-seed", type=int, default=issue29.FAMILY_SEED)
    ap.add_argument("--ep", type=int, default=128)
    ap.add_argument("--preset", default="decode")
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--shared", type=Path, default=issue29.SHARED)
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    issue29.FAMILIES[0] = a.family_seed
    pl = issue29._plans(a.model, a.trace, a.ep, 0.05, a.plans, a.preset)
    loads, blocks = pl["shift"]  # [T, L, N]
    print(f"{a.model} {a.trace} (draw {a.family_seed}) EP {a.ep} {a.preset}: max/mean GPU load per block")
    rows = [(k, blocks[k]) for k in ("deepseek", "default", "oracle")] + [("no shift", pl["noshift"][1]["default"])]
    for kind, bs in rows:
        out = [block_imbalance(loads, b).mean() for b in bs]
        print(f"  out of sample {kind:9s} " + " ".join(f"{x:.3f}" for x in out) + f"   mean {np.mean(out):.4f}")
    W = issue29.WINDOW
    for kind in ("deepseek", "default"):
        ins = [step_imbalance(loads[b.start - W:b.start], b.placement).mean() for b in blocks[kind]]
        print(f"  in sample     {kind:9s} " + " ".join(f"{x:.3f}" for x in ins) + f"   mean {np.mean(ins):.4f}")
    print("  default's rebalances (moved, early, shifted):",
          [(b.record.experts_moved, b.record.early, b.record.shifted) for b in blocks["default"] if b.record])


if __name__ == "__main__":
    main()
