"""Issue 29, steady windows (`EplbConfig.steady_windows`): what they do on small balance
replays, 8 seeds each, a drifting load (tests/test_shift.py's cosine mix of two Zipf
profiles) and a steady one (lognormal shares), at 200, 2,000 and 20,000 tokens a step
(2 layers, 16 experts, 8 GPUs, 24 slots, window = interval = 4, min gain 0).

    python benchmarks/diag/issue29_steady_drift.py            # steady windows: 2 against 0
    python benchmarks/diag/issue29_steady_drift.py --trend    # drift trend: on against off

Prints the mean, min and max over seeds of the out-of-sample imbalance with 2 steady
windows over that with none (with `--trend`: with the drift trend over without, both
with the default 2 steady windows; below 1: better)."""
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
    trend = "--trend" in sys.argv[1:]
    # (baseline, variant) settings of simulate()
    pair = ((dict(drift_trend=False), dict(drift_trend=True)) if trend else
            (dict(steady_windows=0, drift_trend=False), dict(steady_windows=2, drift_trend=False)))
    what = "with the drift trend / without" if trend else "with 2 steady windows / none"
    for kind, make in (("drift", _drifting_trace), ("steady", steady)):
        for tokens in (200, 2000, 20000):
            imb: list[list[float]] = [[], []]
            for seed in range(8):
                trace = make(tokens, seed)
                for out, kw in zip(imb, pair):
                    r = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False, **kw)
                    out.append(float(r.policies["default"].layer_imbalance[4:].mean()))
            d = np.array(imb[1]) / np.array(imb[0])
            print(f"{kind:<6} {tokens:>6} tokens/step: imbalance {what}: "
                  f"mean {d.mean():.4f}, min {d.min():.4f}, max {d.max():.4f}", flush=True)


if __name__ == "__main__":
    main()
