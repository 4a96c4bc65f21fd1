"""Issue 29, target 1 on the GPU: every configuration of the analytic grid on the current
plans (`.devplans/heavy`: this folder's *.json, 132 configurations) and the `--cost gpu`
rows that were scored on those same plans.

Which plans a GPU row ran on is read from the row itself: the moves of a replay are a
property of its plans alone (the cost model prices them, it does not make them), so a row
is on the current plans when its default planner's moves per rebalance (and its moves in
all, where the row records them) equal the analytic grid's for that configuration. The
figures without shift detection are not compared (a few differ by a handful of moves
between cost models). Rows:

- H100 rows: `rows.log` of this folder and of ../2026-12-05-issue29-h100 (moves per
  rebalance to the one decimal the log prints, and moves in all);
- H200 rows: every `issue29.json` with `cost: gpu` under benchmarks/results/*issue29*
  (files and `rows.tgz` archives) outside those two folders.

Rows with Poisson counts are left out (another figure). A configuration's figure is its
latest row on the current plans, a row re-timed side by side (`--retime`) before single
timings (it takes out the GPU's drift over minutes). Run from the repository root:

    python benchmarks/results/2026-12-05-issue29-heavy/coverage.py > benchmarks/results/2026-12-05-issue29-heavy/coverage.md
"""
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
BEFORE = RESULTS / "2026-12-05-issue29-h100"
sys.path.insert(0, str(BEFORE))

import summary  # noqa: E402  (../2026-12-05-issue29-h100's)
from summary import LINE  # noqa: E402  (the row line of issue29_gpu_rows.sh)

TOTAL = re.compile(r"in all (\d+), no shift")
NOSHIFT_ORACLE = re.compile(r"default/oracle [\d.]+ \(no shift ([\d.]+)\)")
SHIFTING = ("esft", "olmoe", "shift-lognormal", "shift-zipf")  # target 2's traces and families


def grid() -> dict:
    """(model, trace, ep, preset) -> the analytic row on the current plans."""
    out = {}
    for f in sorted(HERE.glob("*.json")):
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and doc.get("cost") == "analytic":
            for r in doc["rows"]:
                out[(r["model"], r["trace"], r["ep"], r["preset"])] = r
    return out


def h100_rows():
    """(order, where, key, default/deepseek, retimed, moves per rebalance, moves in all,
    (default/oracle, the same without shift detection)) of each H100 row, in the order the calls ran: c1 ... c16, s6-*, then gpu-h1, s7-* ... s11-*."""
    def order(folder: Path) -> tuple:
        m = re.match(r"([cs])(\d+)", folder.name)
        here = int(folder.parent == HERE)
        return (1, here, 0, 0, folder.name) if m is None else (1, here, int(m[1] == "s"), int(m[2]), folder.name)
    for folder in (BEFORE, HERE):
        for log in sorted(folder.glob("*/rows.log")):
            for line in log.read_text().splitlines():
                m = LINE.match(line)
                if m and m["dd"] and "poisson" not in m["name"]:
                    key = (m["model"], m["trace"], int(m["ep"]), m["preset"])
                    total, nso = TOTAL.search(line), NOSHIFT_ORACLE.search(line)
                    yield (order(log.parent), f"H100 {log.parent.name}", key, float(m["dd"]), "retime" in m["name"],
                           float(m["mv"]), int(total[1]) if total else None,
                           (float(m["do"]), float(nso[1]) if nso else None))


def h200_rows():
    """The same for each row of an H200 `issue29.json` (ordered by its date)."""
    for f, d in summary.gpu_docs((HERE, BEFORE)):
        if d.get("counts", "expected") != "expected":
            continue
        for r in d.get("rows", []):
            if "moves_per_rebalance" in r and "default/deepseek" in r:
                key = (r["model"], r["trace"], r["ep"], r["preset"])
                yield ((0, d.get("date") or "", str(f)), f"H200 {f.relative_to(RESULTS)}", key, r["default/deepseek"],
                       bool(d.get("retime_rounds")), r["moves_per_rebalance"], r.get("moves_total"),
                       (r.get("default/oracle"), r.get("noshift/oracle")))


