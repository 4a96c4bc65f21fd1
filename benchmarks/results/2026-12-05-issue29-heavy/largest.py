"""Issue 29, 2026-12-05 (sixth session): the largest replica of Qwen3-235B steady prefill
plans at EP 8 and 16, before the heavy-replica check (`.devplans/all`) and with it
(`.devplans/heavy`). Per kind: the busiest GPU's tokens over the mean, the largest replica
in tokens per step (expected counts of the prefill preset, 4096 tokens x top-8 per GPU),
overall and on the busiest GPU, averaged over the scored steps and the 4 layers, and the
largest replica counts in layer 0 of the last plan. Run from the repository root:

    python benchmarks/results/2026-12-05-issue29-heavy/largest.py > benchmarks/results/2026-12-05-issue29-heavy/largest.txt
"""
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
CHOICES = 4096 * 8  # token-expert choices per GPU and step (TOKEN_PRESETS["prefill"] x top_k)


def plans(folder: str, M: int):
    """The Qwen3-235B steady prefill plans of EP M in `.devplans/<folder>` (npz)."""
    return np.load(ROOT / ".devplans" / folder / f"qwen3-235b-steady-lognormal-M{M}-prefill-shift0.05-ci10-r100-d40-s2-t1.npz")


def slot_tokens(z, kind: str, M: int):
    """Yield the tokens per step of every slot [M, S] of `kind`'s plans, for every scored
    step and layer."""
    loads = z["shift/loads"]  # [T, L, N]
    span, p2l, shares = z[f"shift/{kind}/span"], z[f"shift/{kind}/p2l"], z[f"shift/{kind}/shares"]
    for b, (s, e) in enumerate(span):
        for t in range(s, e):
            for layer in range(loads.shape[1]):
                tokens = loads[t, layer] / loads[t, layer].sum() * CHOICES * M  # [N] per step
                yield (tokens[p2l[b, layer]] * shares[b, layer]).reshape(M, -1)  # [M, S]


def main() -> None:
    for M in (8, 16):
        for folder in ("all", "heavy"):
            z = plans(folder, M)
            for kind in ("deepseek", "default"):
                p2l = z[f"shift/{kind}/p2l"]
                acc = []
                for gpu in slot_tokens(z, kind, M):
                    busiest = gpu.sum(1).argmax()
                    acc.append((gpu.sum(1).max() / gpu.sum(1).mean(), gpu.max(), gpu[busiest].max()))
                a = np.mean(acc, axis=0)
                counts = np.sort(np.bincount(p2l[-1, 0], minlength=z["shift/loads"].shape[2]))[::-1]
                print(f"EP {M:2d} {folder:5s} {kind:8s} busiest/mean {a[0]:.4f}  largest replica {a[1]:6.0f}  "
                      f"on the busiest GPU {a[2]:6.0f}  replica counts {' '.join(map(str, counts[counts > 1]))}")


if __name__ == "__main__":
    main()
