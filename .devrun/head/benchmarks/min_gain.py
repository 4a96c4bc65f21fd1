"""Sweep of `min_gain` (skip a rebalance whose plan gains less) on measured load traces.

For each trace setting and each min_gain, `eplb.core.simulate.simulate` replays the trace with
the default policy and reports the out-of-sample imbalance (max/mean GPU load, mean over
layers and scored steps), the share of rebalances skipped, and the slots written per
rebalance (all rebalances, skipped ones counting 0). Prints one markdown table per setting.

    python benchmarks/min_gain.py                       # packaged ESFT trace only
    python benchmarks/min_gain.py --shared ../shared    # + per-task ESFT and OLMoE traces

OLMoE's published counts are one [3, 64] total per domain, not a time series: the
`olmoe-domains` setting replays the eight domains one after another, each held for 6
steps, so it measures a stationary load with seven abrupt switches.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from eplb.core.simulate import aggregate_steps, simulate
from eplb.core.workload import load_trace

GAINS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05)


def settings(shared: Path | None) -> list[tuple[str, np.ndarray, dict]]:
    """(label, trace [T, L, N], simulate keywords) of every setting swept."""
    esft = load_trace("esft")  # [213, 26, 64]
    out = []
    for agg, window in ((4, 4), (8, 2), (20, 1)):
        trace = aggregate_steps(esft, agg)
        for gpus, slots in ((8, 72), (16, 80), (32, 96)):
            out.append((f"esft all tasks, {agg} seq/step, window {window}, EP{gpus}, {slots} slots",
                        trace, dict(num_gpus=gpus, num_slots=slots, window=window, interval=1)))
    if shared is not None:
        npy = shared / "traces" / "npy"
        for task in ("intent", "translation"):
            trace = aggregate_steps(np.load(npy / f"esft_dsv2lite_{task}_per_seq.npy"), 4)
            out.append((f"esft {task} only, 4 seq/step, window 4, EP16, 80 slots", trace,
                        dict(num_gpus=16, num_slots=80, window=4, interval=1)))
        domains = sorted(npy.glob("olmoe_*_L0-7-15.npy"))
        if domains:
            trace = np.concatenate([np.repeat(np.load(f)[None], 6, axis=0) for f in domains])
            out.append((f"olmoe {len(domains)} domains x 6 steps, window 1, EP8, 72 slots", trace,
                        dict(num_gpus=8, num_slots=72, window=1, interval=1)))
    return out


def sweep(trace: np.ndarray, kw: dict, gains=GAINS) -> list[dict]:
    rows = []
    for g in gains:
        res = simulate(trace, policies=("default",), min_gain=g, oracle=False, **kw)
        sm = res.policies["default"].summary()
        r = res.policies["default"].rebalances
        rows.append({"min_gain": g, "mean": sm["mean"], "p95": sm["p95"],
                     "rebalances": len(r), "skipped": sm["skipped"],
                     "slots_per_rebalance": float(np.mean([x.slots_changed for x in r])),
                     "slots_pct": sm["slots_changed_pct"], "none": res.none.summary()["mean"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", type=Path, default=None,
                    help="the shared/ folder with traces/npy (per-task ESFT, OLMoE)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    for label, trace, kw in settings(a.shared):
        rows = sweep(trace, kw)
        base = rows[0]
        print(f"\n{label} ({trace.shape[0]} steps; no balancer: {base['none']:.3f})\n")
        print("| min_gain | imbalance mean | vs 0 | p95 | skipped | slots written / rebalance | vs 0 |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            rel_moves = r["slots_per_rebalance"] / base["slots_per_rebalance"] if base["slots_per_rebalance"] else 1.0
            print(f"| {r['min_gain']:g} | {r['mean']:.4f} | {100 * (r['mean'] / base['mean'] - 1):+.2f}% | "
                  f"{r['p95']:.3f} | {r['skipped']}/{r['rebalances']} | {r['slots_per_rebalance']:.1f} "
                  f"({r['slots_pct']:.1f}%) | {rel_moves:.2f} |")
        sys.stdout.flush()
    print(f"\n{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
