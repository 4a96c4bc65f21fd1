"""Issue 29, target 3: decode-aware packing (`read_tokens`) against the default and deepseek.

    python benchmarks/issue29_reads.py --out /tmp/i29reads                 # EP 8-32, 16/32/128 tokens per GPU
    python benchmarks/issue29_reads.py --ep 8 --tokens 16 --variants 100:40,250:inf --out DIR

The cost replay of benchmarks/issue29.py (`eplb.core.scale`, analytic roofline, window and
interval 4, one spare slot per GPU, shift-aware default) at decode batch sizes where cold
experts' slots can be empty in a step; token counts are Poisson draws of the expected
counts (`--counts poisson`, the default here: a cold slot reads its weights in some steps
and not in others) or the expected counts rounded (`--counts expected`). For each variant
`R:D` (read_tokens R, dispatch_tokens D; `inf`: the busiest GPU's tokens never rise) the
default planner replans with the decode-aware pass (`eplb.core.policy.balanced.reads`;
`step_choices` = GPUs x tokens per GPU x top_k) and is scored on the same steps as the
default without it and deepseek. `auto` stands for the (R, D) of the analytic roofline in
the memory-bound regime of decode (`analytic_tokens`: a weight read and one token's
dispatch + combine over the busiest GPU, each divided by one token's expert work).
Tokens/s are means over `--seeds` Poisson draws (one draw varies by about 0.3% in
default/deepseek). Prints one line per configuration: default/deepseek,
then for each variant (read-aware)/deepseek, (read-aware)/default and moves per
rebalance. Writes `issue29_reads.json` under `--out` after every line.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eplb.core.cost_model import MODEL_PRESETS, AnalyticCost, LinkModel  # noqa: E402
from eplb.core.scale import COUNTS, PlanOptions, plan_scale, scale_replay  # noqa: E402
from eplb.ops.scale_report import make_cost  # noqa: E402
import issue29  # noqa: E402

WINDOW = INTERVAL = 4


def _moves(blocks) -> float:
    moved = [b.record.experts_moved for b in blocks if b.record and not b.record.skipped]
    return float(np.mean(moved)) if moved else 0.0


def analytic_tokens(shape, num_gpus: int, cost: AnalyticCost, link: LinkModel) -> tuple[float, float]:
    """(read_tokens, dispatch_tokens) of the analytic cost model when memory-bound: a weight
    read, and one token-expert choice's dispatch + combine on the GPU that receives it
    (from the (n - 1) / M of tokens in its node and the (M - n) / M outside), in units of
    one choice's expert work (its activation bytes at the HBM rate)."""
    H, I, b = shape.hidden, shape.intermediate, shape.dtype_bytes
    per_choice = (2 * H + 2 * I + I + H) * b / (cost.hbm_TBps * 1e12)
    read = shape.bytes_per_expert / (cost.hbm_TBps * 1e12)
    n, row = min(link.gpus_per_node, num_gpus), H * b
    exchange = 2 * max(row * (n - 1) / num_gpus / (link.intra_GBps * 1e9),
                       row * (num_gpus - n) / num_gpus / (link.inter_GBps * 1e9))
    return read / per_choice, exchange / per_choice


