"""The issue 29 grid with the drift trend (`EplbConfig.drift_trend`, on by default) against
the same grid before it (the folder above, 8b7abc9's planner): target 1 on the grid, its
Poisson seeds and the families' other draws; which rows the trend changed; target 2 and
the steady family's moves on every draw.
python benchmarks/results/2026-12-04-issue29-head-grid/trend-grid/summary.py"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEFORE = HERE.parent
GRID = ("esft_olmoe_shift-zipf.json", "steady-lognormal_shift-lognormal_drift.json")
FAMILIES = ("shift-zipf", "shift-lognormal", "steady-lognormal", "drift")


def rows(paths, draw="f29"):
    out = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["rows"]:
            out[draw, r["model"], r["trace"], r["ep"], r["preset"]] = r
    return out


now = rows(HERE / g for g in GRID)
was = rows(BEFORE / g for g in GRID)
for f in sorted((HERE / "families").glob("f*.json")):
    now.update(rows([f], f.stem))
    was.update(rows([BEFORE / "families" / f.name], f.stem))
grid = [k for k in now if k[0] == "f29"]
print(f"grid: {len(grid)} configurations; families' other draws: {len(now) - len(grid)} rows")
below = sorted((round(r["default/deepseek"], 4), k) for k, r in now.items() if r["default/deepseek"] < 1)
print("below deepseek, with the trend:", below)
print("below deepseek, before it:", sorted((round(r["default/deepseek"], 4), k) for k, r in was.items()
                                          if r["default/deepseek"] < 1))
for p in sorted((HERE / "poisson").glob("s*.json")):
    rs = json.loads(p.read_text())["rows"]
    low = min(rs, key=lambda r: r["default/deepseek"])
    print(f"Poisson {p.stem}: {len(rs)} rows, {sum(r['default/deepseek'] < 1 for r in rs)} below deepseek, lowest "
          f"{low['default/deepseek']:.4f} ({low['trace']} EP {low['ep']} {low['preset']})")
changed = [k for k in now if now[k]["default/deepseek"] != was[k]["default/deepseek"]
           or now[k]["moves_total"] != was[k]["moves_total"]]
print(f"rows the trend changed: {len(changed)}, all of them {sorted({k[2] for k in changed})}")
print("| draw | EP | preset | default/deepseek before -> with the trend | moves in all before -> with |")
print("|---|---|---|---|---|")
for k in sorted(changed, key=lambda k: (k[0], k[3], k[4])):
    a, b = was[k], now[k]
    print(f"| {k[0]} | {k[3]} | {k[4]} | {a['default/deepseek']:.4f} -> {b['default/deepseek']:.4f} | "
          f"{a['moves_total']:.0f} -> {b['moves_total']:.0f} |")
for fam in FAMILIES + ("esft", "olmoe"):
    v = sorted((r["default/deepseek"], k) for k, r in now.items() if k[2] == fam)
    print(f"  {fam:17s} lowest {v[0][0]:.4f} {v[0][1]}, {len(v)} rows")
closed = sorted(((r["default/oracle"] - r["noshift/oracle"]) / (1 - r["noshift/oracle"]), k) for k, r in now.items()
                if k[2] in ("esft", "olmoe", "shift-zipf", "shift-lognormal") and k[3] >= 64)
print(f"target 2 (shifting loads, EP 64-256): gap closed lowest {closed[0][0]:.3f} {closed[0][1]}, "
      f"median {closed[len(closed) // 2][0]:.3f}, {len(closed)} rows")
worse = [k for k, r in now.items() if k[2] == "steady-lognormal" and r["moves_total"] > r["moves_total_noshift"]]
print("steady rows moving more in all with shift detection than without:", worse)
