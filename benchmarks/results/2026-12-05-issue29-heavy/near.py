"""Issue 29, 2026-12-05 (seventh session): how far apart the default, deepseek and oracle
plans of Qwen3-235B steady prefill are in token balance (`.devplans/heavy`, expected counts
of the prefill preset: 4096 tokens x top-8 per GPU and step). Per kind, averaged over the
scored steps and the layers: the busiest GPU's tokens over the mean, and how many GPUs are
within 1%, 3% and 5% of the busiest. Run from the repository root:

    python benchmarks/results/2026-12-05-issue29-heavy/near.py > benchmarks/results/2026-12-05-issue29-heavy/near.txt
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from largest import plans, slot_tokens  # noqa: E402


def main() -> None:
    for M in (8, 16, 32):
        z = plans("heavy", M)
        for kind in ("deepseek", "default", "oracle"):
            acc = []
            for gpu in slot_tokens(z, kind, M):
                g = gpu.sum(1)  # [M]
                top = g.max()
                acc.append((top / g.mean(), *((g >= f * top).sum() for f in (0.99, 0.97, 0.95))))
            a = np.mean(acc, axis=0)
            print(f"EP {M:2d} {kind:8s} busiest/mean {a[0]:.4f}  GPUs within 1% {a[1]:.2f}, 3% {a[2]:.2f}, "
                  f"5% {a[3]:.2f}")


if __name__ == "__main__":
    main()
