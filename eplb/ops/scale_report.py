"""`eplb simulate TRACE --cost analytic|gpu`: tokens/s of each placement at EP 8 to 256.

The pieces are in `eplb.core.scale` (the replay), `eplb.core.cost_model` (link model,
analytic cost) and
`eplb.ops.gpu_cost` (the real kernel timed on a GPU); this module reads the options,
runs one replay per EP size with a progress bar, prints the tables and writes JSON and
the plot. `benchmarks/scale.py` runs the sweeps of benchmarks/README.md through it.
"""
from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from eplb.core.config import EplbConfig
from eplb.core.cost_model import MODEL_PRESETS, TOKEN_PRESETS, AnalyticCost, LinkModel, ModelShape
from eplb.core.planning import check_dispatch_tokens, check_read_tokens
from eplb.core.scale import COUNTS, PLACEMENTS, PlanOptions, ScaleResult, plan_scale, plans_per_kind, scale_replay
from eplb.ops.plots import plot_scale


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    """The options `eplb simulate` gains for `--cost`. Without it --counts is refused and
    the others are ignored; with it, the options only the balancedness replay reads
    (--start, --policy, ...) are refused (eplb.ops.simulate_report)."""
    g = p.add_argument_group("cost replay (--cost): tokens/s at large expert parallelism")
    g.add_argument("--cost", choices=["analytic", "gpu"], default=None,
                   help="score tokens/s instead of balancedness: expert work from a roofline at "
                        "stated rates (analytic) or from the grouped GEMM timed on this machine's GPU "
                        "(gpu); --num-gpus may then list several EP sizes, e.g. 8,16,32")
    g.add_argument("--model", choices=[*MODEL_PRESETS, "custom"], default="deepseek-v3",
                   help="model shape (default deepseek-v3; custom: give --hidden etc.)")
    for name, help_ in (("hidden", "H"), ("intermediate", "I of one routed expert"),
                        ("experts", "routed experts N (default: the trace's)"), ("top-k", "experts per token"),
                        ("moe-layers", "MoE layers of the model")):
        g.add_argument("--" + name, type=int, default=None, help=f"custom model: {help_}")
    g.add_argument("--tokens-per-gpu", default="decode",
                   help=f"tokens per GPU per step: a number or a preset "
                        f"({', '.join(f'{k} {v}' for k, v in TOKEN_PRESETS.items())}; default decode)")
    g.add_argument("--spare-slots-per-gpu", type=int, default=1,
                   help="with --cost and no --num-slots: slots = N + this x num_gpus (default 1)")
    g.add_argument("--layers", type=int, default=None,
                   help="replay this many trace layers, evenly spaced (default all)")
    g.add_argument("--placements", default=",".join(PLACEMENTS),
                   help=f"comma-separated, from {','.join(PLACEMENTS)} (static is always run)")
    g.add_argument("--gpus-per-node", type=int, default=LinkModel.gpus_per_node)
    g.add_argument("--intra-gbps", type=float, default=LinkModel.intra_GBps,
                   help=f"GB/s per GPU within a node (default {LinkModel.intra_GBps:g}: H200 NVLink raw "
                        "peer copy, measured)")
    g.add_argument("--inter-gbps", type=float, default=LinkModel.inter_GBps,
                   help=f"GB/s per GPU across nodes (default {LinkModel.inter_GBps:g})")
    g.add_argument("--transfer-efficiency", type=float, default=LinkModel.transfer_efficiency,
                   help="rebalance moves run at this fraction of the link (default "
                        f"{LinkModel.transfer_efficiency:g}, measured for the exchange of a partial layer move)")
    g.add_argument("--serving-steps", type=int, default=1000,
                   help="model steps one rebalance interval stands for; a rebalance's time is spread "
                        "over them (default 1000)")
    g.add_argument("--counts", choices=COUNTS, default="expected",
                   help="a step's token counts per slot: the expected counts, rounded (default), or "
                        "Poisson draws of them (decode: a cold slot is sometimes empty, sometimes reads "
                        "its weights)")
    g.add_argument("--tflops", type=float, default=AnalyticCost.tflops, help="analytic: bf16 TFLOP/s")
    g.add_argument("--hbm-tbps", type=float, default=AnalyticCost.hbm_TBps, help="analytic: HBM TB/s")


def model_shape(a: argparse.Namespace, trace_experts: int) -> ModelShape:
    if a.model != "custom":
        return MODEL_PRESETS[a.model]
    missing = [n for n in ("hidden", "intermediate", "top_k", "moe_layers") if getattr(a, n) is None]
    if missing:
        raise ValueError("--model custom needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    return ModelShape("custom", a.hidden, a.intermediate, a.experts or trace_experts, a.top_k, 1,
                      a.moe_layers)