def _variants(text: str) -> list[str | tuple[float, float]]:
    out: list[str | tuple[float, float]] = []
    for v in text.split(","):
        if v == "auto":
            out.append(v)
            continue
        r, _, d = v.partition(":")
        out.append((float(r), float(d) if d else float("inf")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ep", default="8,16,32")
    ap.add_argument("--tokens", default="16,32,128", help="tokens per GPU per step (decode batch)")
    ap.add_argument("--variants", default="100:40", help="R:D pairs (read_tokens:dispatch_tokens) to try")
    ap.add_argument("--counts", choices=COUNTS, default="poisson")
    ap.add_argument("--cost", choices=["analytic", "gpu"], default="analytic",
                    help="expert work: the roofline, or the grouped GEMM timed on this machine's GPU")
    ap.add_argument("--seeds", type=int, default=4, help="Poisson draws averaged (seeds 0..K-1)")
    ap.add_argument("--models", default="deepseek-v3,qwen3-235b")
    ap.add_argument("--traces", default="esft,olmoe,steady-lognormal,shift-lognormal,shift-zipf,drift")
    ap.add_argument("--shared", type=Path, default=None, help="where the shared traces are (benchmarks/scale.py)")
    a = ap.parse_args()
    if a.shared:
        issue29.SHARED_DIR[0] = a.shared
    eps = [int(x) for x in a.ep.split(",")]
    tokens = [int(x) for x in a.tokens.split(",")]
    variants = _variants(a.variants)
    loads = issue29._all_loads()
    link = LinkModel()
    analytic = AnalyticCost()  # also what `auto` derives (R, D) from
    costs: dict = {}
    doc = {"date": datetime.date.today().isoformat(), "cost": a.cost, "counts": a.counts, "rows": []}
    a.out.mkdir(parents=True, exist_ok=True)
    for model, name, M in issue29.configs(eps, a.models.split(","), a.traces.split(",")):
        shape = MODEL_PRESETS[model]
        P = shape.num_experts + M
        t0 = time.perf_counter()
        base = plan_scale(loads[name], shape, M, P, WINDOW, INTERVAL, link, ("static", "deepseek", "default"))
        for tok in tokens:
            if (model, tok) not in costs:
                costs[model, tok] = make_cost(a.cost, shape, 1 + shape.num_experts // 8 + 1, tok)
            cost = costs[model, tok]
            choices = M * tok * shape.top_k
            seeds = range(a.seeds if a.counts == "poisson" else 1)

            def score(planned, opts=PlanOptions()):  # kind -> mean tokens/s over the seeds
                runs = [scale_replay(loads[name], shape, M, P, tok, WINDOW, INTERVAL, cost, link,
                                     planned=planned, opts=opts, counts=a.counts, seed=s).rows for s in seeds]
                return {k: float(np.mean([x[k].tokens_per_s for x in runs])) for k in runs[0]}

            ref = score(base)
            row = {"model": model, "trace": name, "ep": M, "tokens_per_gpu": tok, "seeds": len(seeds),
                   "default/deepseek": ref["default"] / ref["deepseek"],
                   "moves_default": _moves(base[1]["default"]), "reads": {}}
            line = (f"{model:<12} {name:<16} EP {M:>3} {tok:>4} tok/GPU  default/deepseek "
                    f"{row['default/deepseek']:.4f}")
            for v in variants:
                read, disp = analytic_tokens(shape, M, analytic, link) if v == "auto" else v
                opts = PlanOptions(read_tokens=read, step_choices=choices, dispatch_tokens=disp)
                pl = plan_scale(loads[name], shape, M, P, WINDOW, INTERVAL, link, ("static", "default"), opts=opts)
                ra = score(pl, opts)["default"]
                key = f"auto ({read:.0f}:{disp:.1f})" if v == "auto" else f"{read:g}:{disp:g}"
                row["reads"][key] = {"reads/deepseek": ra / ref["deepseek"],
                                     "reads/default": ra / ref["default"],
                                     "read_tokens": read, "dispatch_tokens": disp,
                                     "moves": _moves(pl[1]["default"])}
                line += (f" | {key}: /deepseek {ra / ref['deepseek']:.4f}"
                         f" /default {ra / ref['default']:.4f} moves "
                         f"{_moves(pl[1]['default']):.0f} ({row['moves_default']:.0f})")
            doc["rows"].append(row)
            print(line + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
            (a.out / "issue29_reads.json").write_text(json.dumps(doc) + "\n")
    if a.cost == "gpu":
        doc["gpu"] = {f"{m} {t}": c.stats() for (m, t), c in costs.items()}
        (a.out / "issue29_reads.json").write_text(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()
