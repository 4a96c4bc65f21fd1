"""Issue 29, target 1 on more members of the synthetic families (planner of 38f1453, the
drift trend on): six more draws of the four families on the DeepSeek-V3 shape (family
seeds 33-38, expected counts and one Poisson seed each), and the four families drawn with
128 experts on the Qwen3-235B shape (seed 29, expected and Poisson counts). Per row: default/deepseek in tokens/s, analytic cost.
python benchmarks/results/2026-12-05-issue29-draws/summary.py"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(path):
    return json.loads(path.read_text())["rows"]


def low(rs):
    r = min(rs, key=lambda r: r["default/deepseek"])
    return f"{r['default/deepseek']:.4f} ({r['model']} {r['trace']} EP {r['ep']} {r['preset']})"


groups = [("expected counts, draw " + p.stem[1:], rows(p)) for p in sorted(HERE.glob("f3*.json"))]
groups += [("Poisson counts (seed 1), draw " + p.stem[2:], rows(p)) for p in sorted(HERE.glob("pf3*.json"))]
groups += [("Qwen3-235B (families drawn with 128 experts), draw 29", rows(p)) for p in sorted(HERE.glob("qwen3.json"))]
groups += [("Qwen3-235B, Poisson counts (seed 1), draw 29", rows(p)) for p in sorted(HERE.glob("pqwen3.json"))]
total = below = 0
for name, rs in groups:
    b = sum(r["default/deepseek"] < 1 for r in rs)
    total, below = total + len(rs), below + b
    print(f"{name}: {len(rs)} rows, {b} below deepseek, lowest {low(rs)}")
print(f"all: {total} rows, {below} below deepseek")
every = [r for _, rs in groups for r in rs]
for fam in ("shift-zipf", "shift-lognormal", "steady-lognormal", "drift"):
    print(f"  {fam:17s} lowest {low([r for r in every if r['trace'] == fam])}")
closed = sorted((r["default/oracle"] - r["noshift/oracle"]) / (1 - r["noshift/oracle"]) for r in every
                if r["trace"] in ("shift-zipf", "shift-lognormal") and r["ep"] >= 64 and r["noshift/oracle"] < 1)
print(f"target 2 (shift families, EP >= 64): gap to the oracle closed, lowest {closed[0]:.3f}, "
      f"median {closed[len(closed) // 2]:.3f}, {len(closed)} rows")
worse = [(r["model"], r["ep"], r["preset"]) for r in every
         if r["trace"] == "steady-lognormal" and r["moves_total"] > r["moves_total_noshift"]]
print(f"steady rows moving more in all with shift detection than without: {len(worse)} {worse}")
