"""Issue 29, 2026-12-05 (sixth session): the plans made with the heavy-replica check
(`moves.HEAVY_ROWS`; `.devplans/heavy`) against those made before it (`.devplans/all`),
forecast on the GEMMs the H100 timed that day and the day before (../2026-12-05-issue29-h100/*/rows.tgz).

For every configuration whose default plans differ, the GEMMs of an H100 row of the same
configuration (else of the same model and preset: Qwen3-235B steady EP 8 from s6-r1,
DeepSeek-V3 steady EP 8 from c16) are fitted by `diag/issue29_heavy_fit.HeavyFit` on
`gpu_cost.FEATURES` ("features") and on those plus the largest group ("+ largest"), and
both plan sets are scored on both fits (expected counts). "measured": the H100 row of the
older plans, where there is one. Run from the repository root (a few minutes):

    python benchmarks/results/2026-12-05-issue29-heavy/forecast.py > benchmarks/results/2026-12-05-issue29-heavy/forecast.md
"""
import json
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
H100 = HERE.parent / "2026-12-05-issue29-h100"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "diag"))

from issue29_heavy_fit import HeavyFit, gemms, scored  # noqa: E402

OLD, NEW = ROOT / ".devplans" / "all", ROOT / ".devplans" / "heavy"
FALLBACK = {"qwen3-235b": ("s6-r1", "ep8-prefill-steady-lognormal"), "deepseek-v3": ("c16", "ep8-prefill-steady-lognormal")}


def runs(tmp: Path) -> dict:
    """(model, trace, ep, preset) -> (call, row folder extracted under tmp, measured ratio)."""
    out = {}
    for tgz in sorted(H100.glob("*/rows.tgz")):
        call = tgz.parent.name
        with tarfile.open(tgz) as t:
            t.extractall(tmp / call, filter="data")
        for doc in sorted((tmp / call).glob("*/issue29.json")):
            d = json.loads(doc.read_text())
            if d.get("retime_rounds") or not (doc.parent / "gemms.json.gz").exists():
                continue
            for r in d["rows"]:
                out.setdefault((r["model"], r["trace"], r["ep"], r["preset"]), (call, doc.parent, r["default/deepseek"]))
    return out


def changed() -> list:
    """The configurations whose default plans differ between OLD and NEW (shift detection on)."""
    out = []
    for f in sorted(NEW.glob("*.npz")):
        a, b = np.load(f), np.load(OLD / f.name)
        if not np.array_equal(a["shift/default/p2l"], b["shift/default/p2l"]):
            model = "qwen3-235b" if f.name.startswith("qwen3-235b") else "deepseek-v3"
            rest = f.name[len(model) + 1:].split("-shift0")[0]  # trace-M{ep}-{preset}
            trace, m, preset = rest.rsplit("-", 2)
            out.append((model, trace, int(m[1:]), preset))
    return out


def score(model, trace, M, preset, plans, fit) -> float:
    r = scored(model, trace, M, preset, plans, fit)
    return r["default"].tokens_per_s / r["deepseek"].tokens_per_s


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        have = runs(Path(tmp))
        print("| model | trace | EP | preset | GEMMs of | measured, older plans | features: older -> new "
              "| + largest: older -> new |")
        print("|---|---|---|---|---|---|---|---|")
        low = []
        for model, trace, M, preset in changed():
            own = have.get((model, trace, M, preset))
            if own:
                call, folder, measured = own
            else:
                call, name = FALLBACK[model]
                folder, measured = Path(tmp) / call / name, None
            counts, seconds = gemms(folder, model, preset)
            cells = []
            for heavy in (False, True):
                fit = HeavyFit(counts, seconds, heavy)
                o, n = (score(model, trace, M, preset, p, fit) for p in (OLD, NEW))
                cells.append(f"{o:.4f} -> {n:.4f}")
                if heavy:
                    low.append((n, model, trace, M, preset))
            print(f"| {model} | {trace} | {M} | {preset} | {call}/{folder.name} | "
                  f"{'-' if measured is None else f'{measured:.4f}'} | {cells[0]} | {cells[1]} |", flush=True)
        low.sort()
        print(f"\n{len(low)} configurations; lowest on + largest, new plans: "
              + ", ".join(f"{r:.4f} {m} {t} EP {e} {p}" for r, m, t, e, p in low[:5]))


if __name__ == "__main__":
    main()
