"""Issue 29: where a `--cost gpu` row's ratio departs from the GPU's own fitted cost.

    python benchmarks/diag/issue29_gpu_residuals.py --run RUN --plans PLANS \\
        --trace steady-lognormal --ep 8 --preset prefill

RUN is the `--out` folder of a `benchmarks/issue29.py --cost gpu` run (its `issue29.json`
holds the fit, `gemms.json(.gz)` every GEMM it timed, re-timed medians with `--retime`);
PLANS the `--plans` folder it scored. For each placement kind of the row, over the scored
steps and layers (expected counts, as the run scored them), the GPUs the run measured are
picked again the way `GpuGemmCost` picks them with its final fit (largest fitted times,
within 5%, at most 4), and this prints:

- the mean over layers of the slowest measured GEMM, and of the largest fitted time;
- how far that slowest GEMM was above its own fitted time (the residual the fit misses);
- the busiest GPU's tokens over the mean, and the size of the largest slot of a GPU.

Then it refits the run's GEMMs (those of at least `--min-slots` slots: the single-slot
calibration grid left out) on `gpu_cost.features` alone and with one more feature each
(the largest slot, its 128-row tiles, the sum of squared slot sizes), and prints each fit's
median and 95th-percentile relative error: does a feature of the GEMM's shape explain what
the fit misses?

Plans are read, not made, so the figures are those of the very GEMMs the run timed.
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

from eplb.core.cost_model import MODEL_PRESETS, TOKEN_PRESETS  # noqa: E402
from eplb.core.scale import slot_counts  # noqa: E402
from eplb.ops.gpu_cost import FEATURES, features, fitted_seconds  # noqa: E402
import issue29  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--plans", type=Path, required=True)
    ap.add_argument("--trace", default="steady-lognormal")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--preset", choices=tuple(TOKEN_PRESETS), default="prefill")
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--bucket", type=int, default=8, help="the run's GpuGemmCost bucket")
    ap.add_argument("--min-slots", type=int, default=2, help="refits: GEMMs of at least this many slots")
    a = ap.parse_args()
    doc = json.loads((a.run / "issue29.json").read_text())
    coef = np.array([doc["gpu"][a.model][a.preset]["fit"][k] for k in FEATURES])
    gz = a.run / "gemms.json.gz"
    with (gzip.open(gz, "rt") if gz.exists() else open(a.run / "gemms.json")) as f:
        table = {tuple(k): t for k, t in json.load(f)[a.model][a.preset]}
    shape = MODEL_PRESETS[a.model]
    loads, blocks = issue29._plans(a.model, a.trace, a.ep, doc["shift_threshold"], a.plans, a.preset)["shift"]
    shares = loads / loads.sum(-1, keepdims=True)  # [T, L, N]
    choices = a.ep * TOKEN_PRESETS[a.preset] * shape.top_k

    def key(c: np.ndarray) -> tuple[int, ...]:  # GpuGemmCost.measure's cache key
        c = c[c > 0]
        return tuple(sorted((-(-c // a.bucket) * a.bucket).tolist(), reverse=True))

    print(f"{a.model} {a.trace} EP {a.ep} {a.preset}: {len(table)} GEMMs timed; fit "
          + ", ".join(f"{k} {v:.3g}" for k, v in zip(FEATURES, coef)))
    for kind in ("deepseek", "default", "oracle"):
        slow, fit_max, resid, tok, big, missing = [], [], [], [], [], 0
        for b in blocks[kind]:
            for t in range(b.start, b.end):
                c = slot_counts(shares[t], b.placement, choices, None)  # [L, M, S]
                e = fitted_seconds(c, coef)  # [L, M]
                for layer in range(c.shape[0]):
                    order = np.argsort(-e[layer], kind="stable")[:4]
                    pick = [g for g in order if e[layer, g] >= 0.95 * e[layer].max()]
                    times = [table.get(key(c[layer, g])) for g in pick]
                    if any(x is None for x in times):
                        missing += 1
                        continue
                    j = int(np.argmax(times))
                    slow.append(times[j])
                    fit_max.append(e[layer].max())
                    resid.append(times[j] / e[layer, pick[j]] - 1)
                    g_tok = c[layer].sum(-1)  # [M]
                    tok.append(g_tok.max() / g_tok.mean())
                    big.append(c[layer].max(-1).mean())
        print(f"  {kind:9s} slowest measured {1e3 * np.mean(slow):.4f} ms, largest fitted {1e3 * np.mean(fit_max):.4f} ms, "
              f"slowest GEMM over its fit {100 * np.mean(resid):+.2f}%, busiest GPU tokens/mean {np.mean(tok):.4f}, "
              f"largest slot of a GPU {np.mean(big):.0f} tokens"
              + (f" ({missing} layers not in the run's GEMMs)" if missing else ""))

    refit(table, a.min_slots)


EXTRA = {"largest slot": lambda k: k.max(), "its 128-row tiles": lambda k: np.ceil(k.max() / 128),
         "sum of squared slots": lambda k: (k ** 2).sum() / 1e6}


def refit(table: dict, min_slots: int) -> None:
    """Least squares of the GEMM times on `features` (relative error, as `GpuGemmCost._fit`),
    alone and with each EXTRA feature: median and 95th percentile of |fit / time - 1|."""
    keys = [np.array(k, dtype=np.float64) for k in table if len(k) >= min_slots]
    y = np.array([table[tuple(int(v) for v in k)] for k in keys])  # [K] seconds
    base = np.array([features(k) for k in keys])  # [K, F]
    print(f"refits on {len(keys)} GEMMs of >= {min_slots} slots:")
    for name, extra in [("features alone", None)] + list(EXTRA.items()):
        X = base if extra is None else np.column_stack([base, [extra(k) for k in keys]])
        coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
        err = np.abs(X @ coef / y - 1)
        print(f"  {name:22s} |error| median {100 * np.median(err):.2f}%, 95th percentile "
              f"{100 * np.percentile(err, 95):.2f}%")


if __name__ == "__main__":
    main()
