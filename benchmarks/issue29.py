"""Issue 29: default against deepseek and the oracle in tokens/s, EP 8 to 256, every trace.

    python benchmarks/issue29.py --cost analytic --out /tmp/i29        # CPU roofline
    python benchmarks/issue29.py --cost gpu --out $OUT                 # expert work timed on a GPU

Runs `eplb.core.scale` (what `eplb simulate --cost` runs; window and interval 4, one
spare slot per GPU, decode 128 and prefill 4,096 tokens per GPU) over:

- the shared traces of benchmarks/scale.py (`esft`, `olmoe`) on DeepSeek-V3 and Qwen3-235B
  shapes (64-expert traces stacked to 256 and 128 experts; Qwen3 up to EP 128);
- synthetic families (256 experts, 4 layers, 40 steps, each step 2**17 token-expert
  choices per layer drawn from the step's shares, seed 29; drawn with 128 experts for
  Qwen3-235B;
  `--family-seed` draws other members of the families):
  `shift-zipf` (Zipf 1.0 popularity whose expert order is redrawn every 8 steps: a domain
  change at every second rebalance), `shift-lognormal` (lognormal(0, 1), redrawn every 12
  steps: shifts between rebalances), `steady-lognormal` (lognormal(0, 1), fixed),
  `drift` (a smooth cosine mix of two Zipf 1.0 profiles);

with the default planner as the runtime ships it (`EplbConfig`: shift-aware, checks every
`--control-interval` 10 model steps of the 250 a trace step stands for, decode-aware
packing with `--read-tokens 100 --dispatch-tokens 40`, each set against the preset's tokens
per step, `--steady-windows 2` earlier windows on a steady load) and the same without shift detection (`--shift-threshold 0`), against deepseek
(schedule only, as published) and the oracle. Prints one table per
model, trace and preset: tokens/s ratios default/deepseek and default/oracle, and the
moves per rebalance. Writes `issue29.json` under `--out` (after every row).
`--plan-only --plans DIR --jobs J` plans every configuration first in J processes (the
CPU part); a later run with the same `--plans` only scores (benchmarks/issue29_gpu.sh).
With `--cost gpu`, `--retime R` times each configuration's GEMMs again side by side in R
shuffled rounds and scores on their medians (`side_by_side`; without it the placement kinds
are timed one after another, minutes apart), keeping each round's ratios, and
`--max-measured K` times up to K GPUs per layer (default 4; the EP size: all of them).
"""
from __future__ import annotations

import argparse
import datetime
import json
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eplb.core.config import EplbConfig  # noqa: E402
from eplb.core.placement import Placement  # noqa: E402
from eplb.core.planning import DEFAULT_SHIFT_THRESHOLD  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, TOKEN_PRESETS, LinkModel  # noqa: E402
from eplb.core.scale import (COUNTS, DEFAULT_CONTROL_INTERVAL, SERVING_STEPS, PlanOptions,  # noqa: E402
                             plan_scale, scale_replay, topology)
from eplb.core.replay import Block, RebalanceRecord  # noqa: E402
from eplb.core.transfer_plan import transfer_stats  # noqa: E402
from eplb.core.workload import cosine_drift  # noqa: E402
from eplb.ops.scale_report import make_cost  # noqa: E402
from eplb.ops.settings_args import on_off  # noqa: E402
from scale import SHARED, traces as shared_traces  # noqa: E402

EP_SIZES = (8, 16, 32, 64, 128, 256)
WINDOW = INTERVAL = 4
KINDS = ("static", "deepseek", "default", "oracle")


def _sample(shares: np.ndarray, rng: np.random.Generator, choices: int = 2 ** 17) -> np.ndarray:
    """[T, L, N] shares -> [T, L, N] counts: `choices` multinomial draws per step and layer."""
    T, L, N = shares.shape
    out = np.empty(shares.shape)
    for t in range(T):
        for layer in range(L):
            p = shares[t, layer]
            out[t, layer] = rng.multinomial(choices, p / p.sum())
    return out


FAMILY_SEED = 29  # the synthetic families' draws unless --family-seed says otherwise


