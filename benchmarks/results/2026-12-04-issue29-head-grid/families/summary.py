"""Summary of the synthetic families drawn with other seeds (f30, f31, f32 here; f29 is
the grid's own draw in the folder above): target 1 (default/deepseek >= 1), target 2 (the
share of the no-shift gap to the oracle closed on the shifting families at EP 64-256) and
the steady family's moves with shift detection (and its steady windows) and without.
python benchmarks/results/2026-12-04-issue29-head-grid/families/summary.py"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
docs = {"f29": HERE.parent / "steady-lognormal_shift-lognormal_drift.json"}
for f in sorted(HERE.glob("f*.json")):
    docs[f.stem] = f
rows = []
for seed, f in docs.items():
    for r in json.loads(f.read_text())["rows"]:
        if r["model"] == "deepseek-v3" and r["trace"] in ("shift-zipf", "shift-lognormal", "steady-lognormal", "drift"):
            rows.append((seed, r))
rows += [("f29", r) for r in json.loads((HERE.parent / "esft_olmoe_shift-zipf.json").read_text())["rows"]
         if r["trace"] == "shift-zipf"]
print(f"{len(rows)} rows over draws {sorted({s for s, _ in rows})}")
below = [(s, r["trace"], r["ep"], r["preset"], round(r["default/deepseek"], 4)) for s, r in rows
         if r["default/deepseek"] < 1.0]
print("below deepseek:", below)
for fam in ("shift-zipf", "shift-lognormal", "steady-lognormal", "drift"):
    v = sorted((r["default/deepseek"], s, r["ep"], r["preset"]) for s, r in rows if r["trace"] == fam)
    print(f"  {fam:17s} lowest {v[0][0]:.4f} ({v[0][1]} EP {v[0][2]} {v[0][3]}), median {v[len(v) // 2][0]:.4f}, {len(v)} rows")
closed = [((r["default/oracle"] - r["noshift/oracle"]) / (1 - r["noshift/oracle"]), s, r["trace"], r["ep"], r["preset"])
          for s, r in rows if r["trace"] in ("shift-zipf", "shift-lognormal") and r["ep"] >= 64]
closed.sort()
print(f"target 2, shifting families at EP 64-256: gap closed lowest {closed[0][0]:.3f} {closed[0][1:]}, "
      f"median {closed[len(closed) // 2][0]:.3f}, {len(closed)} rows")
print("steady-lognormal: moves per rebalance that moved / in all (first rebalance included), shift detection vs none")
worse = []
for s, r in sorted(rows, key=lambda x: (x[0], x[1]["ep"], x[1]["preset"])):
    if r["trace"] != "steady-lognormal":
        continue
    tot = "" if "moves_total" not in r else f"; in all {r['moves_total']:.0f} vs {r['moves_total_noshift']:.0f}"
    print(f"  {s} EP {r['ep']:3d} {r['preset']:7s} {r['moves_per_rebalance']:.1f} vs {r['moves_per_rebalance_noshift']:.1f}{tot}")
    if "moves_total" in r and r["moves_total"] > r["moves_total_noshift"]:
        worse.append((s, r["ep"], r["preset"]))
print("steady rows moving more in all with shift detection:", worse)
