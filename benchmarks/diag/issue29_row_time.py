"""Issue 29: how long a `--cost gpu` row will hold the GPU, forecast on a CPU.

A row of `benchmarks/issue29_gpu_rows.sh` that runs past its time limit returns no ratio,
and the device time it used is lost (four prefill rows on 2026-12-05). This script replays
a row here with `GpuGemmCost`'s own machinery (calibration grid, estimate, picked GPUs,
cache, refits, `--retime` rounds), but every GEMM's time is read from a fit measured on an
H200 (`issue29.json`'s `gpu.<model>.<preset>.fit`, `gpu_cost.fitted_seconds`) and nothing
runs: the expert weights live on the `meta` device. Each GEMM the row would time costs
device time as `GpuGemmCost._time_graph` spends it, t x `gpu_cost.timing_runs(t, reps)`
(a warm-up and `reps` queued runs; up to 2 ms, also a graph of `inner` runs replayed
1 + `reps` times), plus `--per-gemm` seconds of fixed cost (graph capture, synchronisation, Python). The CPU
part of the row (replay, plans read, imports) is timed here and multiplied by
`--cpu-factor` (the H200 host's cores were 1.5-2.4x slower than this VM's in the planner
timings of 2026-12-05). The forecast is for scheduling rows, not a result: the ratios this
replay prints are those of the fit (`diag/issue29_fitted_gpu.py` breaks them down).

    python benchmarks/diag/issue29_row_time.py --plans .devplans/all --shared ../shared/traces/npy \\
        8:prefill:shift-zipf 64:decode:esft ...      # EP:PRESET:TRACE[:--retime=R,--max-measured=K]
        [--calls 560]                                # and the issue29_gpu_rows.sh calls that run them

Fits: `--fit MODEL:PRESET=issue29.json` (repeatable); by default the H200 fits kept under
benchmarks/results (`DEFAULT_FITS`). A model and preset without a fit (Qwen3-235B prefill has
none) takes DeepSeek-V3's fit for that preset scaled per token by the expert sizes
(hidden x intermediate), launch unchanged, and says so.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

import issue29  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS  # noqa: E402
from eplb.ops.gpu_cost import FEATURES, GpuGemmCost, fitted_seconds, timing_runs  # noqa: E402

RESULTS = HERE.parent / "results"
# the H200 fits used unless --fit says otherwise: runs with many GEMMs (2,000-10,000)
DEFAULT_FITS = {
    ("deepseek-v3", "decode"): RESULTS / "2026-12-03-issue29-gpu-ep8-64/ep16/issue29.json",
    ("deepseek-v3", "prefill"): RESULTS / "2026-12-04-issue29-retime/ep128-256-prefill/issue29.json",
    ("qwen3-235b", "decode"): RESULTS / "2026-12-04-issue29-gpu/c6/qwen3-ep8/issue29.json",
}


def load_fit(path: Path, model: str, preset: str) -> np.ndarray:  # [F] seconds per feature
    fit = json.loads(Path(path).read_text())["gpu"][model][preset]["fit"]
    if fit is None:
        raise ValueError(f"{path}: no fit for {model} {preset} (fewer GEMMs than the fit needs)")
    return np.array([fit[k] for k in FEATURES])


def fit_for(model: str, preset: str, given: dict) -> tuple[np.ndarray, str]:
    """The fit for `model` and `preset` and where it came from (see the module docstring)."""
    if (model, preset) in given:
        return load_fit(given[(model, preset)], model, preset), str(given[(model, preset)])
    if (model, preset) in DEFAULT_FITS:
        f = DEFAULT_FITS[(model, preset)]
        return load_fit(f, model, preset), str(f.relative_to(RESULTS))
    base = given.get(("deepseek-v3", preset), DEFAULT_FITS[("deepseek-v3", preset)])
    coef = load_fit(base, "deepseek-v3", preset)
    a, b = MODEL_PRESETS[model], MODEL_PRESETS["deepseek-v3"]
    scaled = coef * (a.hidden * a.intermediate) / (b.hidden * b.intermediate)
    scaled[FEATURES.index("launch")] = coef[FEATURES.index("launch")]
    return scaled, f"deepseek-v3 {preset} fit scaled by expert size ({Path(base).name})"


class ForecastCost(GpuGemmCost):
    """`GpuGemmCost` with every GEMM's time taken from `coef` (no kernel runs, weights on the
    meta device), adding up the device seconds the real timing would spend (`device_s`)."""

    def __init__(self, *args, coef: np.ndarray, **kw) -> None:
        self.true_coef = np.asarray(coef, dtype=np.float64)
        self.device_s = 0.0
        self.timed = 0  # GEMM timings, calibration and re-timing rounds included
        super().__init__(*args, device="meta", **kw)

    def _fill_weights(self, seed: int) -> None:
        pass  # meta tensors hold no values

    def _tokens(self, n: int) -> torch.Tensor:  # [n, 0]: only its row count is read
        return torch.empty(n, 0)

    def _time(self, key: tuple[int, ...], reps: int | None = None) -> float:
        reps = self.reps if reps is None else reps
        t = float(fitted_seconds(np.asarray(key, dtype=np.float64), self.true_coef))
        self.device_s += t * timing_runs(t, reps)
        self.timed += 1
        return t


def forecast(spec: str, plans: Path, fits: dict) -> dict:
    """Replay one row (`issue29.run` with a `ForecastCost`); its GEMM count and times."""
    ep, preset, trace, *extra = spec.split(":")
    opts = dict(x.lstrip("-").split("=") for x in (extra[0].split(",") if extra else []))
    unknown = set(opts) - {"retime", "max-measured", "model", "counts"}
    if unknown:
        raise ValueError(f"{spec}: unknown options {sorted(unknown)} (known: --retime, --max-measured, --counts, --model)")
    model = opts.get("model", "deepseek-v3")
    issue29.RETIME[0] = int(opts.get("retime", 0))
    issue29.MEASURED[0] = int(opts.get("max-measured", 4))
    coef, source = fit_for(model, preset, fits)
    made: list[ForecastCost] = []

    def make_cost(kind, shape, max_slots, tokens, **gpu):
        made.append(ForecastCost(shape, max_slots, 4 * tokens * shape.top_k, coef=coef, **gpu))
        return made[-1]

    issue29.make_cost, real = make_cost, issue29.make_cost
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            doc = issue29.run("gpu", Path("/tmp/issue29-row-time") / spec.replace(":", "_"), 0.05,
                              [int(ep)], [model], [trace], plans, counts=opts.get("counts", "expected"),
                              presets=(preset,))
    finally:
        issue29.make_cost = real
    if not doc["rows"]:
        raise ValueError(f"{spec}: no row (plans missing from {plans}?):\n{log.getvalue()}")
    cost = made[0]
    return {"spec": spec, "model": model, "gemms": cost.runs, "timings": cost.timed,
            "device_s": cost.device_s, "cpu_s": time.perf_counter() - t0, "fit": source,
            "fit_ratio": doc["rows"][0]["default/deepseek"]}


def row_limit(forecast_s: float, margin: float = 1.5, startup_s: float = 30.0) -> int:
    """A row's time limit in issue29_gpu_rows.sh: the forecast with a margin (the forecast
    ran 0.5-1.0x of the rows' own scoring times on 2026-12-05) plus the process start-up."""
    return int(np.ceil(margin * forecast_s + startup_s))


