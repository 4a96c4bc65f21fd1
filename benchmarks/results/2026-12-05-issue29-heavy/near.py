"""Issue 29, 2026-12-05 (seventh session): how far apart the default, deepseek and oracle
plans of Qwen3-235B steady prefill are in token balance (`.devplans/heavy`, expected counts
of the prefill preset: 4096 tokens x top-8 per GPU and step). Per kind, averaged over the
scored steps and the layers: the busiest GPU's tokens over the mean, and how many GPUs are
within 1%, 3% and 5% of the busiest. Run from the repository root:

    python benchmarks/results/2026-12-05-issue29-heavy/near.py > benchmarks/results/2026-12-05-issue29-heavy/near.txt
"""
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
CHOICES = 4096 * 8  # token-expert choices per GPU and step


def main() -> None:
    for M in (8, 16, 32):
        z = np.load(ROOT / ".devplans" / "heavy" / f"qwen3-235b-steady-lognormal-M{M}-prefill-shift0.05-ci10-r100-d40-s2-t1.npz")
        loads = z["shift/loads"]  # [T, L, N]
        for kind in ("deepseek", "default", "oracle"):
            span, p2l, shares = z[f"shift/{kind}/span"], z[f"shift/{kind}/p2l"], z[f"shift/{kind}/shares"]
            acc = []
            for b, (s, e) in enumerate(span):
                for t in range(s, e):
                    for layer in range(loads.shape[1]):
                        tokens = loads[t, layer] / loads[t, layer].sum() * CHOICES * M  # [N] per step
                        gpu = (tokens[p2l[b, layer]] * shares[b, layer]).reshape(M, -1).sum(1)  # [M]
                        top = gpu.max()
                        acc.append((top / gpu.mean(), *((gpu >= f * top).sum() for f in (0.99, 0.97, 0.95))))
            a = np.mean(acc, axis=0)
            print(f"EP {M:2d} {kind:8s} busiest/mean {a[0]:.4f}  GPUs within 1% {a[1]:.2f}, 3% {a[2]:.2f}, "
                  f"5% {a[3]:.2f}")


if __name__ == "__main__":
    main()