def tokens_per_gpu(value: str) -> int:
    if value in TOKEN_PRESETS:
        return TOKEN_PRESETS[value]
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--tokens-per-gpu must be a number or one of {', '.join(TOKEN_PRESETS)}, "
                         f"got {value!r}") from None
    if n < 1:
        raise ValueError(f"--tokens-per-gpu must be >= 1, got {n}")
    return n


def pick_layers(trace: np.ndarray, k: int | None) -> np.ndarray:  # [T, L, N] -> [T, k, N]
    """k trace layers evenly spaced over the depth (all when k is None)."""
    L = trace.shape[1]
    if k is None or k >= L:
        return trace
    if k < 1:
        raise ValueError(f"--layers must be >= 1, got {k}")
    return trace[:, np.unique(np.linspace(0, L - 1, k).round().astype(int))]


def make_cost(kind: str, shape: ModelShape, max_slots: int, tokens: int,
              tflops: float = AnalyticCost.tflops, hbm_tbps: float = AnalyticCost.hbm_TBps,
              **gpu_options):
    """The expert cost of `--cost kind`: "analytic", `AnalyticCost(tflops, hbm_tbps)`; "gpu",
    a `GpuGemmCost` on CUDA sized for `max_slots` slots per GPU and `tokens` tokens per GPU
    per step (it grows on demand), given `gpu_options` (reps, max_measured, margin, ...)."""
    if kind == "analytic":
        return AnalyticCost(tflops, hbm_tbps)
    from eplb.ops.gpu_cost import GpuGemmCost
    return GpuGemmCost(shape, max_slots, 4 * tokens * shape.top_k, device="cuda", **gpu_options)


