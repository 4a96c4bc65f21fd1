"""`eplb simulate TRACE` (without --cost): replay the trace under the policies with
eplb.core.simulate, print the per-policy table, write the JSON and the plot
(eplb.ops.plots). `--cost` goes on to eplb.ops.scale_report. Bad input raises ValueError,
which eplb.ops.cli prints as one line, exit 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from eplb.core.planning import check_load_decay
from eplb.core.simulate import PolicyResult, SimulationResult, aggregate_steps, rebalance_steps, simulate
from eplb.core.workload import load_trace
from eplb.ops.plots import plot_simulation
from eplb.ops.progress import ProgressBar

FEW_TOKENS = 100  # below this many tokens per step and layer, a trace looks like shares


def run_simulate(a: argparse.Namespace) -> int:
    for opt, path in (("--json", a.json), ("--plot", a.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{opt}: directory does not exist: {Path(path).parent}")
    check_load_decay(a.load_decay, "--load-decay")  # here: the cost replay has no check of its own
    if a.cost:
        _refuse_unused_with_cost(a)
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'eplb[plot]' (or pip install matplotlib)")
    raw = load_trace(a.trace)  # [T, L, N]
    trace = aggregate_steps(raw, a.aggregate)  # [T // A, L, N]
    T, L, N = trace.shape
    dropped = raw.shape[0] - T * a.aggregate
    if a.cost:
        from eplb.ops.scale_report import run_cost
        return run_cost(a, trace, a.trace if a.aggregate == 1 else f"{a.trace} (aggregate {a.aggregate})")
    if len(a.num_gpus) != 1:
        raise ValueError("--num-gpus lists several EP sizes only with --cost")
    for opt, value in (("--read-tokens", a.read_tokens), ("--dispatch-tokens", a.dispatch_tokens),
                       ("--tile-rows", a.tile_rows)):
        if value is not None:
            raise ValueError(f"{opt} needs --cost (the tokens per step come from --tokens-per-gpu)")
    if a.control_interval is not None:
        raise ValueError("--control-interval needs --cost (without it a trace step is not a count of "
                         "model steps; shift checks run after every step)")
    if a.counts != "expected":
        raise ValueError("--counts needs --cost (without it there are no token counts, only loads)")
    if a.num_slots is None:
        raise ValueError("--num-slots is required (without --cost)")
    a.num_gpus = a.num_gpus[0]
    start = a.start if a.start is not None else a.rebalance_interval
    n_plans = len(rebalance_steps(T, a.rebalance_interval, start)) * len(a.policy) * (1 if a.no_oracle else 2)
    bar = ProgressBar(n_plans, label="simulate") if n_plans >= 50 else None
    result = simulate(trace, a.num_gpus, a.num_slots, a.window_size, a.rebalance_interval,
                      policies=a.policy, num_nodes=a.num_nodes, num_groups=a.num_groups,
                      decay=a.load_decay, move_tolerance=a.move_tolerance,
                      weighted=a.weighted_replicas, min_gain=a.min_gain, shift_threshold=a.shift_threshold,
                      steady_windows=a.steady_windows, drift_trend=a.drift_trend,
                      bytes_per_expert=a.bytes_per_expert, start=a.start, oracle=not a.no_oracle,
                      progress=bar.update if bar else None)
    if bar:
        bar.close()
    cfg = result.config
    steps_desc = (f"{raw.shape[0]} steps" if a.aggregate == 1 else
                  f"{raw.shape[0]} entries summed in groups of {a.aggregate} -> {T} steps"
                  + (f" (last {dropped} dropped)" if dropped else ""))
    trend = "on" if a.drift_trend else "off"
    print(f"eplb simulate: {a.trace}: {steps_desc}, {L} layers x {N} experts; {a.num_gpus} GPUs, "
          f"{a.num_slots} slots, {a.num_nodes} node(s), {a.num_groups} group(s); window {a.window_size}, "
          f"interval {a.rebalance_interval}, decay {a.load_decay:g}, move tolerance "
          f"{a.move_tolerance:g}, min gain {a.min_gain:g}, shift threshold {a.shift_threshold:g}"
          f"{f' (steady windows {a.steady_windows}, drift trend {trend})' if a.shift_threshold > 0 else ''}"
          f"{', weighted' if a.weighted_replicas else ''}")
    print(f"{len(cfg['rebalance_steps'])} rebalances per policy; steps {cfg['start']}..{T - 1} scored")
    if a.shift_threshold > 0 and float(trace.sum(-1).mean()) < FEW_TOKENS:
        print(f"note: the trace's steps hold {float(trace.sum(-1).mean()):.3g} tokens per layer on average "
              f"(shares, not counts?): shift checks weigh routing noise by these counts, so few tokens "
              f"hide any shift; give token counts", file=sys.stderr)
    print(format_table(result))
    if a.json:
        d = result.to_dict()
        d["trace"] = {"source": a.trace, "entries": int(raw.shape[0]), "aggregate": a.aggregate,
                      "dropped": int(dropped)}
        Path(a.json).write_text(json.dumps(d) + "\n")
        print(f"wrote {a.json}")
    if a.plot:
        title = (f"{a.trace}: {steps_desc}\n{a.num_gpus} GPUs, {a.num_slots} slots, window {a.window_size}, "
                 f"interval {a.rebalance_interval}, decay {a.load_decay:g}")
        plot_simulation(result, a.plot, title=title,
                    step_label="step" if a.aggregate == 1 else f"step ({a.aggregate} trace entries each)")
        print(f"wrote {a.plot}")
    return 0


# options of the balancedness replay that the cost replay never reads: (flag, field,
# default, what --cost does instead)
_NOT_WITH_COST = (
    ("--start", "start", None, "it plans from --rebalance-interval on"),
    ("--policy", "policy", ["default"], "choose with --placements"),
    ("--num-nodes", "num_nodes", 1, "nodes are --gpus-per-node GPUs each"),
    ("--num-groups", "num_groups", 1, "the --model shape gives the expert groups"),
    ("--bytes-per-expert", "bytes_per_expert", None, "the --model shape sizes the experts"),
    ("--no-oracle", "no_oracle", False, "choose with --placements"),
)


def _refuse_unused_with_cost(a: argparse.Namespace) -> None:
    """--cost: refuse an option it would silently ignore (set to anything but its default)."""
    for flag, name, default, instead in _NOT_WITH_COST:
        if getattr(a, name) != default:
            raise ValueError(f"{flag} has no effect with --cost ({instead}); drop {flag}")


def result_rows(result: SimulationResult) -> list[tuple[str, PolicyResult]]:
    """Rows in print order: none, then each policy followed by its oracle."""
    rows = [("none", result.none)]
    for name, res in result.policies.items():
        rows.append((name, res))
        if name in result.oracle:
            rows.append((f"oracle:{name}", result.oracle[name]))
    return rows


def format_table(result: SimulationResult) -> str:
    """The per-policy table `eplb simulate` prints."""
    head = (f"{'policy':<22} {'mean':>6} {'median':>6} {'p95':>6} {'in-smpl':>7} "
            f"{'skipped':>7} {'moved/rebal':>11} {'%slots':>6} {'remote':>7} {'%slots':>6} {'MB/rebal':>9} "
            f"{'plan ms':>8}")
    lines = ["imbalance = max/mean GPU load per layer, mean over layers, per scored step "
             "(out of sample); in-smpl = the planning window on the new placement;",
             "skipped = rebalances that gained less than min gain (nothing moved) / all; "
             "moved = slots whose expert changed per rebalance,",
             "remote = experts received from another GPU per rebalance (% of all L x P slots); "
             "plan ms = median.", head, "-" * len(head)]
    for label, res in result_rows(result):
        sm = res.summary()
        cells = [f"{label:<22}", f"{sm['mean']:>6.3f}", f"{sm['median']:>6.3f}", f"{sm['p95']:>6.3f}"]
        if sm["rebalances"]:
            mb = sm["bytes_moved_mean"]
            cells += [f"{sm['predicted_mean']:>7.3f}", f"{sm['skipped']}/{sm['rebalances']}".rjust(7),
                      f"{sm['slots_changed_mean']:>11.1f}",
                      f"{sm['slots_changed_pct']:>5.1f}%", f"{sm['experts_moved_mean']:>7.1f}",
                      f"{100 * sm['experts_moved_mean'] / res.total_slots:>5.1f}%",
                      f"{'-' if mb is None else format(mb / 1e6, '.1f'):>9}",
                      f"{sm['plan_ms_median']:>8.1f}"]
        else:
            cells += [f"{'-':>{w}}" for w in (7, 7, 11, 6, 7, 6, 9, 8)]
        lines.append(" ".join(cells))
    if result.config.get("shift_threshold", 0) > 0:
        tol = result.config.get("move_tolerance", 0.0)
        lines += [line for name, res in result.policies.items() if (line := planning_line(name, res, tol))]
    return "\n".join(lines)


def planning_line(name: str, res: PolicyResult, move_tolerance: float) -> str:
    """How shift-aware planning planned one policy's rebalances, e.g. `default: 1 early
    rebalance after a load shift; 3 of 9 plans with move tolerance 0 (a shift or a drift);
    layers planned with earlier steady windows 44%, on the drift trend 0%` ("" without
    rebalances; the tolerance part only when the configured `move_tolerance` is above 0)."""
    sm = res.summary()
    if not sm["rebalances"]:
        return ""
    early = sm["early"]
    zero = (f"{sm['tolerance_zero']} of {sm['rebalances']} plans with move tolerance 0 (a shift or a drift); "
            if move_tolerance > 0 else "")
    return (f"{name}: {early} early rebalance{'' if early == 1 else 's'} after a load shift; {zero}"
            f"layers planned with earlier steady windows {100 * sm['steady_layer_share']:.0f}%, "
            f"on the drift trend {100 * sm['trend_layer_share']:.0f}%")