def pack_calls(rows: list[dict], call_s: float) -> list[tuple[str, list[str]]]:
    """Group forecast rows, in their order, into device calls of issue29_gpu_rows.sh: one
    model per call (its MODEL), the rows' limits summing to at most `call_s` (a row whose
    limit alone exceeds it gets a call of its own, its limit cut to `call_s`). Returns
    [(model, [EP:PRESET:TRACE:SECONDS[:EXTRA]])]."""
    calls: list[tuple[str, list[str]]] = []
    used = 0.0
    for r in rows:
        ep, preset, trace, *extra = r["spec"].split(":")
        flags = [x for x in (extra[0].split(",") if extra else []) if not x.lstrip("-").startswith("model=")]
        limit = min(row_limit(r["forecast_s"]), int(call_s))
        spec = ":".join([ep, preset, trace, str(limit)] + ([",".join(flags)] if flags else []))
        if not calls or calls[-1][0] != r["model"] or used + limit > call_s:
            calls.append((r["model"], []))
            used = 0.0
        calls[-1][1].append(spec)
        used += limit
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+",
                    help="EP:PRESET:TRACE[:--retime=R,--max-measured=K,--counts=poisson,--model=M]")
    ap.add_argument("--plans", type=Path, required=True, help="plans made by issue29.py --plan-only")
    ap.add_argument("--shared", type=Path, default=issue29.SHARED, help="the shared traces' npy folder")
    ap.add_argument("--fit", action="append", default=[], metavar="MODEL:PRESET=issue29.json")
    ap.add_argument("--per-gemm", type=float, default=0.0, help="fixed device seconds per GEMM timing")
    ap.add_argument("--cpu-factor", type=float, default=2.0, help="the host's CPU time over this machine's")
    ap.add_argument("--json", type=Path, default=None, help="write the forecasts here")
    ap.add_argument("--calls", type=float, default=0.0, metavar="SECONDS",
                    help="also print the rows, in the order given, packed into issue29_gpu_rows.sh "
                         "calls of at most this many seconds of row limits each")
    a = ap.parse_args()
    issue29.SHARED_DIR[0] = a.shared
    fits = {}
    for f in a.fit:
        mp, _, path = f.partition("=")
        model, _, preset = mp.partition(":")
        fits[(model, preset)] = Path(path)
    out = []
    print("| row | GEMMs timed (with re-timing) | kernel s | CPU s here | forecast s on the host | ratio on the fit | fit |")
    print("|---|---|---|---|---|---|---|")
    for spec in a.rows:
        r = forecast(spec, a.plans, fits)
        r["forecast_s"] = r["device_s"] + a.per_gemm * r["timings"] + a.cpu_factor * r["cpu_s"]
        out.append(r)
        print(f"| {spec} | {r['gemms']} ({r['timings']}) | {r['device_s']:.0f} | {r['cpu_s']:.1f} | "
              f"{r['forecast_s']:.0f} | {r['fit_ratio']:.4f} | {r['fit']} |", flush=True)
    if a.calls > 0:
        print(f"\n{a.calls:.0f} s calls (row limit = 1.5 x forecast + 30 s):\n")
        for i, (model, specs) in enumerate(pack_calls(out, a.calls), 1):
            total = sum(int(x.split(":")[3]) for x in specs)
            print(f"# call {i}: {len(specs)} rows, limits {total} s\n"
                  f"OUT=$OUT/c{i} PLANS={a.plans} SHARED={a.shared} MODEL={model} "
                  f"taskset -c 4-15 bash benchmarks/issue29_gpu_rows.sh {' '.join(specs)}")
    if a.json:
        a.json.write_text(json.dumps({"per_gemm": a.per_gemm, "cpu_factor": a.cpu_factor, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