def same_plans(row: dict, per_rebalance: float, total, decimals: int) -> bool:
    """Whether a GPU row's moves are the analytic row's (to the decimals the GPU row gives)."""
    if round(row["moves_per_rebalance"], decimals) != round(per_rebalance, decimals):
        return False
    return total is None or int(row["moves_total"]) == int(total)


def sort_rows(an: dict) -> tuple[dict, dict]:
    """key -> [(order, where, default/deepseek, retimed, oracle figures)] of its GPU rows on
    the current plans, and key -> how many of its rows are on other plans."""
    on, other = {}, {}
    for order, where, key, dd, retimed, mv, total, oracle in list(h200_rows()) + list(h100_rows()):
        if key not in an:
            continue
        if same_plans(an[key], mv, total, 1 if where.startswith("H100") else 6):
            on.setdefault(key, []).append((order, where, dd, retimed, oracle))
        else:
            other[key] = other.get(key, 0) + 1
    return on, other


def uncovered() -> list:
    """The configurations of the grid without a GPU row on the current plans (remaining.py
    lists them, whatever its own rules say)."""
    an = grid()
    on, _ = sort_rows(an)
    return sorted(k for k in an if k not in on)


def main() -> None:
    an = grid()
    on, other = sort_rows(an)
    print("| model | trace | EP | preset | analytic | GPU rows on the current plans (r: re-timed) | other plans | figure |")
    print("|---|---|---|---|---|---|---|---|")
    figures, missing, h200, oracles = {}, [], 0, {}
    for key in sorted(an, key=lambda k: (k[0], k[3], k[1], k[2])):
        got = sorted(on.get(key, []))
        cells = "<br>".join(f"{w}: {dd:.4f}{' r' if r else ''}" for _, w, dd, r, _ in got) or "none"
        if got:
            pick = ([g for g in got if g[3]] or got)[-1]
            figures[key] = pick[2]
            oracles[key] = pick[4]
            h200 += pick[1].startswith("H200")
        else:
            missing.append(key)
        fig = f"{figures[key]:.4f}" if key in figures else "-"
        print(f"| {' | '.join(map(str, key))} | {an[key]['default/deepseek']:.4f} | {cells} | {other.get(key, 0)} | {fig} |")
    print(f"\n{len(an)} configurations; with a GPU row on the current plans: {len(figures)} "
          f"(the figure from an H100 in {len(figures) - h200}, an H200 in {h200}); without: {len(missing)}"
          + (f" ({', '.join(' '.join(map(str, k)) for k in missing)})" if missing else ""))
    if figures:
        low = min(figures, key=figures.get)
        below = sorted(k for k, v in figures.items() if v < 1.0)
        print(f"below deepseek: {len(below)}" + (f" ({', '.join(' '.join(map(str, k)) for k in below)})" if below else "")
              + f"; lowest {figures[low]:.4f} ({' '.join(map(str, low))})")


    target2(oracles)


def target2(oracles: dict) -> None:
    """Target 2 on the GPU: of each shifting configuration at EP 64-256, the share of the
    default-to-oracle gap without shift detection that shift detection closes."""
    closed = {}
    for key, (do, no) in oracles.items():
        if key[1] in SHIFTING and key[2] >= 64 and do is not None and no is not None and no < 1.0:
            closed[key] = (do - no) / (1.0 - no)
    if closed:
        low = min(closed, key=closed.get)
        vals = sorted(closed.values())
        print(f"target 2, {len(closed)} shifting configurations at EP 64-256 (their figure's row): gap to the oracle "
              f"closed by shift detection, min {closed[low]:.3f} ({' '.join(map(str, low))}), "
              f"median {vals[len(vals) // 2]:.3f}; below one half: {sum(v < 0.5 for v in vals)}")


if __name__ == "__main__":
    main()
