"""Issue 29: the GPU rows to run on the plans of the heavy-replica check (`.devplans/heavy`),
packed into device calls as ../2026-12-05-issue29-h100/remaining.py packs them.

Rows: those still to run before the check (../2026-12-05-issue29-h100/remaining.py), and
every configuration whose default plans the check changed (forecast.md) that has an H100
row on the older plans: it runs again on the new ones. Limits: as there, or 1.5 x the
wall time of the H100 row + 30 s. Order: the forecast on the H100 fit with the largest
group (forecast.md), else the ratio the older list gave. The configurations the check did
not change have the same default plans in both folders: their H100 rows stand. Rows
already scored on these plans (`gpu-h1`, `s7-*` ... `s11-*`: a row with options counts
only with the same options) are left out; Qwen3-235B steady prefill at EP 16 and 8 is
listed once more with `--retime=5`. Since 2026-12-06 (tenth): also the changed
configurations with no H100 row on the older plans (`missing`). Since 2026-12-06
(eleventh), where 24 more were found and run: after the calls, every configuration of the
grid that coverage.py finds without a GPU row on these plans and that no rule above lists
(named, without a limit until issue29_row_time.py forecasts it).

    python benchmarks/results/2026-12-05-issue29-heavy/remaining.py > benchmarks/results/2026-12-05-issue29-heavy/remaining.md
"""
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-05-issue29-h100"))

import coverage  # noqa: E402  (this folder's: HERE is on sys.path as the script's own folder)
import remaining as before  # noqa: E402
import summary  # noqa: E402


def forecast() -> dict:
    """(model, trace, ep, preset) -> the new plans' ratio on the fit with the largest group."""
    out = {}
    for line in (HERE / "forecast.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 8 and cells[2].isdigit():
            out[(cells[0], cells[1], int(cells[2]), cells[3])] = float(cells[7].split("->")[1])
    return out


def main() -> None:
    fc = forecast()
    rows = []
    for model, spec, limit, ratio in before.rows():
        ep, preset, trace = spec.split(":")[:3]
        rows.append((model, spec, limit, fc.get((model, trace, int(ep), preset), ratio)))
    listed = {(r[0], r[1].split(":")[2], int(r[1].split(":")[0]), r[1].split(":")[1]) for r in rows
              if r[1].count(":") == 3}  # rows without options (the retimed row is another row)
    walls = {}
    for _, m in summary.measured():
        if m["dd"] and not re.search(r"poisson|retime", m["name"]):
            key = (m["model"], m["trace"], int(m["ep"]), m["preset"])
            walls[key] = max(walls.get(key, 0), int(m["wall"]))
    for key, ratio in sorted(fc.items()):
        if key in walls and key not in listed:
            model, trace, ep, preset = key
            limit = round(1.5 * walls[key] + 30)
            rows.append((model, f"{ep}:{preset}:{trace}:{limit}", limit, ratio))
    # the configuration below deepseek on both of its rows, and EP 8 beside it: timed again
    # side by side in 5 rounds (`--retime`), which takes out the GPU's drift over minutes
    rows += [("qwen3-235b", "16:prefill:steady-lognormal:170:--retime=5", 170, fc[("qwen3-235b", "steady-lognormal", 16, "prefill")]),
             ("qwen3-235b", "8:prefill:steady-lognormal:150:--retime=5", 150, fc[("qwen3-235b", "steady-lognormal", 8, "prefill")])]
    rows += missing(fc, rows)
    done = scored()
    rows = [r for r in rows if (r[0], row_name(r[1])) not in done]
    before.print_calls(rows, plans=".devplans/heavy")
    # what the rules above miss: a configuration of the grid with no GPU row on these plans
    # (coverage.py); no limit until issue29_row_time.py forecasts its device time
    listed = {(r[0], r[1].split(":")[2], int(r[1].split(":")[0]), r[1].split(":")[1]) for r in rows}
    gap = [k for k in coverage.uncovered() if k not in listed]
    if gap:
        print(f"\n# {len(gap)} more configurations have no GPU row on these plans (coverage.py); forecast "
              "their limits with benchmarks/diag/issue29_row_time.py, then run them:")
        for model, trace, ep, preset in gap:
            print(f"#   {model} {ep}:{preset}:{trace}")


def missing(fc: dict, rows: list) -> list:
    """The configurations the check changed (forecast.md) that no row above lists: their
    only GPU rows are on the older plans (an H200's, before the H100 rows), so they run on
    the new ones too. Limits: 1.5 x the forecast of `missing-forecast.json` + 30 s, made by

        python benchmarks/diag/issue29_row_time.py --plans .devplans/heavy --shared .devshared/traces/npy \\
            "32:prefill:steady-lognormal:--retime=5" 16:prefill:esft ... \\
            --json benchmarks/results/2026-12-05-issue29-heavy/missing-forecast.json

    Steady prefill (forecast 1.0019 at EP 32) is timed side by side in 5 rounds
    (`--retime=5`), as at EP 8, where one timing moved by 0.2-0.3% from run to run."""
    listed = {(r[0], r[1].split(":")[2], int(r[1].split(":")[0]), r[1].split(":")[1]) for r in rows}
    forecast_s = {}
    for r in json.loads((HERE / "missing-forecast.json").read_text())["rows"]:
        ep, preset, trace, *extra = r["spec"].split(":")
        forecast_s[(r["model"], trace, int(ep), preset)] = (r["forecast_s"], extra)
    out = []
    for key, ratio in sorted(fc.items()):
        if key in listed:
            continue
        if key not in forecast_s:
            raise SystemExit(f"missing-forecast.json has no forecast for {key}: run issue29_row_time.py for it")
        model, trace, ep, preset = key
        seconds, extra = forecast_s[key]
        limit = round(1.5 * seconds + 30)
        out.append((model, ":".join([str(ep), preset, trace, str(limit)] + extra), limit, ratio))
    return out


def row_name(spec: str) -> str:
    """The folder (and rows.log) name `issue29_gpu_rows.sh` gives the row of SPEC
    EP:PRESET:TRACE[:SECONDS[:EXTRA]] (EXTRA's characters other than letters, digits, '='
    and '.' become '_')."""
    ep, preset, trace, *rest = spec.split(":")
    extra = rest[1] if len(rest) > 1 else ""
    return f"ep{ep}-{preset}-{trace}" + (f"-{re.sub(r'[^a-zA-Z0-9=.]', '_', extra)}" if extra else "")


LINE = re.compile(r"^(\S+) rc 0 .*? (qwen3-235b|deepseek-v3) .*default/deepseek \d")


def scored() -> set:
    """(model, row name) of the rows scored on these plans: every `rows.log` line with a
    ratio of gpu-h1 and of the later sessions' calls (s7-* ... s11-*)."""
    out = set()
    for log in [HERE / "gpu-h1" / "rows.log", *sorted(HERE.glob("s[0-9]*-*/rows.log"))]:
        for line in log.read_text().splitlines():
            if m := LINE.match(line):
                out.add((m.group(2), m.group(1)))
    return out


if __name__ == "__main__":
    main()
