"""Issue 29: the analytic grid scored again with a roofline that reads a slot's weights once
per 128-row tile, as the H200 fits say a grouped GEMM does.

`AnalyticCost` (what `--cost analytic` is) counts a slot's weights once when it gets any
token. The H200 fits of `--cost gpu` runs price each 128-row tile of a slot (DeepSeek-V3
decode 25.7 µs, Qwen3-235B 11.2 µs) and a token at nothing: a slot with 129 tokens reads its
weights twice. `TileRoofline` is `AnalyticCost` with the weight bytes of
ceil(tokens / 128) reads per slot. The plans are the cached ones (`issue29.py --plan-only`):
only the scoring changes. Prints default/deepseek both ways, per configuration.

    python benchmarks/diag/issue29_tile_roofline.py --plans .devplans/all --shared .devshared/traces/npy \\
        [--models qwen3-235b --ep 8,16 --presets decode --traces steady-lognormal]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import issue29  # noqa: E402
from eplb.core.cost_model import AnalyticCost  # noqa: E402

TILE = 128


@dataclass(frozen=True)
class TileRoofline(AnalyticCost):
    """`AnalyticCost` whose weight bytes are one read per `TILE` rows of each slot."""

    def weight_reads(self, counts: np.ndarray) -> np.ndarray:  # [L, M, S] -> [L, M]
        return np.ceil(counts / TILE).sum(-1)


def score(cost, eps, models, traces, presets, plans: Path) -> dict:
    """(model, trace, EP, preset) -> default/deepseek of the cached plans under `cost`."""
    real = issue29.make_cost
    issue29.make_cost = lambda *args, **kw: cost
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            doc = issue29.run("analytic", Path("/tmp/issue29-tile-roofline"), 0.05, eps, models, traces, plans,
                              presets=presets)
    finally:
        issue29.make_cost = real
    return {(r["model"], r["trace"], r["ep"], r["preset"]): r["default/deepseek"] for r in doc["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", type=Path, required=True)
    ap.add_argument("--shared", type=Path, default=issue29.SHARED)
    ap.add_argument("--ep", default=",".join(map(str, issue29.EP_SIZES)))
    ap.add_argument("--models", default="deepseek-v3,qwen3-235b")
    ap.add_argument("--traces", default="esft,olmoe,shift-zipf,shift-lognormal,steady-lognormal,drift")
    ap.add_argument("--presets", default="decode,prefill")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    args = ([int(x) for x in a.ep.split(",")], a.models.split(","), a.traces.split(","),
            tuple(a.presets.split(",")), a.plans)
    plain, tiles = score(AnalyticCost(), *args), score(TileRoofline(), *args)
    print("| model | trace | EP | preset | default/deepseek, roofline | with a weight read per 128-row tile |")
    print("|---|---|---|---|---|---|")
    for k in plain:
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {plain[k]:.4f} | {tiles[k]:.4f} |", flush=True)
    low = {k: v for k, v in tiles.items() if v < 1.0}
    print(f"\n{len(plain)} configurations; below 1.000 with tiles: {len(low)}"
          + "".join(f"\n  {' '.join(map(str, k))}: {v:.4f} (roofline {plain[k]:.4f})" for k, v in low.items()))
    if a.json:
        a.json.write_text(json.dumps([{"config": list(k), "roofline": plain[k], "tiles": tiles[k]} for k in plain]))


if __name__ == "__main__":
    main()