def run_cost(a: argparse.Namespace, trace: np.ndarray, source: str) -> int:
    """The `--cost` path of `eplb simulate` (trace already aggregated)."""
    from eplb.ops.progress import ProgressBar

    trace = pick_layers(trace, a.layers)
    T, L, Nt = trace.shape
    shape = model_shape(a, Nt)
    tokens = tokens_per_gpu(a.tokens_per_gpu)
    link = LinkModel(a.gpus_per_node, a.intra_gbps, a.inter_gbps, a.transfer_efficiency)
    Ms = list(a.num_gpus)
    if a.num_slots is not None and len(Ms) > 1:
        raise ValueError("--num-slots fits one EP size; with several, use --spare-slots-per-gpu")
    if a.spare_slots_per_gpu < 0:
        raise ValueError(f"--spare-slots-per-gpu must be >= 0, got {a.spare_slots_per_gpu}")
    slots = [a.num_slots if a.num_slots is not None else shape.num_experts + a.spare_slots_per_gpu * M
             for M in Ms]
    placements = [k for k in a.placements.split(",") if k]
    cost = make_cost(a.cost, shape, max(P // M for M, P in zip(Ms, slots)), tokens, a.tflops,
                     a.hbm_tbps)
    opts = PlanOptions(move_tolerance=a.move_tolerance, weighted=a.weighted_replicas,
                       decay=a.load_decay, min_gain=a.min_gain, shift_threshold=a.shift_threshold,
                       read_tokens=check_read_tokens(
                           EplbConfig.read_tokens if a.read_tokens is None else a.read_tokens, "--read-tokens"),
                       dispatch_tokens=check_dispatch_tokens(
                           EplbConfig.dispatch_tokens if a.dispatch_tokens is None else a.dispatch_tokens,
                           "--dispatch-tokens"),
                       tile_rows=check_read_tokens(
                           EplbConfig.tile_rows if a.tile_rows is None else a.tile_rows, "--tile-rows"),
                       control_interval=(EplbConfig.control_interval if a.control_interval is None
                                         else a.control_interval),
                       steady_windows=a.steady_windows, drift_trend=a.drift_trend)
    print(f"eplb simulate --cost {a.cost}: {source}: {T} steps x {L} layers x {Nt} experts as "
          f"{shape.name} (H {shape.hidden}, I {shape.intermediate}, N {shape.num_experts}, "
          f"top-{shape.top_k}, {shape.num_moe_layers} MoE layers); {tokens} tokens/GPU/step; window "
          f"{a.window_size}, interval {a.rebalance_interval} (= {a.serving_steps} model steps); "
          f"{a.counts} counts; {plan_options_text(opts)}")
    # one bar for the whole run: every scheduled plan (the slow part), then every scored step
    planned_kinds = sum(k not in ("static",) for k in placements)
    n_plans = plans_per_kind(T, a.rebalance_interval) * planned_kinds
    kinds = len(set(placements) | {"static"})
    total = len(Ms) * (n_plans + (T - a.rebalance_interval) * kinds)
    bar = ProgressBar(total, label="planning and scoring", lines=False)
    results: list[ScaleResult] = []
    for M, P in zip(Ms, slots):
        bar.update(0, suffix=f"EP {M}: planning")
        # reads and shift checks' routing noise are set against this EP size's choices per step
        opts = replace(opts, step_choices=float(M * tokens * shape.top_k))
        planned = plan_scale(trace, shape, M, P, a.window_size, a.rebalance_interval, link,
                             placements, opts=opts, progress=bar.update)
        bar.update(0, suffix=f"EP {M}: scoring")
        res = scale_replay(trace, shape, M, P, tokens, a.window_size, a.rebalance_interval, cost, link,
                           placements, a.serving_steps, a.min_gain, planned=planned,
                           progress=bar.update, opts=opts, counts=a.counts)
        results.append(res)
        bar.write(format_scale_table([res]))
    bar.close()
    if a.cost == "gpu":
        st = cost.stats()
        print(f"GPU ({st['device']}): {st['gemms_run']} grouped GEMMs timed, {st['cache_hits']} served "
              f"from the cache; the slot-sum estimate that picks each layer's slowest GPUs was off by "
              f"{100 * st['estimate_error_median']:.1f}% (median), {100 * st['estimate_error_max']:.1f}% "
              f"(max) from the measured times")
    if a.json:
        doc = {"date": datetime.date.today().isoformat(), "source": source, "cost": a.cost,
               "results": [r.to_dict() for r in results]}
        if a.cost == "gpu":
            doc["gpu"] = cost.stats()
        Path(a.json).write_text(json.dumps(doc) + "\n")
        print(f"wrote {a.json}")
    if a.plot:
        plot_scale(results, a.plot, title=f"{source}: {shape.name}, {tokens} tokens/GPU/step, cost {a.cost}")
        print(f"wrote {a.plot}")
    return 0


def plan_options_text(opts: PlanOptions) -> str:
    """The runtime settings a replay planned with, as the header shows them."""
    return (f"move tolerance {opts.move_tolerance:g}, weighted replicas "
            f"{'on' if opts.weighted else 'off'}, load decay {opts.decay:g}, min gain "
            f"{opts.min_gain:g}, shift threshold {opts.shift_threshold:g}"
            f"{' (off)' if opts.shift_threshold == 0 else ''}"
            f"{_checks_text(opts) if opts.shift_threshold > 0 else ''}"
            f", read tokens {opts.read_tokens:g}"
            f"{f' (dispatch tokens {opts.dispatch_tokens:g}, tile rows {opts.tile_rows:g})' if opts.read_tokens > 0 else ' (off)'}")


def _checks_text(opts: PlanOptions) -> str:
    steady = f"steady windows {opts.steady_windows}, drift trend {'on' if opts.drift_trend else 'off'}"
    if opts.control_interval == 0:
        return f" (no early rebalances: control interval 0; {steady})"
    return f" (checked every {opts.control_interval} model steps; {steady})"


def format_scale_table(results: Sequence[ScaleResult]) -> str:
    """One block per EP size: each placement's tokens/s, MoE layer time, gain over static,
    GPU-idle fraction and rebalance cost, and its tokens/s over deepseek's and the oracle's
    (the ratios the planner is judged by; '-' where that row was not run)."""
    lines = []
    for res in results:
        c = res.config
        lines.append(f"EP {c['num_gpus']} ({c['num_slots']} slots, {c['nodes']} node(s)), "
                     f"{c['tokens_per_gpu']} tokens/GPU/step, {c['scored_steps']} steps scored")
        lines.append(f"  {'placement':<17} {'tokens/s':>12} {'vs static':>9} {'/deepseek':>9} "
                     f"{'/oracle':>7} {'layer ms':>9} {'experts ms':>10} {'a2a ms':>7} {'idle':>6} "
                     f"{'moves ms/step':>13}")
        ref = {k: res.rows[k].tokens_per_s for k in ("deepseek", "oracle") if k in res.rows}
        for name, r in res.rows.items():
            ratio = [f"{r.tokens_per_s / ref[k]:.3f}" if k in ref else "-" for k in ("deepseek", "oracle")]
            lines.append(f"  {name:<17} {r.tokens_per_s:>12,.0f} {100 * res.gain_over_static(name):>+8.1f}% "
                         f"{ratio[0]:>9} {ratio[1]:>7} "
                         f"{r.layer_ms:>9.3f} {r.compute_ms:>10.3f} {r.exchange_ms:>7.3f} "
                         f"{100 * r.idle:>5.1f}% {r.rebalance_ms_per_step:>13.3f}")
    return "\n".join(lines)
