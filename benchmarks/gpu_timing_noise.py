"""How much one `--cost gpu` measurement varies: the same grouped GEMMs timed again and again.

    python benchmarks/gpu_timing_noise.py --out $OUT/noise      # needs a CUDA GPU

Draws `--keys` decode-like GPUs of the DeepSeek-V3 shape at EP 8 (33 slots, `--tokens`
token-expert choices split over them by lognormal(0, 1) shares) and times each
`--rounds` times, in a new random order every round, two ways side by side:

- `launch`: one launch at a time between CUDA events, median of 3 (how
  `eplb.ops.gpu_cost.GpuGemmCost` timed before 2026-12-03);
- `graph`: `GpuGemmCost._time_graph`, a CUDA graph of back-to-back runs (what it does for
  decode-sized GEMMs; from 2026-12-05 a GEMM over 2 ms is timed from queued runs, no graph).

Prints, per way, each key's mean time, its coefficient of variation (std / mean) and
range ((max - min) / median) over the rounds, and the variation of the ratio of two keys'
times (what a placement comparison rests on). Writes `timing_noise.json` under `--out`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb.core.cost_model import MODEL_PRESETS  # noqa: E402
from eplb.ops.gpu_cost import GpuGemmCost  # noqa: E402


def launch_time(cost: GpuGemmCost, key: tuple[int, ...], reps: int = 3) -> float:
    """Seconds of one grouped GEMM of `key`, one launch at a time, median of `reps`."""
    run = cost.gemm(key)
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=1024, help="token-expert choices per GPU (decode: 128 x top-8)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    shape = MODEL_PRESETS["deepseek-v3"]
    rng = np.random.default_rng(0)
    cost = GpuGemmCost(shape, 34, 4 * a.tokens, device="cuda", reps=3)
    keys = []
    for _ in range(a.keys):
        w = rng.lognormal(0, 1, 33)
        c = rng.multinomial(a.tokens, w / w.sum())
        keys.append(tuple(sorted(c[c > 0].tolist(), reverse=True)))
    ways = {"launch": lambda k: launch_time(cost, k), "graph": cost._time}
    times = {w: [[] for _ in keys] for w in ways}  # way -> key -> [rounds] seconds
    for _ in range(a.rounds):
        for k in rng.permutation(len(keys)):
            for w, fn in ways.items():
                times[w][k].append(fn(keys[k]))
    doc = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "keys": [list(k) for k in keys], "rounds": a.rounds, "ways": {}}
    for w, per_key in times.items():
        t = np.array(per_key)  # [K, R]
        cv = t.std(1) / t.mean(1)
        spread = (t.max(1) - t.min(1)) / np.median(t, 1)
        ratio = t[0] / t[1]
        doc["ways"][w] = {"mean_us": (1e6 * t.mean(1)).round(1).tolist(), "cv": cv.round(5).tolist(),
                          "range": spread.round(5).tolist(), "ratio_cv": float(ratio.std() / ratio.mean())}
        print(f"{w:<7} mean us {np.round(1e6 * t.mean(1), 1).tolist()}\n        cv % "
              f"{np.round(100 * cv, 2).tolist()} (median {100 * np.median(cv):.2f})\n        range % "
              f"{np.round(100 * spread, 2).tolist()}\n        ratio of keys 0 and 1: cv "
              f"{100 * doc['ways'][w]['ratio_cv']:.2f}%", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "timing_noise.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