def synthetic(T: int = 40, L: int = 4, N: int = 256, seed: int = FAMILY_SEED) -> dict[str, np.ndarray]:
    """name -> [T, L, N] counts (see the module docstring); `seed` draws other members of
    the same families (profiles, shift times' new orders and token samples)."""
    rng = np.random.default_rng(seed)

    def zipf() -> np.ndarray:  # [L, N]
        return 1.0 / (np.argsort(rng.random((L, N)), 1) + 1.0)

    def lognormal() -> np.ndarray:  # [L, N]
        return rng.lognormal(0.0, 1.0, (L, N))

    out = {}
    out["shift-zipf"] = np.concatenate([np.repeat(zipf()[None], 8, 0) for _ in range(T // 8)])
    out["shift-lognormal"] = np.concatenate([np.repeat(lognormal()[None], 12, 0)
                                             for _ in range(-(-T // 12))])[:T]
    out["steady-lognormal"] = np.repeat(lognormal()[None], T, 0)
    a, b = zipf(), zipf()
    out["drift"] = cosine_drift(a, b, T)
    return {k: _sample(v, rng) for k, v in out.items()}


def _plan_file(plans: Path, model: str, name: str, M: int, shift: float, preset: str) -> Path:
    r, d = READS
    draw = "" if FAMILIES[0] == FAMILY_SEED or name not in SYNTHETIC else f"-f{FAMILIES[0]}"
    return plans / (f"{model}-{name}{draw}-M{M}-{preset}-shift{shift:g}-ci{CONTROL[0]}-r{r:g}-d{d:g}-s{STEADY[0]}"
                    f"-t{int(TREND[0])}.npz")


def _plans(model: str, name: str, M: int, shift: float, plans: Path | None, preset: str):
    """{"shift": (loads, blocks), "noshift": ...} for one model, trace and EP size; read from
    / written to `plans` when given (planning is the CPU part: `--plan-only` fills the cache
    with several processes, a GPU run then only times kernels)."""
    shape = MODEL_PRESETS[model]
    f = None if plans is None else _plan_file(plans, model, name, M, shift, preset)
    if f is not None and f.exists():
        return _load(f, M, shape)
    loads = _trace(model, name)
    P = shape.num_experts + M
    out = {}
    for label, thr in (("shift", shift), ("noshift", 0.0)):
        kinds = KINDS if label == "shift" else ("static", "default")
        out[label] = plan_scale(loads, shape, M, P, WINDOW, INTERVAL, LinkModel(), kinds,
                                opts=_opts(thr, M, shape, preset))
    if f is not None:
        _save(f, out)
    return out


def _opts(threshold: float, M: int, shape, preset: str) -> PlanOptions:
    """The plans' settings, the runtime's unless told: shift checks every CONTROL[0] model
    steps, decode-aware packing with READS; both set against the preset's tokens per step
    (the routing noise of a check, the weight reads), so each preset has its own plans."""
    return PlanOptions(shift_threshold=threshold, control_interval=CONTROL[0],
                       read_tokens=READS[0], dispatch_tokens=READS[1], steady_windows=STEADY[0],
                       drift_trend=TREND[0], step_choices=float(M * TOKEN_PRESETS[preset] * shape.top_k))


def _save(f: Path, out: dict) -> None:
    arrays = {}
    for label, (loads, blocks) in out.items():
        arrays[f"{label}/loads"] = loads
        for kind, bs in blocks.items():
            k = f"{label}/{kind}"
            arrays[k + "/span"] = np.array([[b.start, b.end] for b in bs])  # [B, 2]
            arrays[k + "/lead"] = np.array([b.lead for b in bs])  # [B]
            arrays[k + "/p2l"] = np.stack([b.placement.physical_to_logical for b in bs])  # [B, L, P]
            arrays[k + "/prev"] = bs[0].previous.physical_to_logical  # [L, P]
            arrays[k + "/flags"] = np.array([[b.record is not None and b.record.early,
                                              b.record is not None and b.record.shifted,
                                              b.record is not None and b.record.skipped] for b in bs])
            arrays[k + "/shares"] = np.stack([b.placement.slot_shares() for b in bs])  # [B, L, P]
            arrays[k + "/weighted"] = np.array([b.placement.shares is not None for b in bs])
    f.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(f, **arrays)


def _load(f: Path, M: int, shape) -> dict:
    """The cached plans as Blocks; records carry the flags and the recounted moves."""
    z = np.load(f)
    nodes, _ = topology(shape, M, LinkModel())
    out = {}
    for label in ("shift", "noshift"):
        loads = z[f"{label}/loads"]
        N = loads.shape[-1]
        blocks = {}
        kinds = sorted({k.split("/")[1] for k in z.files if k.startswith(label + "/") and k.count("/") == 2},
                       key=KINDS.index)
        for kind in kinds:
            k = f"{label}/{kind}"
            prev = Placement(z[k + "/prev"], N, M, nodes)
            bs = []
            leads = z[k + "/lead"]
            for (s, e), p2l, sh, w, (early, shifted, skipped), lead in zip(
                    z[k + "/span"], z[k + "/p2l"], z[k + "/shares"], z[k + "/weighted"], z[k + "/flags"], leads):
                pl = Placement(p2l, N, M, nodes, kind, sh if w else None)
                if pl == prev:
                    pl = prev
                moved = transfer_stats(prev.physical_to_logical, p2l, M).experts_moved
                rec = None if kind in ("static", "oracle") else RebalanceRecord(
                    int(s), 0, moved, 0, None, 0.0, 0.0, 0.0, bool(skipped), bool(shifted), bool(early))
                bs.append(Block(int(s), int(e), pl, prev, rec, float(lead)))
                prev = pl
            blocks[kind] = bs
        out[label] = (loads, blocks)
    return out


_LOADS: dict = {}
_DRAWN: dict = {}  # (experts, family seed) -> the families drawn with that many experts


SHARED_DIR = [SHARED]  # --shared: where the shared traces are (olmoe is left out without them)
CONTROL = [DEFAULT_CONTROL_INTERVAL]  # --control-interval: model steps between shift checks
READS = [EplbConfig.read_tokens, EplbConfig.dispatch_tokens]  # --read-tokens, --dispatch-tokens
STEADY = [EplbConfig.steady_windows]  # --steady-windows
RETIME = [0]  # --retime: rounds of side-by-side GEMM timing (--cost gpu)
MEASURED = [4]  # --max-measured: GPUs per layer whose GEMM is timed (--cost gpu)
FAMILIES = [FAMILY_SEED]  # --family-seed: the synthetic families' draws
TREND = [EplbConfig.drift_trend]  # --drift-trend
SYNTHETIC = ("shift-zipf", "shift-lognormal", "steady-lognormal", "drift")


def _all_loads() -> dict[str, np.ndarray]:
    """The shared traces, and the families drawn with 256 experts (DeepSeek-V3's)."""
    if not _LOADS:
        _LOADS.update(shared_traces(SHARED_DIR[0]))
        _LOADS.update(synthetic(seed=FAMILIES[0]))
    return _LOADS


def _trace(model: str, name: str) -> np.ndarray:  # [T, L, N]
    """The load `model` is replayed on: a shared trace as it is (stacked to the model's
    experts by the replay), a family drawn with the model's experts (256: the draws above;
    Qwen3-235B's 128: the same families drawn with 128, cached)."""
    N = MODEL_PRESETS[model].num_experts
    if name not in SYNTHETIC or N == 256:
        return _all_loads()[name]
    key = (N, FAMILIES[0])
    if key not in _DRAWN:
        _DRAWN[key] = synthetic(N=N, seed=FAMILIES[0])
    return _DRAWN[key][name]


def configs(eps, models, names) -> list[tuple[str, str, int]]:
    """(model, trace, EP) of the run: traces whose experts divide the model's (the families
    are drawn with the model's), EP sizes that divide its experts (Qwen3's 128 at EP 256
    would need N + 256 slots on 256 GPUs)."""
    loads = _all_loads()
    missing = [n for n in names if n not in loads]
    if missing:
        print(f"left out (no such trace here: see --shared): {', '.join(missing)}", flush=True)
    return [(m, n, M) for m in models for n in names if n in loads
            if MODEL_PRESETS[m].num_experts % _trace(m, n).shape[-1] == 0 for M in eps
            if MODEL_PRESETS[m].num_experts % M == 0]  # N + M slots must divide over M GPUs


def _plan_job(args) -> str:
    model, name, M, shift, plans, preset = args
    t0 = time.perf_counter()
    _plans(model, name, M, shift, plans, preset)
    return f"planned {model} {name} EP {M} {preset} in {time.perf_counter() - t0:.1f} s"


def run(cost_kind: str, out: Path, shift: float, eps, models, names, plans: Path | None = None,
        counts: str = "expected", seed: int = 0, presets=tuple(TOKEN_PRESETS)) -> dict:
    link = LinkModel()
    doc = {"date": datetime.date.today().isoformat(), "cost": cost_kind, "shift_threshold": shift,
           "control_interval": CONTROL[0], "read_tokens": READS[0], "dispatch_tokens": READS[1],
           "steady_windows": STEADY[0], "drift_trend": TREND[0],
           "retime_rounds": RETIME[0] if cost_kind == "gpu" else 0,
           "max_measured": MEASURED[0] if cost_kind == "gpu" else 0,
           "counts": counts, "seed": seed, "family_seed": FAMILIES[0], "rows": []}
    out.mkdir(parents=True, exist_ok=True)
    costs = {}
    try:  # a run cut short (timeout's SIGTERM: see main) still writes the GEMMs it timed
        for model, name, M in configs(eps, models, names):
            shape = MODEL_PRESETS[model]
            if model not in costs:
                gpu = {"max_measured": MEASURED[0]} if cost_kind == "gpu" else {}
                costs[model] = {p: make_cost(cost_kind, shape, 1 + shape.num_experts // 8 + 1, t, **gpu)
                                for p, t in TOKEN_PRESETS.items() if p in presets}
            P = shape.num_experts + M
            for preset in presets:
                tokens = TOKEN_PRESETS[preset]
                if plans is not None and not _plan_file(plans, model, name, M, shift, preset).exists():
                    print(f"{model} {name} EP {M} {preset}: not in {plans} (planning was cut short): left out",
                          flush=True)
                    continue
                t0 = time.perf_counter()
                variants = _plans(model, name, M, shift, plans, preset)
                t_plan = time.perf_counter() - t0
                trace = variants["shift"][0]

                def replay(cost=costs[model][preset]) -> dict:
                    return {label: scale_replay(trace, shape, M, P, tokens, WINDOW, INTERVAL, cost, link,
                                                planned=pl, opts=_opts(thr, M, shape, preset), counts=counts,
                                                seed=seed)
                            for (label, pl), thr in zip(variants.items(), (shift, 0.0))}
                res = replay()
                rounds, first = [], None
                if cost_kind == "gpu" and RETIME[0]:
                    first = _ratio({k: v.rows for k, v in res.items()}, "default/deepseek")
                    res, rounds = side_by_side(replay, costs[model][preset], RETIME[0])
                r, r0 = res["shift"].rows, res["noshift"].rows
                tps = {k: v.tokens_per_s for k, v in r.items()}
                blocks = variants["shift"][1]["default"]
                blocks0 = variants["noshift"][1]["default"]
                row = {"model": model, "trace": name, "ep": M, "preset": preset,
                       "tokens_per_s": tps, "default_noshift": r0["default"].tokens_per_s,
                       "default/deepseek": tps["default"] / tps["deepseek"],
                       "default/oracle": tps["default"] / tps["oracle"],
                       "noshift/deepseek": r0["default"].tokens_per_s / tps["deepseek"],
                       "noshift/oracle": r0["default"].tokens_per_s / tps["oracle"],
                       "moves_per_rebalance": _moves(blocks), "moves_per_rebalance_noshift": _moves(blocks0),
                       "moves_total": _moves(blocks, total=True), "moves_total_noshift": _moves(blocks0, total=True),
                       "skipped_rebalances": sum(b.record.skipped for b in blocks if b.record),
                       "early_rebalances": sum(b.record.early for b in blocks if b.record),
                       "shifted_plans": sum(b.record.shifted for b in blocks if b.record),
                       "plan_s": round(t_plan, 1), "score_s": round(time.perf_counter() - t0 - t_plan, 1)}
                spread = ""
                if rounds:  # each round's ratios: the timing noise left
                    row["rounds"] = {k: [_ratio(x, k) for x in rounds] for k in
                                     ("default/deepseek", "noshift/deepseek", "default/oracle")}
                    row["retimed_gemms"] = rounds[0]["gemms"]
                    row["default/deepseek_first_timing"] = first  # before re-timing: one kind after another
                    lo, hi = min(row["rounds"]["default/deepseek"]), max(row["rounds"]["default/deepseek"])
                    spread = f" [{len(rounds)} rounds {lo:.4f}-{hi:.4f}; first timing {first:.4f}]"
                doc["rows"].append(row)
                print(f"{model:<12} {name:<17} EP {M:>3} {preset:<7} default/deepseek "
                      f"{row['default/deepseek']:.4f}{spread} (no shift {row['noshift/deepseek']:.3f})  "
                      f"default/oracle {row['default/oracle']:.3f} (no shift {row['noshift/oracle']:.3f})  "
                      f"moves/rebalance {row['moves_per_rebalance']:.1f} (no shift "
                      f"{row['moves_per_rebalance_noshift']:.1f}; in all {row['moves_total']:.0f}, no shift "
                      f"{row['moves_total_noshift']:.0f}), early {row['early_rebalances']}, "
                      f"shifted {row['shifted_plans']}, scored in {row['score_s']:.0f} s", flush=True)
                (out / "issue29.json").write_text(json.dumps(doc) + "\n")  # after every row: partial runs keep theirs
    finally:
        if cost_kind == "gpu":
            doc["gpu"] = {m: {p: c.stats() for p, c in cs.items()} for m, cs in costs.items()}
            (out / "issue29.json").write_text(json.dumps(doc) + "\n")
            # every measured GEMM (sorted token counts, seconds), to fit or check cost models offline
            (out / "gemms.json").write_text(json.dumps(
                {m: {p: c.measured() for p, c in cs.items()} for m, cs in costs.items()}) + "\n")
            if RETIME[0]:  # the last configuration's re-timed GEMMs: [counts, [seconds per round]]
                (out / "rounds.json").write_text(json.dumps(
                    {m: {p: [[list(k), ts] for k, ts in c.rounds.items()] for p, c in cs.items()}
                     for m, cs in costs.items()}) + "\n")
    return doc


def side_by_side(replay: Callable[[], dict], cost, rounds: int) -> tuple[dict, list[dict]]:
    """`replay()` (label -> ScaleResult) scored on GEMMs timed side by side: with the GPU
    cost's estimate frozen, the replay runs again to collect every GEMM it uses; these are
    timed again in `rounds` shuffled rounds (`GpuGemmCost.retime`). Returns the replay on
    the median times, and per round {"shift"/"noshift": rows, "gemms": keys timed}."""
    from eplb.ops.progress import ProgressBar
    cost.freeze()
    cost.track()
    replay()  # the picks now depend on the counts alone: collect the GEMMs they use
    keys, cost.touched = cost.touched, None
    bar = ProgressBar(rounds * len(keys), f"re-timing {len(keys)} GEMMs x {rounds} rounds", lines=False)
    cost.retime(keys, rounds, progress=bar.update)
    bar.close()
    runs = cost.runs
    per_round = []
    for r in range(rounds):
        cost.use_round(r)
        per_round.append({label: x.rows for label, x in replay().items()} | {"gemms": len(keys)})
    cost.use_round(None)
    res = replay()
    if cost.runs != runs:  # the same picks, so every GEMM comes from the re-timed cache
        raise RuntimeError(f"side_by_side: {cost.runs - runs} GEMMs were not re-timed")
    cost.freeze(False)
    return res, per_round


def _ratio(rows: dict, which: str) -> float:
    """A row's ratio `which` ("default/deepseek", "noshift/deepseek", "default/oracle")."""
    a, b = which.split("/")
    num = rows["noshift"]["default"] if a == "noshift" else rows["shift"][a]
    return num.tokens_per_s / rows["shift"][b].tokens_per_s


def _moves(blocks, total: bool = False) -> float:
    """Mean remote expert receives per rebalance that moved something (a skipped rebalance,
    one whose plan kept the placement, is not counted); with `total`, their sum over the
    replay (what a load's rebalances move in all, skipped ones included as 0)."""
    moved = [b.record.experts_moved for b in blocks if b.record and not b.record.skipped]
    if total:
        return float(np.sum(moved))
    return float(np.mean(moved)) if moved else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", choices=["analytic", "gpu"], default="analytic")
    ap.add_argument("--out", type=Path, default=None, help="where issue29.json goes (required unless --plan-only)")
    ap.add_argument("--shift-threshold", type=float, default=DEFAULT_SHIFT_THRESHOLD)
    ap.add_argument("--ep", default=",".join(map(str, EP_SIZES)))
    ap.add_argument("--models", default="deepseek-v3,qwen3-235b")
    ap.add_argument("--traces", default="esft,olmoe,shift-zipf,shift-lognormal,steady-lognormal,drift")
    ap.add_argument("--plans", type=Path, default=None, help="cache of the plans (npz per configuration)")
    ap.add_argument("--plan-only", action="store_true", help="fill --plans and stop (no cost replay)")
    ap.add_argument("--jobs", type=int, default=1, help="--plan-only: planning processes")
    ap.add_argument("--counts", choices=COUNTS, default="expected",
                    help="token counts per step: expected (rounded) or Poisson draws (eplb.core.scale)")
    ap.add_argument("--shared", type=Path, default=SHARED, help=f"the shared traces' npy folder (default {SHARED})")
    ap.add_argument("--control-interval", type=int, default=DEFAULT_CONTROL_INTERVAL,
                    help=f"model steps between shift checks (default {DEFAULT_CONTROL_INTERVAL}, the runtime's; "
                         f"{SERVING_STEPS // INTERVAL}: after whole trace steps only; 0: no early rebalances)")
    ap.add_argument("--read-tokens", type=float, default=EplbConfig.read_tokens,
                    help=f"decode-aware packing (default {EplbConfig.read_tokens:g}, the runtime's; 0 = off)")
    ap.add_argument("--dispatch-tokens", type=float, default=EplbConfig.dispatch_tokens,
                    help=f"decode-aware packing's price of a token more on the busiest GPU "
                         f"(default {EplbConfig.dispatch_tokens:g}, the runtime's)")
    ap.add_argument("--steady-windows", type=int, default=EplbConfig.steady_windows,
                    help=f"earlier windows a plan on a steady load adds (default {EplbConfig.steady_windows}, "
                         f"the runtime's; 0 = the window alone)")
    ap.add_argument("--drift-trend", type=on_off, default=EplbConfig.drift_trend, metavar="on|off",
                    help="plans on a drifting load use the window's trend where it predicted well "
                         "(default: the runtime's)")
    ap.add_argument("--retime", type=int, default=0,
                    help="--cost gpu: time every configuration's GEMMs again side by side in this many "
                         "shuffled rounds and score on their medians (each round's ratio is kept: the "
                         "noise left); 0 = as first timed, one placement kind after another")
    ap.add_argument("--max-measured", type=int, default=MEASURED[0],
                    help=f"--cost gpu: the most GPUs per layer whose GEMM is timed, those with the largest "
                         f"estimates (default {MEASURED[0]}; the EP size: every GPU, no estimate left)")
    ap.add_argument("--seed", type=int, default=0, help="--counts poisson: the draws' seed")
    ap.add_argument("--family-seed", type=int, default=FAMILY_SEED,
                    help=f"the synthetic families' random draws (default {FAMILY_SEED}; others: other "
                         f"members of the same families, to check that no result rests on one draw)")
    ap.add_argument("--presets", default=",".join(TOKEN_PRESETS),
                    help=f"token presets to run (default {','.join(TOKEN_PRESETS)})")
    a = ap.parse_args()
    SHARED_DIR[0] = a.shared
    CONTROL[0] = a.control_interval
    READS[:] = [a.read_tokens, a.dispatch_tokens]
    STEADY[0] = a.steady_windows
    if a.retime < 0 or a.max_measured < 1:
        ap.error(f"--retime must be >= 0 and --max-measured >= 1 (got {a.retime}, {a.max_measured})")
    RETIME[0] = a.retime
    MEASURED[0] = a.max_measured
    FAMILIES[0] = a.family_seed
    TREND[0] = a.drift_trend
    eps, models, names = [int(x) for x in a.ep.split(",")], a.models.split(","), a.traces.split(",")
    presets = a.presets.split(",")
    if unknown := [p for p in presets if p not in TOKEN_PRESETS]:
        ap.error(f"unknown preset {', '.join(unknown)} (known: {', '.join(TOKEN_PRESETS)})")
    if a.plan_only:
        if a.plans is None:
            ap.error("--plan-only needs --plans")
        jobs = [(m, n, M, a.shift_threshold, a.plans, p) for m, n, M in configs(eps, models, names)
                for p in presets]
        jobs.sort(key=lambda j: -j[2])  # the largest EP first: they take longest
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(max(1, a.jobs)) as pool:
            for line in pool.imap_unordered(_plan_job, jobs):
                print(line, flush=True)
        return
    if a.out is None:
        ap.error("--out is required (unless --plan-only)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run()'s finally
    run(a.cost, a.out, a.shift_threshold, eps, models, names, a.plans, a.counts, a.seed, presets)


if __name__ == "__main__":
    main()
