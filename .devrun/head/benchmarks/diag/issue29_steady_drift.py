"""Issue 29, steady windows (`EplbConfig.steady_windows`): what they do on small balance
replays, 8 seeds each, a drifting load (tests/test_shift.py's cosine mix of two Zipf
profiles) and a steady one (lognormal shares), at 200, 2,000 and 20,000 tokens a step
(2 layers, 16 experts, 8 GPUs, 24 slots, window = interval = 4, min gain 0).

    python benchmarks/diag/issue29_steady_drift.py

Prints the mean, min and max over seeds of the out-of-sample imbalance with 2 steady
windows over that with none (below 1: better)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from eplb.core.simulate import simulate  # noqa: E402
from test_shift import _drifting_trace, steady_trace  # noqa: E402


def steady(tokens: int, seed: int) -> np.ndarray:  # [40, 2, 16] counts
    return steady_trace(tokens, seed=seed, steps=40)


def main() -> None:
    for kind, make in (("drift", _drifting_trace), ("steady", steady)):
        for tokens in (200, 2000, 20000):
            imb = {0: [], 2: []}
            for seed in range(8):
                trace = make(tokens, seed)
                for k in imb:
                    r = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False,
                                 steady_windows=k)
                    imb[k].append(float(r.policies["default"].layer_imbalance[4:].mean()))
            d = np.array(imb[2]) / np.array(imb[0])
            print(f"{kind:<6} {tokens:>6} tokens/step: imbalance with 2 steady windows / none: "
                  f"mean {d.mean():.4f}, min {d.min():.4f}, max {d.max():.4f}", flush=True)


if __name__ == "__main__":
    main()
