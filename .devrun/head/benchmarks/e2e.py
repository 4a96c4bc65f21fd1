"""End to end: MoE forward throughput over expert parallelism under a skewed real trace,
with static placement, with EPLB (rebalancing on its recorded window) and with an oracle
placement planned on the load of the coming interval.

    python benchmarks/e2e.py                      # 2 GPUs (NCCL), realistic size, sync EPLB
    python benchmarks/e2e.py --mode async         # EPLB rebalancing in the background
    torchrun --nproc-per-node 2 benchmarks/e2e.py # the same under torchrun
    python benchmarks/e2e.py --cpu                # tiny, 2 gloo ranks on the CPU (smoke)

Workload: the packaged ESFT trace (`eplb.core.workload`, as the demo replays it); step t uses
the popularity of trace entries [t*stride, t*stride + trace_window), so popularity drifts
across the trace's four tasks, turned into a router selection bias (strength * log p; the
demo's strength, at which the realised expert load follows the trace's popularity). Model
layer l replays trace layer l * L_trace // L, a sample spread over the traced model's depth.
Every mode sees the same steps: the same bias and the same tokens (seeded per rank and
step), so the routing is the same whatever the placement.

Modes, in this order:
  static  the start-up placement all along; its realised logical load per step
          (all ranks summed) is kept for the oracle
  oracle  at every interval start, the placement the same planner makes from the realised
          load of that interval's coming steps (planned before timing; moving the weights
          is timed)
  eplb    EplbRuntime rebalancing every `interval` steps on its last `window` steps
          (`--mode sync`: inside step(); `--mode async`: EplbConfig(async_rebalance=True))

Timing: per step, wall time from the forward's start to the end of runtime.step() (and
the oracle's weight move), with a synchronize of the compute stream at the end of every
step (in this benchmark only), the slower rank's time per step. The first `warmup` steps (default one
interval: EPLB's first window) are run in every mode but not timed. tokens/s = tokens of
all ranks over the timed steps / their summed step time. Each step is flagged if a
rebalance ran in it or was in flight across it (`runtime.rebalance_in_flight`); the
summary compares step times with and without one.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb.core.config import EplbConfig  # noqa: E402
from eplb.ops.demo import DEMO_BIAS_STRENGTH  # noqa: E402
from eplb.core.placement import Placement, balancedness_of_gpu_loads  # noqa: E402
from eplb.core.planning import plan  # noqa: E402
from eplb.runtime import EplbRuntime  # noqa: E402
from eplb.ops.launch import launch_command  # noqa: E402
from eplb.core.workload import TraceWorkload, load_trace, routing_bias  # noqa: E402
from moe import MoEArgs, MoEModel  # noqa: E402

GPU_DEFAULTS = dict(layers=4, hidden=4096, intermediate=1408, experts=64, redundant=8, top_k=8,
                    tokens=8192, steps=150, interval=25, dtype="bfloat16")
CPU_DEFAULTS = dict(layers=2, hidden=64, intermediate=32, experts=64, redundant=8, top_k=8,
                    tokens=256, steps=12, interval=4, dtype="float32")
MODES = ("static", "oracle", "eplb")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU, tiny sizes")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--mode", choices=["sync", "async"], default="sync",
                   help="EPLB rebalancing inside step() (sync) or in the background (async)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"which placements to run, comma-separated (default {','.join(MODES)}; "
                        "oracle needs static)")
    for name in ("layers", "hidden", "intermediate", "experts", "redundant", "top_k", "tokens",
                 "steps", "interval"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {GPU_DEFAULTS[name]} (--cpu: {CPU_DEFAULTS[name]})")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default: interval)")
    p.add_argument("--window", type=int, default=None, help="EPLB window (default: interval)")
    p.add_argument("--trace", default="esft", help="trace name or .npy/.npz [T, L, N]")
    p.add_argument("--trace-window", type=int, default=32, help="trace entries per step")
    p.add_argument("--trace-stride", type=int, default=1, help="trace entries the window moves per step")
    p.add_argument("--bias-strength", type=float, default=DEMO_BIAS_STRENGTH)
    p.add_argument("--policy", default="default")
    p.add_argument("--min-gain", type=float, default=EplbConfig.min_gain,
                   help="EplbConfig.min_gain (0: every plan that differs moves, so a "
                        "rebalance is in flight at every interval)")
    p.add_argument("--planner", choices=["process", "thread"], default="process",
                   help="async mode: rank 0 plans in a child process (default) or in the "
                        "rebalance thread (EplbConfig.planner_process)")
    p.add_argument("--transport", choices=["nccl", "ipc", "auto"], default="nccl",
                   help="EplbConfig.transport (default nccl, the runtime's default)")
    p.add_argument("--exchange-launch", choices=["auto", "thread", "step"], default="auto",
                   help="async mode: EplbConfig.exchange_launch")
    p.add_argument("--weighted", action="store_true", help="weighted replicas (EPLB and oracle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    p.add_argument("--watchdog", type=float, default=0, metavar="SECONDS",
                   help="dump every thread's stack and exit if a rank runs longer (0 = off)")
    a = p.parse_args(argv)
    defaults = CPU_DEFAULTS if a.cpu else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.warmup = a.interval if a.warmup is None else a.warmup
    a.window = a.interval if a.window is None else a.window
    a.modes = [m for m in a.modes.split(",") if m]
    for name in ("layers", "hidden", "intermediate", "experts", "top_k", "tokens", "steps",
                 "interval", "window", "trace_window", "trace_stride", "nproc"):
        if getattr(a, name) < 1:
            raise SystemExit(f"e2e: --{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0 or a.redundant < 0:
        raise SystemExit("e2e: --warmup and --redundant must be >= 0")
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        raise SystemExit(f"e2e: --modes: unknown {bad}, choose from {list(MODES)}")
    if "oracle" in a.modes and "static" not in a.modes:
        raise SystemExit("e2e: --modes: oracle plans on the load the static run measures; add static")
    if a.mode == "async":
        fields = {f.name for f in dataclasses.fields(EplbConfig)}
        if "async_rebalance" not in fields or not hasattr(EplbRuntime, "rebalance_in_flight"):
            raise SystemExit("e2e: --mode async needs EplbConfig(async_rebalance=...) and "
                             "EplbRuntime.rebalance_in_flight, which this eplb does not have yet")
    return a


def _sync(device: torch.device) -> None:
    """Wait for this step's work on the compute stream (not for a background rebalance's
    side stream: its transfers overlapping the step are the point of async mode)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _in_flight(runtime: EplbRuntime) -> bool:
    return bool(getattr(runtime, "rebalance_in_flight", False))


