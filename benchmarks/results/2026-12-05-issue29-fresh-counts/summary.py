"""This folder's analytic grid (the planner after the catch-up may replace a start-up
layer, `.devplans/new`) against the same grid planned before that change (`before/`, the
plans of `.devplans/all`, scored with the same code): targets 1 and 2, moves on the steady
family, and every row that changed. Run from the repository root:
python benchmarks/results/2026-12-05-issue29-fresh-counts/summary.py"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIFTING = ("esft", "olmoe", "shift-zipf", "shift-lognormal")


def rows(files):
    out = {}
    for f in files:
        for r in json.load(open(f))["rows"]:
            out[r["model"], r["trace"], r["ep"], r["preset"]] = r
    return out


def closed(r):  # the share of the no-shift gap to the oracle that shift detection closes
    return (r["default/oracle"] - r["noshift/oracle"]) / (1 - r["noshift/oracle"])


def compare(here: Path, before: Path) -> None:
    """Print the grid of `here` against that of `before` (each: *.json, poisson/s0-2.json)."""
    new, old = rows(sorted(here.glob("*.json"))), rows(sorted(before.glob("*.json")))
    runs = [("expected counts", new, old)] + [(f"Poisson seed {k}", rows([here / "poisson" / f"s{k}.json"]),
                                               rows([before / "poisson" / f"s{k}.json"])) for k in range(3)]
    for label, n, o in runs:
        below = sorted((round(r["default/deepseek"], 4), k) for k, r in n.items() if r["default/deepseek"] < 1.0)
        lo = min(n.items(), key=lambda kv: kv[1]["default/deepseek"])
        lob = min(o.items(), key=lambda kv: kv[1]["default/deepseek"])
        print(f"{label}: {len(n)} rows, below deepseek: {below or 'none'}; lowest {lo[1]['default/deepseek']:.4f} {lo[0]} "
              f"(before: {lob[1]['default/deepseek']:.4f} {lob[0]})")
    per = {}
    for k, r in new.items():
        per.setdefault(k[1], []).append((r["default/deepseek"], k))
    print("expected counts, lowest per trace (before):")
    for t, v in sorted(per.items()):
        v.sort()
        print(f"  {t:16s} {v[0][0]:.4f} {v[0][1][0]} EP {v[0][1][2]} {v[0][1][3]} "
              f"({min(old[k]['default/deepseek'] for _, k in v):.4f})")
    cl = sorted(closed(r) for k, r in new.items() if k[2] >= 64 and k[1] in SHIFTING)
    clb = sorted(closed(r) for k, r in old.items() if k[2] >= 64 and k[1] in SHIFTING)
    print(f"target 2, {len(cl)} shifting rows at EP 64-256: gap to the oracle closed, min {cl[0]:.3f} median "
          f"{cl[len(cl) // 2]:.3f} (before {clb[0]:.3f}, {clb[len(clb) // 2]:.3f})")
    print("steady family, moves per rebalance with shift detection (without), before -> now:")
    for k in sorted(new):
        if k[1] == "steady-lognormal":
            a, b = old[k], new[k]
            print(f"  {k[0]:12s} EP {k[2]:3d} {k[3]:7s} {a['moves_per_rebalance']:.1f} ({a['moves_per_rebalance_noshift']:.1f})"
                  f" -> {b['moves_per_rebalance']:.1f} ({b['moves_per_rebalance_noshift']:.1f})")
    changed = [k for k in sorted(new) if abs(new[k]["default/deepseek"] - old[k]["default/deepseek"]) > 5e-5
               or abs(new[k]["moves_per_rebalance"] - old[k]["moves_per_rebalance"]) > 0.05]
    print(f"rows that changed: {len(changed)} of {len(new)} (default/deepseek; moves per rebalance), before -> now:")
    for k in changed:
        a, b = old[k], new[k]
        print(f"  {k[0]:12s} {k[1]:16s} EP {k[2]:3d} {k[3]:7s} {a['default/deepseek']:.4f} -> {b['default/deepseek']:.4f}; "
              f"{a['moves_per_rebalance']:.1f} -> {b['moves_per_rebalance']:.1f}")


if __name__ == "__main__":
    compare(HERE, HERE / "before")
