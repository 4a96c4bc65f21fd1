"""The tables of benchmarks/README.md (issue 29) from `benchmarks/issue29.py` outputs.

    python benchmarks/issue29_tables.py DIR [DIR ...]     # every issue29.json (any *.json with rows) under them

Rows of one configuration found more than once (runs with other Poisson seeds) are averaged.
Prints, per model: tokens/s default/deepseek, default/oracle and the share of the
default-to-oracle gap that shift detection closes, (d - n) / (1 - n) with n the same
planner without it (`--shift-threshold 0`); then moves per rebalance and early
rebalances. Markdown, one column per EP size.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


RATIOS = ("default/deepseek", "noshift/deepseek", "default/oracle", "noshift/oracle",
          "moves_per_rebalance", "moves_per_rebalance_noshift", "early_rebalances", "shifted_plans")


def rows(dirs) -> list[dict]:
    """Every row under `dirs`; rows of one configuration from several runs (seeds of
    Poisson counts) are averaged, figure by figure."""
    seen: dict[tuple, list[dict]] = {}
    for d in dirs:
        for f in sorted(Path(d).rglob("*.json")):  # issue29.json, or copies renamed per run
            for r in json.loads(f.read_text()).get("rows", []):
                seen.setdefault((r["model"], r["trace"], r["ep"], r["preset"]), []).append(r)
    return [dict(rs[0], runs=len(rs), **{k: sum(r[k] for r in rs) / len(rs) for k in RATIOS})
            for rs in seen.values()]


def closed(r: dict) -> float | None:
    """Share of the no-shift planner's gap to the oracle that shift detection closes."""
    n, d = r["noshift/oracle"], r["default/oracle"]
    return None if n >= 0.99 else (d - n) / (1 - n)  # below 1% there is no gap to speak of


def tables(rs: list[dict]) -> str:
    eps = sorted({r["ep"] for r in rs})
    head = "| model | trace | preset | " + " | ".join(f"EP {e}" for e in eps) + " |"
    rule = "|---|---|---|" + "---|" * len(eps)
    keys = sorted({(r["model"], r["trace"], r["preset"]) for r in rs})
    at = {(r["model"], r["trace"], r["preset"], r["ep"]): r for r in rs}
    out = []

    def cell(r, fmt) -> str:
        return "-" if r is None else fmt(r)

    for title, fmt in (
            ("default / deepseek (without shift detection)",
             lambda r: f"{r['default/deepseek']:.3f} ({r['noshift/deepseek']:.3f})"),
            ("default / oracle (without shift detection; gap closed)",
             lambda r: f"{r['default/oracle']:.3f} ({r['noshift/oracle']:.3f}; "
                       + ("-" if closed(r) is None else f"{100 * closed(r):+.0f}%") + ")")):
        out += [f"{title}:", "", head, rule]
        for k in keys:
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cell(at.get((*k, e)), fmt) for e in eps) + " |")
        out.append("")
    out += ["moves per rebalance, decode (without shift detection); early rebalances / shifted plans:", "",
            head.replace(" preset |", ""), rule[:-4]]
    for m, t in sorted({(r["model"], r["trace"]) for r in rs}):
        out.append(f"| {m} | {t} | " + " | ".join(cell(at.get((m, t, "decode", e)), lambda r: (
            f"{r['moves_per_rebalance']:.0f} ({r['moves_per_rebalance_noshift']:.0f}); "
            f"{r['early_rebalances']:g}/{r['shifted_plans']:g}")) for e in eps) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(tables(rows(sys.argv[1:])))
