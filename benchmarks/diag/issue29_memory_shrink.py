"""Issue 29, steady windows on a drift hidden in routing noise: would weighing the
remembered windows by how far they sit from the window (a James-Stein shrink) beat
keeping them whole or forgetting them (`planning.same_traffic`'s verdict)?

The variant (not in the planner): per layer, Pearson's chi-square `stat` of the window
against the remembered shares (what `same_traffic` computes, routing noise of both parts
counted) estimates how far the remembered shares are from the window's beyond noise; the
share estimate that minimises the expected squared error weighs the memory by
`n_m / (n_w + n_m) * min(1, dof / stat)` (n: tokens, dof = N - 1), so pure noise
(stat ~ dof) keeps the memory whole and a visible move shrinks it. A layer the 3-sigma test
refuses still forgets, as now. Same replays as `issue29_steady_drift.py` (2 layers, 16
experts, 8 GPUs, 24 slots, window = interval = 4, min gain 0, 8 seeds, drift trend off so
the steady windows alone differ).

    python benchmarks/diag/issue29_memory_shrink.py

Prints, per load and tokens a step, the out-of-sample imbalance of the current memory and
of the shrink, each over that with no steady windows (mean, min, max over seeds; below 1:
better)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from eplb.core import planning  # noqa: E402
from eplb.core.simulate import simulate  # noqa: E402
from test_shift import _drifting_trace, steady_trace  # noqa: E402

CURRENT = planning.SteadyMemory.plan


def shrink_plan(self, window, steady):
    """SteadyMemory.plan with the memory weighed by min(1, dof / stat) per layer."""
    window = np.asarray(window, dtype=np.float64)
    used = np.zeros(window.shape[0], dtype=bool)
    if not steady or self.keep == 0:
        return window, replace(self, windows=()), used
    kept = self.windows
    load = window
    if kept:
        m = np.sum(kept, axis=0)  # [L, N]
        same = planning.same_traffic(window, m)  # [L] the 3-sigma verdict, as now
        kept = tuple(w * same[:, None] for w in kept)
        m = m * same[:, None]
        N = window.shape[-1]
        wt, mt = window.sum(-1, keepdims=True), m.sum(-1, keepdims=True)  # [L, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            expected = wt * (m + 0.5) / (mt + 0.5 * N)
            stat = ((window - expected) ** 2 / (expected * (1 + wt / mt))).sum(-1)  # [L]
        f = np.where(mt[:, 0] > 0, np.minimum(1.0, (N - 1) / np.maximum(stat, 1e-300)), 0.0)  # [L]
        lam = f * mt[:, 0] / np.maximum(wt[:, 0] + mt[:, 0], 1e-300)  # [L] the memory's weight
        p_w = np.divide(window, wt, out=np.zeros_like(window), where=wt > 0)
        p_m = np.divide(m, mt, out=np.zeros_like(m), where=mt > 0)
        load = (wt + mt) * ((1 - lam)[:, None] * p_w + lam[:, None] * p_m)
        load = np.where(wt > 0, load, window + m)
        used = same & (mt[:, 0] > 0)
    return load, replace(self, windows=(kept + (window,))[-self.keep:]), used


def steady(tokens: int, seed: int) -> np.ndarray:
    return steady_trace(tokens, seed=seed, steps=40)


def main() -> None:
    for kind, make in (("drift", _drifting_trace), ("steady", steady)):
        for tokens in (200, 2000, 20000):
            res = {k: [] for k in ("none", "current", "shrink")}
            for seed in range(8):
                trace = make(tokens, seed)
                for k in res:
                    planning.SteadyMemory.plan = shrink_plan if k == "shrink" else CURRENT
                    r = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False,
                                 steady_windows=0 if k == "none" else 2, drift_trend=False)
                    res[k].append(float(r.policies["default"].layer_imbalance[4:].mean()))
            planning.SteadyMemory.plan = CURRENT
            base = np.array(res["none"])
            cells = []
            for k in ("current", "shrink"):
                d = np.array(res[k]) / base
                cells.append(f"{k} {d.mean():.4f} ({d.min():.4f}-{d.max():.4f})")
            print(f"{kind:<6} {tokens:>6} tokens/step, over no steady windows: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