class Run:
    """One rank's model, workload and per-step inputs, shared by all modes."""

    def __init__(self, a: argparse.Namespace, device: torch.device):
        self.a, self.device = a, device
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.args = MoEArgs(hidden_size=a.hidden, intermediate_size=a.intermediate,
                            num_layers=a.layers, num_experts=a.experts, top_k=a.top_k,
                            num_redundant_experts=a.redundant, dtype=a.dtype,
                            seed=a.seed).validate(self.world)
        t0 = time.perf_counter()
        self.model = MoEModel(self.args, group=self.group, device=device)
        self.seconds_init = time.perf_counter() - t0
        L, N = a.layers, a.experts
        self.P = self.args.num_physical_experts
        self.S = self.P // self.world
        self.total = a.warmup + a.steps
        trace = load_trace(a.trace)  # [T_trace, L_trace, N]
        Lt = trace.shape[1]
        workload = TraceWorkload(trace, Lt, N, window=a.trace_window)
        self.trace_layers = [l * Lt // L for l in range(L)]  # spread over the traced depth
        bias = np.stack([routing_bias(workload.popularity(t * a.trace_stride)[self.trace_layers],
                                      a.bias_strength) for t in range(self.total)])  # [T, L, N]
        self.bias = torch.from_numpy(bias).float().to(device)  # [T, L, N]
        self.gen = torch.Generator(device=device)
        self.initial = Placement.initial(L, N, self.P, self.world)

    def tokens(self, step: int) -> torch.Tensor:  # [T_rank, H] the same in every mode
        self.gen.manual_seed(self.a.seed * 1_000_003 + self.rank * 10_007 + step)
        return torch.randn(self.a.tokens, self.a.hidden, generator=self.gen, device=self.device,
                           dtype=self.args.dtype)

    def config(self, interval: int, asynchronous: bool) -> EplbConfig:
        kw = dict(num_redundant_experts=self.a.redundant, window_size=self.a.window,
                  rebalance_interval=interval, policy=self.a.policy, control_interval=0,
                  weighted_replicas=self.a.weighted, num_nodes=1, transport=self.a.transport,
                  min_gain=self.a.min_gain)
        if asynchronous:
            kw["async_rebalance"] = True
            kw["planner_process"] = self.a.planner == "process"
            kw["exchange_launch"] = self.a.exchange_launch
        return EplbConfig(**kw)

    def run_mode(self, mode: str, runtime: EplbRuntime, plans: dict[int, Placement] | None = None
                 ) -> dict:
        """All steps under one placement strategy; per-step times and loads on the device."""
        L, N, M, S = self.a.layers, self.a.experts, self.world, self.S
        dev = self.device
        seconds = torch.zeros(self.total, dtype=torch.float64, device=dev)  # [T]
        flags = torch.zeros(self.total, 2, dtype=torch.int64, device=dev)  # [T] (rebalanced, in flight)
        gpu_load = torch.zeros(self.total, L, M, dtype=torch.int64, device=dev)  # [T, L, M]
        logical = torch.zeros(self.total, L, N, dtype=torch.int64, device=dev)  # [T, L, N]
        moves = np.zeros((self.total, 2))  # [T] (experts moved, rebalance seconds) of events ending then
        step_call = np.zeros(self.total)  # [T] host seconds inside runtime.step() (the step loop's share)
        fwd_call = np.zeros(self.total)  # [T] host seconds of the forward call (kernel launches)
        tags: list[str] = [""] * self.total  # [T] what the rebalance in flight did at this step
        for t in range(self.total):
            x = self.tokens(t)
            self.model.set_routing_bias(self.bias[t])
            _sync(dev)
            flight_before = _in_flight(runtime)
            events_before = len(runtime.events)
            t0 = time.perf_counter()
            if plans is not None and t in plans:
                runtime.apply_placement(plans[t], trigger="oracle")
            self.model(x)
            fwd_call[t] = time.perf_counter() - t0
            change = getattr(runtime, "_change", None)  # diagnostics only: the change in flight
            planning = change is not None and change.ready < 0
            committed = change.committed if change is not None else 0
            load = runtime.expert_load_pass  # [L, P] this step's counts, before step() folds them
            gpu_load[t] = load.view(L, M, S).sum(-1)
            logical[t] = torch.zeros(L, N, dtype=torch.int64, device=dev).scatter_add_(
                1, runtime.physical_to_logical, load)
            t1 = time.perf_counter()
            runtime.step()
            step_call[t] = time.perf_counter() - t1
            _sync(dev)
            seconds[t] = time.perf_counter() - t0
            new_events = runtime.events[events_before:]
            moves[t] = (sum(e.experts_moved for e in new_events), sum(e.seconds for e in new_events))
            rebalanced = bool(new_events)
            flags[t, 0] = int(rebalanced)
            flags[t, 1] = int(flight_before or _in_flight(runtime))
            after = getattr(runtime, "_change", None)
            tags[t] = "+".join(name for name, hit in (
                ("start", not flight_before and (rebalanced or after is not None)),
                ("planning", planning),
                ("switch", rebalanced or (after is not None and after is change
                                          and after.committed > committed)),
                ("finish", rebalanced and flight_before)) if hit)
        finish = getattr(runtime, "finish_rebalance", None)
        if finish is not None:
            finish()
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(gpu_load, group=self.group)
        dist.all_reduce(logical, group=self.group)
        return {"seconds": seconds.cpu().numpy(), "flags": flags.cpu().numpy(),
                "gpu_load": gpu_load.cpu().numpy(), "logical": logical.cpu().numpy(),
                "moves": moves, "step_call": step_call, "fwd_call": fwd_call, "tags": tags,
                "events": [e.summary() for e in runtime.events]}

    def oracle_plans(self, logical: np.ndarray) -> dict[int, Placement]:  # step -> placement
        """At each interval start, plan on the realised load [steps in the interval, L, N]."""
        plans, previous = {}, self.initial
        for start in range(0, self.total, self.a.interval):
            future = logical[start:start + self.a.interval].sum(0).astype(np.float64)  # [L, N]
            previous = plan(future, self.world, self.P, 1, 1, self.a.policy, previous=previous,
                            move_tolerance=EplbConfig.move_tolerance, weighted=self.a.weighted)
            plans[start] = previous
        return plans


def summarize(a: argparse.Namespace, run: Run, results: dict[str, dict]) -> dict:
    """Figures over the timed steps of every mode."""
    timed = slice(a.warmup, None)
    tokens_per_step = a.tokens * run.world
    out = {}
    for mode, r in results.items():
        sec = r["seconds"][timed]
        flags = r["flags"][timed]
        flight = (flags[:, 0] > 0) | (flags[:, 1] > 0)
        bal = np.array([balancedness_of_gpu_loads(g).mean() for g in r["gpu_load"][timed]])
        quiet = sec[~flight]
        busy = sec[flight]
        call = r["step_call"][timed]  # this rank's (rank 0's) host time in runtime.step()
        out[mode] = {
            "tokens_per_s": tokens_per_step * len(sec) / sec.sum(),
            "step_ms_median": 1e3 * float(np.median(sec)),
            "step_ms_median_no_rebalance": 1e3 * float(np.median(quiet)) if len(quiet) else None,
            "step_ms_median_in_flight": 1e3 * float(np.median(busy)) if len(busy) else None,
            "step_ms_max_in_flight": 1e3 * float(busy.max()) if len(busy) else None,
            "steps_in_flight": int(flight.sum()),
            "step_call_ms_median_no_rebalance": 1e3 * float(np.median(call[~flight])) if len(quiet) else None,
            "step_call_ms_median_in_flight": 1e3 * float(np.median(call[flight])) if len(busy) else None,
            "step_call_ms_max_in_flight": 1e3 * float(call[flight].max()) if len(busy) else None,
            # every step, the untimed warm-up too (it starts the first rebalance): one-off costs
            "step_call_ms_max_all_steps": 1e3 * float(r["step_call"].max()),
            "step_call_argmax_all_steps": int(r["step_call"].argmax()),
            "balancedness": float(bal.mean()),
            "rebalances": int(flags[:, 0].sum()),
            "experts_moved": int(r["moves"][timed, 0].sum()),
            "rebalance_seconds": float(r["moves"][timed, 1].sum()),
            # rank 0's step loop, per rebalance event (asynchronous mode: advance() calls)
            "step_loop_ms_max": 1e3 * max((e["max_step_loop_seconds"] for e in r["events"]), default=0.0),
            "step_loop_ms_total": 1e3 * sum(e["seconds_step_loop"] for e in r["events"]),
            "agree_wait_ms_total": 1e3 * sum(e["seconds_agree_wait"] for e in r["events"]),
            "switch_ms_total": 1e3 * sum(e["seconds_commit"] for e in r["events"]),
            # the slowest steps with a rebalance in flight: (step, step ms (slower rank),
            # rank 0's forward call ms and runtime.step() ms, what the rebalance did)
            "slowest_in_flight": [
                (int(a.warmup + i), 1e3 * float(sec[i]), 1e3 * float(r["fwd_call"][a.warmup + i]),
                 1e3 * float(call[i]), r["tags"][a.warmup + i])
                for i in np.flatnonzero(flight)[np.argsort(-sec[flight])][:5]],
        }
    return out


def report(a: argparse.Namespace, run: Run, summary: dict, seconds_total: float) -> None:
    dev = "cpu (gloo)" if a.cpu else f"{torch.cuda.get_device_name(0)} x{run.world} (NCCL)"
    bytes_per_expert = 3 * a.hidden * a.intermediate * run.args.dtype.itemsize
    print(f"e2e: {run.world} ranks on {dev}, {a.layers} MoE layers, H={a.hidden}, I={a.intermediate}, "
          f"N={a.experts} experts (top-{a.top_k}), P={run.P} slots ({run.S} per rank), "
          f"{str(run.args.dtype).removeprefix('torch.')}, {a.tokens} tokens/rank/step, "
          f"{bytes_per_expert / 2**20:.1f} MiB/expert; trace {a.trace} layers {run.trace_layers} "
          f"window {a.trace_window} "
          f"stride {a.trace_stride}, bias strength {a.bias_strength}; interval {a.interval}, "
          f"window {a.window}, warm-up {a.warmup} + {a.steps} timed steps; policy {a.policy}"
          f"{' weighted' if a.weighted else ''}; EPLB mode {a.mode}"
          f"{f' (planner in a {a.planner}, exchanges launched: {a.exchange_launch})' if a.mode == 'async' else ''}, "
          f"transport {a.transport}; "
          f"model init {run.seconds_init:.1f} s; total {seconds_total:.1f} s")
    head = (f"{'placement':<8} {'tokens/s':>12} {'vs static':>9} {'balancedness':>12} "
            f"{'step ms':>8} {'rebalances':>10} {'moved':>6}")
    print(head)
    print("-" * len(head))
    base = summary.get("static", {}).get("tokens_per_s")
    for mode, s in summary.items():
        rel = f"{s['tokens_per_s'] / base:.3f}" if base else "-"
        print(f"{mode:<8} {s['tokens_per_s']:>12,.0f} {rel:>9} {s['balancedness']:>12.4f} "
              f"{s['step_ms_median']:>8.2f} {s['rebalances']:>10d} {s['experts_moved']:>6d}")
    if "eplb" in summary and "oracle" in summary:
        ratio = summary["eplb"]["tokens_per_s"] / summary["oracle"]["tokens_per_s"]
        print(f"EPLB / oracle tokens/s: {ratio:.4f} (target >= 0.95: "
              f"{'met' if ratio >= 0.95 else 'NOT met'})")
    if "eplb" in summary:
        s = summary["eplb"]
        if s["step_ms_median_in_flight"] is not None:
            delta = s["step_ms_median_in_flight"] - s["step_ms_median_no_rebalance"]
            print(f"EPLB ({a.mode}) step time: median {s['step_ms_median_no_rebalance']:.2f} ms "
                  f"with no rebalance in flight, {s['step_ms_median_in_flight']:.2f} ms over "
                  f"{s['steps_in_flight']} steps with one (+{delta:.2f} ms), max "
                  f"{s['step_ms_max_in_flight']:.2f} ms "
                  f"(async target: +<=1 ms median, <=5 ms max over the no-rebalance median: "
                  f"max delay {s['step_ms_max_in_flight'] - s['step_ms_median_no_rebalance']:.2f} ms)")
            print(f"  of which inside runtime.step() (rank 0, host): median "
                  f"{s['step_call_ms_median_no_rebalance']:.3f} ms with no rebalance in flight, "
                  f"{s['step_call_ms_median_in_flight']:.3f} ms with one, max "
                  f"{s['step_call_ms_max_in_flight']:.3f} ms; over all steps, warm-up included: max "
                  f"{s['step_call_ms_max_all_steps']:.3f} ms (step {s['step_call_argmax_all_steps']})")
            if a.mode == "async":
                print(f"  rebalance work in the step loop (rank 0, all rebalances): "
                      f"{s['step_loop_ms_total']:.2f} ms in total, longest step "
                      f"{s['step_loop_ms_max']:.3f} ms; of the total: waiting for agreements "
                      f"{s['agree_wait_ms_total']:.2f} ms, switching layers {s['switch_ms_total']:.2f} ms")
            print("  slowest steps in flight (step: step ms, rank 0 forward call ms, "
                  "runtime.step() ms, what the rebalance did): " + "; ".join(
                      f"{t}: {ms:.2f}, {f:.2f}, {c:.2f}, {tag or '-'}"
                      for t, ms, f, c, tag in s["slowest_in_flight"]))


def worker(a: argparse.Namespace) -> int:
    rank = dist.get_rank()
    device = torch.device("cpu") if a.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    t_start = time.perf_counter()

    def progress(what: str) -> None:
        if rank == 0:
            print(f"e2e: {what} ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr, flush=True)

    run = Run(a, device)
    progress("model built")
    results = {}
    runtime = EplbRuntime(run.model, run.config(0, False), group=run.group)
    if "static" in a.modes:
        results["static"] = run.run_mode("static", runtime)
        progress("static done")
    if "oracle" in a.modes:
        plans = run.oracle_plans(results["static"]["logical"])
        results["oracle"] = run.run_mode("oracle", runtime, plans)
        runtime.apply_placement(run.initial, trigger="reset")  # EPLB starts where static did
        progress("oracle done")
    if "eplb" in a.modes:
        eplb = EplbRuntime(run.model, run.config(a.interval, a.mode == "async"), group=run.group)
        results["eplb"] = run.run_mode("eplb", eplb)
        progress(f"eplb ({a.mode}) done")
    if "eplb" in results and "static" in results:  # same tokens and bias: same routing
        same = np.abs(results["eplb"]["logical"] - results["static"]["logical"]).sum() / max(
            1, results["static"]["logical"].sum())
        if rank == 0 and same > 0.01:
            print(f"e2e: warning: EPLB's routing differs from static's by {same:.2%} of the "
                  f"(token, k) choices", file=sys.stderr)
    summary = summarize(a, run, results)
    if rank == 0:
        report(a, run, summary, time.perf_counter() - t_start)
        record = {"benchmark": "e2e", "date": datetime.date.today().isoformat(),
                  "args": {k: v for k, v in vars(a).items()}, "world": run.world,
                  "device": "cpu" if a.cpu else torch.cuda.get_device_name(0),
                  "torch": torch.__version__, "results": summary}
        if "eplb" in summary and "oracle" in summary:
            record["eplb_over_oracle"] = summary["eplb"]["tokens_per_s"] / summary["oracle"]["tokens_per_s"]
        print("E2E_JSON " + json.dumps(record))
        if a.json:
            Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


def main_rank(argv: list[str] | None) -> int:
    a = parse_args(argv)
    if a.watchdog > 0:
        import faulthandler

        faulthandler.dump_traceback_later(a.watchdog, exit=True)
    torch.set_num_threads(1 if a.cpu else 4)
    if not a.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if a.cpu else "nccl")
    try:
        return worker(a)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        return main_rank(argv)
    a = parse_args(argv)  # check the arguments once, before starting ranks
    if not a.cpu and torch.cuda.device_count() < a.nproc:
        raise SystemExit(f"e2e: needs {a.nproc} GPUs, {torch.cuda.device_count()} visible (or --cpu)")
    # one process per rank with torchrun's variables, as `eplb demo --nproc` starts them
    return launch_command([sys.executable, str(Path(__file__).resolve()), *argv], a.nproc)


if __name__ == "__main__":
    sys.exit(main())
