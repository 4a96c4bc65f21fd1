"""Issue 29: does a GEMM's largest group explain a `--cost gpu` row that its fit misses?

    python benchmarks/diag/issue29_heavy_fit.py --run RUN --plans PLANS [PLANS ...] \\
        --model qwen3-235b --trace steady-lognormal --ep 8 --preset prefill

RUN is the `--out` folder of a `benchmarks/issue29.py --cost gpu` row (its `issue29.json`
and `gemms.json(.gz)`: every GEMM it timed). Its GEMMs are fitted twice by least relative
error: on `gpu_cost.FEATURES`, and on those plus the largest group's tokens (`heavy`). For
each fit this prints its median and 95th-percentile error (for the first, its median
residual by the size of the largest group), and for every PLANS folder
(`issue29.py --plans`) default/deepseek of that configuration scored on the fit (expected
counts, as a GPU row scores). The row's measured ratio is printed for comparison: a fit
that reproduces it can forecast other plans of the same configuration.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import issue29  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, LinkModel  # noqa: E402
from eplb.core.scale import scale_replay  # noqa: E402
from eplb.ops.gpu_cost import features  # noqa: E402


def gemms(run: Path, model: str, preset: str) -> tuple[np.ndarray, np.ndarray]:
    """The run's timed GEMMs: token counts [K, S] (zero padded) and seconds [K]."""
    f = run / "gemms.json.gz"
    doc = json.load(gzip.open(f) if f.exists() else open(run / "gemms.json"))
    rows = doc[model][preset]
    counts = np.zeros((len(rows), max(len(k) for k, _ in rows)))
    for i, (k, _) in enumerate(rows):
        counts[i, :len(k)] = k
    return counts, np.array([t for _, t in rows])


def design(counts: np.ndarray, heavy: bool) -> np.ndarray:  # [..., S] -> [..., F]
    """The fit's columns: `gpu_cost.features`, and with `heavy` the largest group's tokens."""
    x = features(counts)
    return np.concatenate([x, counts.max(-1, keepdims=True)], -1) if heavy else x


class HeavyFit:
    """An `ExpertCost` (counts [L, M, S] -> seconds [L, M]) fitted on a run's GEMMs."""

    def __init__(self, counts: np.ndarray, seconds: np.ndarray, heavy: bool) -> None:
        self.heavy = heavy
        x = design(counts, heavy)  # [K, F]
        self.coef, *_ = np.linalg.lstsq(x / seconds[:, None], np.ones(len(seconds)), rcond=None)  # [F]
        err = np.abs(x @ self.coef / seconds - 1)
        self.error = (float(np.median(err)), float(np.percentile(err, 95)))

    def __call__(self, shape, counts: np.ndarray) -> np.ndarray:
        c = np.asarray(counts, dtype=np.float64)
        return np.where(c.sum(-1) > 0, design(c, self.heavy) @ self.coef, 0.0)


def scored(model: str, trace: str, M: int, preset: str, plans: Path, cost) -> dict:
    """The rows (kind -> ScaleRow) of the shift-detection replay of one configuration's
    plans in `plans` (`issue29.py --plans`), priced by `cost`, expected counts."""
    shape = MODEL_PRESETS[model]
    loads, blocks = issue29._plans(model, trace, M, 0.05, plans, preset)["shift"]
    return scale_replay(loads, shape, M, shape.num_experts + M, issue29.TOKEN_PRESETS[preset], issue29.WINDOW,
                        issue29.INTERVAL, cost, LinkModel(), planned=(loads, blocks),
                        opts=issue29._opts(0.05, M, shape, preset)).rows


BINS = (0, 2000, 4000, 6000, 8000, 10000, 14000)  # largest group, tokens: the lower edges


def residuals_by_largest(counts: np.ndarray, seconds: np.ndarray, fit: HeavyFit) -> str:
    """The fit's median residual (measured / fitted - 1) per bin of the largest group."""
    multi = (counts > 0).sum(1) >= 2  # [K] the single-slot calibration grid left out
    r = seconds / fit(None, counts) - 1  # [K]
    big = counts.max(1)
    out = []
    for lo, hi in zip(BINS, BINS[1:] + (np.inf,)):
        sel = multi & (big >= lo) & (big < hi)
        if sel.sum() >= 5:
            out.append(f"{lo}-{'' if hi == np.inf else int(hi)}: {100 * np.median(r[sel]):+.2f}% ({sel.sum()})")
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--plans", type=Path, nargs="+", required=True)
    ap.add_argument("--model", default="qwen3-235b", choices=tuple(MODEL_PRESETS))
    ap.add_argument("--trace", default="steady-lognormal")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--preset", default="prefill", choices=tuple(issue29.TOKEN_PRESETS))
    ap.add_argument("--shared", type=Path, default=issue29.SHARED, help="the shared traces' npy folder")
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    M = a.ep
    measured = [r for r in json.loads((a.run / "issue29.json").read_text())["rows"]
                if (r["model"], r["trace"], r["ep"], r["preset"]) == (a.model, a.trace, M, a.preset)]
    counts, seconds = gemms(a.run, a.model, a.preset)
    print(f"{a.model} {a.trace} EP {M} {a.preset}: {len(seconds)} GEMMs timed; measured default/deepseek "
          + (f"{measured[0]['default/deepseek']:.4f}" if measured else "- (not in the run)"))
    for heavy in (False, True):
        fit = HeavyFit(counts, seconds, heavy)
        name = "features + largest group" if heavy else "features"
        extra = f", largest group {fit.coef[-1] / fit.coef[2]:+.3f} x a token's" if heavy else ""
        print(f"  fit on {name}: |error| median {100 * fit.error[0]:.2f}%, 95th percentile "
              f"{100 * fit.error[1]:.2f}%{extra}")
        if not heavy:
            print("    measured over fitted - 1 (median) of the GEMMs of 2 slots or more, by their largest group: "
                  + residuals_by_largest(counts, seconds, fit))
        for plans in a.plans:
            if not issue29._plan_file(plans, a.model, a.trace, M, 0.05, a.preset).exists():
                sys.exit(f"{plans} holds no plans of {a.model} {a.trace} EP {M} {a.preset}")
            r = scored(a.model, a.trace, M, a.preset, plans, fit)
            print(f"    {plans}: default/deepseek {r['default'].tokens_per_s / r['deepseek'].tokens_per_s:.4f}, "
                  f"default/oracle {r['default'].tokens_per_s / r['oracle'].tokens_per_s:.4f}")


if __name__ == "__main__":
    main()
