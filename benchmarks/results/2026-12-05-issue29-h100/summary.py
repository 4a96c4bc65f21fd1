"""Issue 29: the `--cost gpu` rows of 2026-12-05 (fifth session), run on one H100 from the
plans re-made after b8c0c2b (`.devplans/all`), next to what predicted them:

- analytic: the same configuration in the analytic grid of these plans
  (../2026-12-05-issue29-fresh-counts/*.json);
- fit: the forecast on an H200 GEMM fit (../2026-12-05-issue29-fresh-counts/forecast/schedule.md);
- earlier GPU: the latest figure recorded on an H200 before this session (older plans, any
  code version), with its date and file; `changed` marks the 26 configurations whose plans
  b8c0c2b changed (../2026-12-05-issue29-fresh-counts/summary.txt).

The calls: c1-c16, the fifth session's (2026-12-05); s6-r1 ... s6-r11, the sixth session's,
numbered as remaining.md then listed them (s6-r1b: s6-r1's EP 8 and 16 rows again).

    python benchmarks/results/2026-12-05-issue29-h100/summary.py > benchmarks/results/2026-12-05-issue29-h100/summary.md
"""
import json
import re
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
GRID = RESULTS / "2026-12-05-issue29-fresh-counts"
LINE = re.compile(r"^(?P<name>\S+) rc (?P<rc>\d+) wall (?P<wall>\d+) s (?:(?P<model>\S+)\s+(?P<trace>\S+)\s+EP\s+(?P<ep>\d+) "
                  r"(?P<preset>\S+)\s+default/deepseek (?P<dd>[\d.]+) .*?default/oracle (?P<do>[\d.]+) .*?"
                  r"moves/rebalance (?P<mv>[\d.]+)|\(no row scored\))")


def measured():
    for log in sorted(HERE.glob("*/rows.log")):
        for line in log.read_text().splitlines():
            m = LINE.match(line)
            if m:
                yield log.parent.name, m


def analytic():
    out = {}
    for f in GRID.glob("*.json"):
        for r in json.loads(f.read_text())["rows"]:
            out[(r["model"], r["trace"], r["ep"], r["preset"])] = r["default/deepseek"]
    return out


def schedule():
    """Each row of the forecast's schedule: (model, ep, preset, trace, flags (issue29.py
    options other than --model), forecast seconds on the host, ratio on the fit)."""
    for line in (GRID / "forecast" / "schedule.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 7 and re.match(r"\d+:", cells[0]):
            ep, preset, trace, *extra = cells[0].split(":")
            model = "qwen3-235b" if "--model=qwen3-235b" in extra else "deepseek-v3"
            flags = [e for e in extra if not e.startswith("--model=")]
            yield model, ep, preset, trace, flags, float(cells[4]), float(cells[5])


def forecast():
    """(model, trace, ep, preset) -> the fit's ratio, for the schedule's rows without re-timing."""
    return {(model, trace, int(ep), preset): ratio for model, ep, preset, trace, flags, _, ratio in schedule()
            if not any(f.startswith("--retime") for f in flags)}


def gpu_docs(skip=()):
    """(file, doc) of every `cost: gpu` issue29.json under benchmarks/results/*issue29*
    (files, and those inside `rows.tgz` archives), outside the folders `skip`."""
    for f in sorted(RESULTS.glob("*issue29*/**/*")):
        if any(s in f.parents for s in skip):
            continue
        try:
            if f.suffix == ".json":
                docs = [json.loads(f.read_text())]
            elif f.name.endswith(".tgz"):
                with tarfile.open(f) as t:
                    docs = [json.load(t.extractfile(m)) for m in t.getmembers() if m.name.endswith("issue29.json")]
            else:
                continue
        except (OSError, ValueError, tarfile.TarError):
            continue
        for d in docs:
            if isinstance(d, dict) and d.get("cost") == "gpu":
                yield f, d


def earlier_gpu():
    """(model, trace, ep, preset) -> (date, ratio, file) of the latest H200 figure (the H100
    rows of this folder and of the later ../2026-12-05-issue29-heavy left out)."""
    out = {}
    for f, d in gpu_docs((HERE, RESULTS / "2026-12-05-issue29-heavy")):
        for r in d.get("rows", []):
            if all(k in r for k in ("model", "trace", "ep", "preset", "default/deepseek")):
                key = (r["model"], r["trace"], r["ep"], r["preset"])
                if key not in out or (d.get("date") or "") >= out[key][0]:
                    out[key] = (d.get("date") or "?", r["default/deepseek"], str(f.relative_to(RESULTS)))
    return out


def changed():
    out = set()
    for line in (GRID / "summary.txt").read_text().splitlines():
        m = re.match(r"\s+(\S+)\s+(\S+)\s+EP\s+(\d+) (decode|prefill)\s+[\d.]+ -> [\d.]+;", line)
        if m:
            out.add((m[1], m[2], int(m[3]), m[4]))
    return out


def main():
    an, fc, old, ch = analytic(), forecast(), earlier_gpu(), changed()
    print("| call | row | counts | H100 default/deepseek | default/oracle | moves/rebalance | analytic | H200 fit forecast "
          "| earlier GPU (H200, older plans) | plans changed by b8c0c2b |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    below, n = [], 0
    for call, m in measured():
        if m["dd"] is None:
            print(f"| {call} | {m['name']} | | not scored (rc {m['rc']}, {m['wall']} s) | | | | | | |")
            continue
        key = (m["model"], m["trace"], int(m["ep"]), m["preset"])
        counts = "poisson" if "poisson" in m["name"] else "expected"
        dd = float(m["dd"])
        n += 1
        if dd < 1.0:
            below.append(m["name"])
        e = old.get(key)
        print(f"| {call} | {key[0]} {key[1]} EP {key[2]} {key[3]} | {counts} | {dd:.4f} | {float(m['do']):.3f} | "
              f"{float(m['mv']):.1f} | {an.get(key, float('nan')):.4f} | "
              f"{fc[key] if key in fc else '-'} | {f'{e[1]:.4f} ({e[0]}, {e[2]})' if e else '-'} | "
              f"{'yes' if key in ch else ''} |")
    print(f"\n{n} rows scored; below deepseek: {', '.join(below) or 'none'}")


if __name__ == "__main__":
    main()
