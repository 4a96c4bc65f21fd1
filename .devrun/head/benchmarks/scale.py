"""The payoff of EPLB at large expert parallelism: tokens/s at EP 8 to 256 on real traces.

    python benchmarks/scale.py --cost analytic --out /tmp/scale          # CPU, roofline
    python benchmarks/scale.py --cost gpu --out $OUT --plans plans/      # expert work timed on a GPU
    python benchmarks/scale.py --plan-only --plans plans/                # plan once (CPU), reuse

Runs `eplb.core.scale` (what `eplb simulate --cost` runs) over:

- traces: `esft` (the four ESFT tasks one after another, DeepSeek-V2-Lite routing, 8 of
  its 26 layers evenly spaced, per-sequence entries summed 8 at a time) and `olmoe` (OLMoE-1B-7B's six
  pre-training domains, layers 0/7/15, each domain's load held for 8 steps, then the next:
  a domain shift every 8 steps); both 64 experts, stacked to the model's (see
  `eplb.core.scale.stack_experts`);
- model: DeepSeek-V3 (H 7168, I 2048, 256 experts, top-8, 58 MoE layers);
- EP sizes 8 ... 256 with one spare slot per GPU, decode (128 tokens/GPU) and prefill
  (4096 tokens/GPU); placements static, deepseek, default, default-weighted, oracle;
- a sweep of spare slots per GPU (0 to 4) at EP 32, 64 and 128 (decode, static / deepseek /
  default).

Planning does not depend on the cost model or the token count; `--plans DIR` keeps the
placements so a GPU run only times kernels. Writes `scale.json`, `scale.md` (the tables of
benchmarks/README.md) and one PNG per trace and preset under `--out`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb.core.placement import Placement  # noqa: E402
from eplb.core.cost_model import MODEL_PRESETS, TOKEN_PRESETS, LinkModel  # noqa: E402
from eplb.core.scale import PLACEMENTS, plan_scale, scale_replay, topology  # noqa: E402
from eplb.core.replay import Block  # noqa: E402
from eplb.core.simulate import aggregate_steps  # noqa: E402
from eplb.core.workload import load_trace  # noqa: E402
from eplb.ops.plots import plot_scale  # noqa: E402
from eplb.ops.scale_report import format_scale_table, make_cost, pick_layers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces" / "npy"
OLMOE_DOMAINS = ("arxiv", "book", "c4", "github", "tulu", "wikipedia")
EP_SIZES = (8, 16, 32, 64, 128, 256)
SWEEP_EP = (32, 64, 128)
SWEEP_SPARES = (0, 1, 2, 3, 4)
SWEEP_PLACEMENTS = ("static", "deepseek", "default")
WINDOW = INTERVAL = 4
LAYERS = 8  # ESFT layers replayed (evenly spaced of 26): the GPU run times them all


def traces(shared: Path = SHARED) -> dict[str, np.ndarray]:
    """name -> [T, L, 64] loads (see the module docstring); olmoe needs the shared traces."""
    out = {"esft": pick_layers(aggregate_steps(load_trace("esft"), 8), LAYERS)}  # packaged copy
    if shared.is_dir():
        dom = [np.load(shared / f"olmoe_olmoe_{d}_L0-7-15.npy") for d in OLMOE_DOMAINS]  # [3, 64] each
        out["olmoe"] = np.repeat(np.stack(dom), 8, axis=0)  # [48, 3, 64]
    return out


# ---- plan cache --------------------------------------------------------------------------


def _plan_file(plans: Path, trace: str, M: int, P: int, kinds) -> Path:
    return plans / f"{trace}-M{M}-P{P}-w{WINDOW}-i{INTERVAL}-{'+'.join(kinds)}.npz"


def save_plans(path: Path, loads: np.ndarray, blocks: dict[str, list[Block]]) -> None:
    arrays = {"loads": loads}
    for kind, bs in blocks.items():
        arrays[f"{kind}/span"] = np.array([[b.start, b.end] for b in bs])  # [B, 2]
        arrays[f"{kind}/p2l"] = np.stack([b.placement.physical_to_logical for b in bs])  # [B, L, P]
        arrays[f"{kind}/shares"] = np.stack([b.placement.slot_shares() for b in bs])  # [B, L, P]
        arrays[f"{kind}/weighted"] = np.array([b.placement.shares is not None for b in bs])
        arrays[f"{kind}/prev_p2l"] = bs[0].previous.physical_to_logical  # [L, P]
        arrays[f"{kind}/lead"] = np.array([b.lead for b in bs])  # [B] share of the first step on `previous`
    np.savez_compressed(path, **arrays)


def load_plans(path: Path, M: int, nodes: int) -> tuple[np.ndarray, dict[str, list[Block]]]:
    z = np.load(path)
    loads = z["loads"]
    N = loads.shape[-1]
    blocks: dict[str, list[Block]] = {}
    for kind in sorted({k.split("/")[0] for k in z.files if "/" in k}, key=PLACEMENTS.index):
        prev = Placement(z[f"{kind}/prev_p2l"], N, M, nodes)
        bs = []
        leads = z[f"{kind}/lead"] if f"{kind}/lead" in z.files else np.zeros(len(z[f"{kind}/span"]))
        for (s, e), p2l, sh, w, lead in zip(z[f"{kind}/span"], z[f"{kind}/p2l"], z[f"{kind}/shares"],
                                            z[f"{kind}/weighted"], leads):
            pl = Placement(p2l, N, M, nodes, kind, sh if w else None)
            if pl == prev:
                pl = prev
            bs.append(Block(int(s), int(e), pl, prev, lead=float(lead)))
            prev = pl
        blocks[kind] = bs
    return loads, blocks


def planned(name: str, trace: np.ndarray, M: int, P: int, kinds, plans: Path | None):
    shape = MODEL_PRESETS["deepseek-v3"]
    nodes, _ = topology(shape, M, LinkModel())
    if plans is not None:
        f = _plan_file(plans, name, M, P, kinds)
        if f.exists():
            return load_plans(f, M, nodes)
    t0 = time.perf_counter()
    out = plan_scale(trace, shape, M, P, WINDOW, INTERVAL, LinkModel(), kinds)
    print(f"  planned {name} EP {M} P {P} ({', '.join(kinds)}) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    if plans is not None:
        plans.mkdir(parents=True, exist_ok=True)
        save_plans(_plan_file(plans, name, M, P, kinds), *out)
    return out


# ---- runs -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost", choices=["analytic", "gpu"], default="analytic")
    p.add_argument("--out", type=Path, default=Path("scale-out"))
    p.add_argument("--plans", type=Path, default=None, help="folder caching the placements")
    p.add_argument("--plan-only", action="store_true", help="only compute (and cache) the placements")
    p.add_argument("--ep", default=",".join(map(str, EP_SIZES)))
    p.add_argument("--traces", default="esft,olmoe")
    p.add_argument("--presets", default="decode,prefill")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--shared", type=Path, default=SHARED, help="folder of the shared .npy traces (olmoe)")
    p.add_argument("--reps", type=int, default=2, help="gpu: timed runs per GEMM (after one warm-up)")
    p.add_argument("--max-measured", type=int, default=3,
                   help="gpu: GPUs of a layer run for real (those within --margin of the largest estimate)")
    p.add_argument("--margin", type=float, default=0.1, help="gpu: see --max-measured")
    p.add_argument("--audit-every", type=int, default=150,
                   help="gpu: every this many layers, measure all GPUs to check the pick (0 = never)")
    a = p.parse_args(argv)
    Ms = [int(x) for x in a.ep.split(",")]
    shape = MODEL_PRESETS["deepseek-v3"]
    link = LinkModel()
    all_traces = traces(a.shared)
    names = [t for t in a.traces.split(",") if t in all_traces]
    a.out.mkdir(parents=True, exist_ok=True)
    max_slots = shape.num_experts // min(Ms) + (1 if a.no_sweep else max(SWEEP_SPARES))  # per GPU
    cost = make_cost("analytic" if a.plan_only else a.cost, shape, max_slots,  # plan-only times nothing
                     max(TOKEN_PRESETS.values()), reps=a.reps, max_measured=a.max_measured,
                     margin=a.margin, audit_every=a.audit_every)
    doc: dict = {"date": datetime.date.today().isoformat(), "cost": a.cost, "model": shape.name,
                 "window": WINDOW, "interval": INTERVAL, "main": [], "sweep": []}
    md = []
    t_start = time.perf_counter()
    for name in names:
        trace = all_traces[name]
        for preset in a.presets.split(","):
            tokens = TOKEN_PRESETS[preset]
            results = []
            for M in Ms:
                P = shape.num_experts + M
                plan = planned(name, trace, M, P, PLACEMENTS, a.plans)
                if a.plan_only:
                    continue
                res = scale_replay(trace, shape, M, P, tokens, WINDOW, INTERVAL, cost, link, PLACEMENTS,
                                   planned=plan)
                results.append(res)
                print(f"[{name} {preset}] " + format_scale_table([res]), flush=True)
                doc["main"].append({"trace": name, "preset": preset, **res.to_dict()})
            if results:
                plot_scale(results, a.out / f"scale-{name}-{preset}.png",
                           title=f"{name} trace as DeepSeek-V3, {tokens} tokens/GPU/step, cost {a.cost}")
                md.append(main_table(name, preset, results))
                write(a.out, doc, md, cost, t_start)
        if a.no_sweep:
            continue
        rows = []
        for M in SWEEP_EP:
            if M not in Ms:
                continue
            for spare in SWEEP_SPARES:
                P = shape.num_experts + spare * M
                plan = planned(name, trace, M, P, SWEEP_PLACEMENTS, a.plans)
                if a.plan_only:
                    continue
                res = scale_replay(trace, shape, M, P, TOKEN_PRESETS["decode"], WINDOW, INTERVAL, cost,
                                   link, SWEEP_PLACEMENTS, planned=plan)
                rows.append((M, spare, res))
                doc["sweep"].append({"trace": name, "preset": "decode", "spare": spare, **res.to_dict()})
        if rows:
            md.append(sweep_table(name, rows))
            write(a.out, doc, md, cost, t_start)
    if a.plan_only:
        return 0
    write(a.out, doc, md, cost, t_start)
    print("\n\n".join(md))
    if a.cost == "gpu":
        print(f"GPU: {doc['gpu']}")
    print(f"wrote {a.out}/scale.json, scale.md and the plots in {doc['seconds']:.0f} s")
    return 0


def write(out: Path, doc: dict, md: list[str], cost, t_start: float) -> None:
    """(Re)write scale.json and scale.md with what is done so far."""
    if hasattr(cost, "stats"):
        doc["gpu"] = cost.stats()
    doc["seconds"] = time.perf_counter() - t_start
    (out / "scale.json").write_text(json.dumps(doc) + "\n")
    (out / "scale.md").write_text("\n\n".join(md) + "\n")


def main_table(name: str, preset: str, results) -> str:
    head = ("| EP | " + " | ".join(f"{k} tok/s (gain)" for k in PLACEMENTS) + " | default / oracle "
            "| default / deepseek |\n|" + "---|" * (len(PLACEMENTS) + 3))
    lines = [f"**{name}, {preset}**: tokens/s (gain over static); layer times and idle fractions are in "
             "scale.json", "", head]
    for r in results:
        cells = [f"{r.rows[k].tokens_per_s:,.0f} ({100 * r.gain_over_static(k):+.1f}%)" for k in PLACEMENTS]
        d, o, ds = (r.rows[k].tokens_per_s for k in ("default", "oracle", "deepseek"))
        lines.append(f"| {r.config['num_gpus']} | " + " | ".join(cells) + f" | {d / o:.3f} | {d / ds:.3f} |")
    return "\n".join(lines)


def sweep_table(name: str, rows) -> str:
    lines = [f"**{name}, decode: spare slots per GPU** (tokens/s gain over static with no spare slot)", "",
             "| EP | spare slots/GPU | " + " | ".join(SWEEP_PLACEMENTS) + " |",
             "|---|---|" + "---|" * len(SWEEP_PLACEMENTS)]
    base = {M: res.rows["static"].tokens_per_s for M, spare, res in rows if spare == 0}
    for M, spare, res in rows:
        cells = [f"{100 * (res.rows[k].tokens_per_s / base[M] - 1):+.1f}%" for k in SWEEP_PLACEMENTS]
        lines.append(f"| {M} | {spare} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
