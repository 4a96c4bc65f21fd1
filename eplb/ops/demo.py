"""The demo job: the reference MoE model served under a skewed, drifting routing load,
rebalanced by EplbRuntime on schedule. One process per rank.

    eplb demo --nproc 4                                  # launches the ranks for you
    torchrun --nproc-per-node 4 -m eplb.ops.demo --steps 200 # the same job under torchrun
    eplb demo --model qwen3_moe --verify                 # a tiny transformers model (eplb.ops.demo_hf)

This is the application layer (with eplb.ops.demo_hf, the `eplb` modules that build a
`moe` model; eplb.ops.gpu_cost also imports `moe`, to time `moe.experts`' expert work):
the job's setup, its loop and its summary. The arguments and their checks, which
`eplb demo` reads before any rank starts, are eplb.ops.demo_args.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.ops.demo_args import (HF_BF16_TOLERANCE, HF_FP32_TOLERANCE, add_demo_arguments, check_demo_arguments,
                                 topk_groups)
from eplb.ops.settings_args import SettingsParser
from eplb.ops.progress import ProgressBar
from eplb.runtime import EplbFatalError, EplbRuntime
from eplb.core.workload import SkewedDriftWorkload, TraceWorkload, load_trace, routing_bias


def default_redundant(num_experts: int, world: int) -> int:
    """The demo's redundant slots: one per rank, rounded up so that N + R slots split
    evenly over the ranks (32 experts on 3 ranks: 4, for 36 slots)."""
    return world + (-(num_experts + world)) % world


def setup(a: argparse.Namespace, world: int):
    """EPLB config, model args and workload for `world` ranks; a one-line ValueError on bad
    input. Needs no process group: `eplb demo` calls it before launching any rank."""
    from moe import MoEArgs

    redundant = (default_redundant(a.experts, world) if a.num_redundant_experts is None
                 else a.num_redundant_experts)
    config = EplbConfig(num_redundant_experts=redundant, window_size=a.window_size,
                        rebalance_interval=a.rebalance_interval, policy=a.policy,
                        async_rebalance=a.async_rebalance, min_gain=a.min_gain,
                        load_decay=a.load_decay, move_tolerance=a.move_tolerance,
                        weighted_replicas=a.weighted_replicas, verify_transfers=a.verify_transfers,
                        transport=a.transport, exchange_launch=a.exchange_launch,
                        shift_threshold=a.shift_threshold, steady_windows=a.steady_windows,
                        drift_trend=a.drift_trend, control_interval=a.control_interval)
    config.verify(a.experts, world)  # config errors first: they name the EPLB fields
    if a.model:  # the transformers model is built on the ranks (eplb.ops.demo_hf)
        return config, None, None
    args = MoEArgs(hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
                   num_experts=a.experts, top_k=a.top_k, num_redundant_experts=redundant,
                   num_expert_groups=a.groups, topk_groups=topk_groups(a.groups),
                   dtype=a.dtype, seed=a.seed).validate(world)
    if a.trace:
        workload = TraceWorkload(load_trace(a.trace), a.layers, a.experts, window=a.trace_window)
    else:
        workload = SkewedDriftWorkload(a.layers, a.experts, zipf_s=a.skew,
                                       period=a.drift_period, seed=a.seed)
    return config, args, workload


def build(a: argparse.Namespace, group, device: torch.device):
    """Model, runtime, dense reference (for --verify) and workload for this rank."""
    from moe import DenseMoEModel, MoEModel

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    config, args, workload = setup(a, world)
    model = MoEModel(args, group=group, device=device)
    runtime = EplbRuntime(model, config, group=group)
    reference = DenseMoEModel(args, device=device) if a.verify else None
    return args, model, runtime, reference, workload


def verify(args, model, reference, runtime, x: torch.Tensor) -> tuple[float, int]:
    """(largest |EP output - dense reference| on this rank's batch, divided by the largest
        |reference| when that exceeds 1; slots whose weights differ bitwise from their
        logical expert's)."""
    from moe import expert_weights_for

    with torch.no_grad():
        want = reference(x).float()
        diff = (model(x).float() - want).abs().max().item() / max(1.0, want.abs().max().item())
    S = runtime.model.num_local_physical_experts
    p2l = runtime.placement.physical_to_logical  # [L, P]
    bad = 0
    for layer, weights in enumerate(runtime.expert_weights):
        for s in range(S):
            expert = int(p2l[layer, runtime.rank * S + s])
            want = expert_weights_for(args, layer, expert, device=x.device)
            bad += any(not torch.equal(w[s], v) for w, v in zip(weights, want))
    return diff, bad


class ReferenceJob:
    """The reference MoE model (`moe.MoEModel`) driven by the synthetic or trace workload
    through its router's selection bias; `--verify` compares it with the dense model."""

    def __init__(self, a: argparse.Namespace, group, device: torch.device):
        self.a, self.device = a, device
        self.args, self.model, self.runtime, self.reference, self.workload = build(a, group, device)
        self.gen = torch.Generator(device="cpu").manual_seed(a.seed * 100_003 + self.runtime.rank)
        self.tolerance = 1e-4 if self.args.dtype == torch.float32 else 2e-2  # bf16: ~3 significant digits
        self.x: torch.Tensor | None = None  # [T, H] this step's batch

    def describe(self) -> str:
        a, args = self.a, self.args
        return (f"{a.layers} MoE layers x {a.experts} experts "
                f"(top-{args.top_k}), {args.num_physical_experts} slots, {a.tokens} tokens/rank/step, "
                f"workload={'trace ' + a.trace if a.trace else 'synthetic drifting Zipf'}")

    def forward(self, step: int) -> float | None:
        """One forward of this step's batch; no per-step check (None)."""
        a, device = self.a, self.device
        bias = torch.from_numpy(routing_bias(self.workload.popularity(step), DEMO_BIAS_STRENGTH)).float()
        self.model.set_routing_bias(bias.to(device))
        if self.reference is not None:
            self.reference.set_routing_bias(bias.to(device))
        self.x = torch.randn(a.tokens, a.hidden, generator=self.gen).to(device=device, dtype=self.args.dtype)
        with torch.no_grad():
            self.model(self.x)
        return None

    def verify(self) -> tuple[float, int]:
        """After a rebalance: (output diff on this step's batch, bad slots), this rank's."""
        return verify(self.args, self.model, self.reference, self.runtime, self.x)

    def finish(self) -> tuple[str, bool, dict] | None:
        """The check at the end of the run: none here."""
        return None


def run(a: argparse.Namespace) -> int:
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if a.device == "cuda" \
        else torch.device("cpu")
    if a.model:
        from eplb.ops.demo_hf import HFJob

        config, _, _ = setup(a, world)
        tolerance = HF_BF16_TOLERANCE if a.dtype == "bfloat16" else HF_FP32_TOLERANCE
        job = HFJob(a, config, tolerance, group, device)
    else:
        job = ReferenceJob(a, group, device)
    runtime = job.runtime
    L, M, N = runtime.model.num_moe_layers, world, runtime.model.num_logical_experts
    static = Placement.initial(L, N, runtime.model.num_physical_experts, M)
    records, t_start = [], time.perf_counter()
    bar = ProgressBar(a.steps, label="demo") if rank == 0 else None
    if rank == 0:
        print(f"eplb demo: {world} ranks on {a.device}, {runtime.config.num_nodes} node{'s' if runtime.config.num_nodes != 1 else ''}, "
              f"{job.describe()}, policy={a.policy}, rebalance every {a.rebalance_interval} steps", flush=True)
    server = start_metrics(a, runtime, device)  # --metrics-port; collective
    for step in range(a.steps):
        step_diff = job.forward(step)  # all ranks agree on it (None: no per-step check)
        # measure this step before runtime.step() folds it into the window
        cur = torch.cat([runtime.expert_load_pass.view(L, M, -1).sum(-1),  # [L, M]
                         torch.zeros(L, N, dtype=torch.int64, device=device)
                         .scatter_add_(1, runtime.physical_to_logical, runtime.expert_load_pass)], 1)
        dist.all_reduce(cur)
        cur = cur.cpu().numpy()
        bal = balancedness_of_gpu_loads(cur[:, :M])  # [L] what EPLB achieved
        bal_static = static.balancedness(cur[:, M:])  # [L] the same step with no balancer
        if step_diff is not None and not step_diff <= job.tolerance:
            if rank == 0:
                bar.close()
                print(f"eplb demo: error: verification failed at step {step + 1}: max |diff| "
                      f"{step_diff:.1e} > tolerance {job.tolerance:.0e}", file=sys.stderr)
            return 1
        try:
            event = runtime.step()
        except EplbFatalError as e:
            print(f"eplb demo: error on rank {rank}: {e}", file=sys.stderr)
            return 3
        rec = {"step": step, "balancedness": bal.round(5).tolist(),
               "balancedness_static": bal_static.round(5).tolist(),
               "gpu_load": cur[:, :M].tolist(), "rebalance": None}  # gpu_load [L, M] tokens
        if a.model:  # its tests recompute the static baseline from the logical load
            rec["expert_load"] = cur[:, M:].tolist()  # [L, N] tokens
        if step_diff is not None:
            rec["verify_max_abs_diff"] = step_diff
        if event is not None:
            rec["rebalance"] = {
                "trigger": event.trigger, "experts_moved": event.experts_moved,
                "local_copies": event.local_copies, "bytes_moved": event.bytes_moved,
                "seconds": round(event.seconds, 6),
                "seconds_plan": round(event.seconds_plan, 6),
                "seconds_transfer": round(event.seconds_transfer, 6),
                "seconds_commit": round(event.seconds_commit, 6),
                "steps_in_flight": event.steps_in_flight,
                "balancedness_before": event.balancedness_before.round(5).tolist(),
                "balancedness_after_predicted": event.balancedness_after.round(5).tolist(),
            }
            rec["rebalance"].update(skipped=event.skipped, predicted_gain=event.predicted_gain,
                                    move_tolerance=event.move_tolerance, steady_layers=event.steady_layers,
                                    trend_layers=event.trend_layers)  # how it was planned
            line = demo_line(step, event, runtime.config.move_tolerance)
            if a.verify:
                diff, bad = job.verify()
                t = torch.tensor([diff, float(bad)], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                diff, bad = float(t[0]), int(t[1])
                rec["rebalance"]["verify_max_abs_diff"] = diff
                rec["rebalance"]["verify_bad_slots"] = bad
                ok = bad == 0 and diff <= job.tolerance
                line += f" | verify: max |diff| {diff:.1e}, bad slots {bad} {'OK' if ok else 'FAILED'}"
                if not ok:
                    if rank == 0:
                        bar.write(line)
                        print("eplb demo: error: verification failed after a rebalance", file=sys.stderr)
                    return 1
            if rank == 0:
                bar.write(line)
        records.append(rec)
        if rank == 0:
            bar.update(1, suffix=f"balancedness {bal.mean():.3f} (static {bal_static.mean():.3f})")
    runtime.finish_rebalance()  # every rank: an asynchronous rebalance still in flight ends here
    seconds = time.perf_counter() - t_start
    final = job.finish()  # collective: (line, ok, JSON record) or None
    if rank == 0:
        bar.close()
        summarize(records, seconds, a, job={"world_size": world, "num_nodes": runtime.config.num_nodes},
                  verify_line=final[0] if final else None, verify_record=final[2] if final else None)
    if final is not None and not final[1]:
        if rank == 0:
            print("eplb demo: error: verification failed at the end of the run", file=sys.stderr)
        return 1
    if server is not None:  # rank 0
        if a.metrics_hold > 0:
            print(f"eplb demo: serving {server.url}/metrics for {a.metrics_hold:g} s more", flush=True)
            try:
                time.sleep(a.metrics_hold)
            except KeyboardInterrupt:
                pass
        server.stop()
    runtime.close()
    return 0


def demo_line(step: int, event, move_tolerance: float = 0.0) -> str:
    """The demo's line for a rebalance event (`step` counts from 0, the line from 1). A
    rebalance not on the schedule names its trigger ("rebalance (shift)": early, after a
    load shift); a plan made with move tolerance 0 where the config's `move_tolerance` is
    above 0 (a shift or a drift), on earlier steady windows or on the drift trend says so
    at the end."""
    head = f"step {step + 1:5d} rebalance" + ("" if event.trigger == "interval" else f" ({event.trigger})")
    if event.skipped:
        return f"{head} " + event.describe().split(") ", 1)[1]
    return (f"{head}: balancedness {event.balancedness_before.mean():.3f}"
            f" -> {event.balancedness_after.mean():.3f} (predicted), "
            f"{event.experts_moved} experts moved, {event.bytes_moved / 1e6:.2f} MB, "
            f"{event.seconds * 1e3:.1f} ms"
            + (f" over {event.steps_in_flight} steps" if event.steps_in_flight else "")
            + (", move tolerance 0" if event.move_tolerance == 0 and move_tolerance > 0 else "")
            + event.layers_note())


def start_metrics(a: argparse.Namespace, runtime: EplbRuntime, device: torch.device):
    """With --metrics-port: metrics on every rank (rank 0 aggregates), the HTTP server on
    rank 0; returns it there, None elsewhere. Collective: if rank 0 cannot bind, every
    rank stops with one line."""
    if a.metrics_port is None:
        return None
    from eplb.ops.metrics import EplbMetrics
    from eplb.ops.server import EplbServer

    metrics = EplbMetrics(runtime, interval=a.metrics_interval,
                          per_expert_replicas=a.metrics_replicas,
                          per_layer_gpu_load=a.metrics_per_layer)
    server, error = None, ""
    if runtime.rank == 0:
        try:
            server = EplbServer(runtime, metrics, host=a.metrics_host, port=a.metrics_port,
                                token_file=a.token_file).start()
        except (OSError, ValueError) as e:
            error = (f"--metrics-port {a.metrics_port}: cannot serve on {a.metrics_host}: "
                     f"{getattr(e, 'strerror', None) or e}")
    ok = torch.tensor([0 if error else 1], dtype=torch.int64, device=device)
    dist.broadcast(ok, src=0)
    if not ok.item():
        raise ValueError(error or "rank 0 could not start the metrics server")
    if server is not None:
        trigger = ("POST /rebalance with the bearer token" if server.trigger_enabled else
                   "POST /rebalance disabled (no token: use --token-file or $EPLB_TOKEN)")
        print(f"eplb demo: metrics at {server.url}/metrics; {trigger}", flush=True)
    return server


def summarize(records: list[dict], seconds: float, a: argparse.Namespace,
              job: dict | None = None, verify_line: str | None = None,
              verify_record: dict | None = None) -> None:
    """Print the before/after figures (and `verify_line`) and write --json (with
    `verify_record` under "verify")."""
    first = next((r["step"] for r in records if r["rebalance"]), None)
    bal = np.array([np.mean(r["balancedness"]) for r in records])
    static = np.array([np.mean(r["balancedness_static"]) for r in records])
    events = [r["rebalance"] for r in records if r["rebalance"]]
    skipped = sum(bool(e.get("skipped")) for e in events)
    print(f"{len(records)} steps in {seconds:.1f} s, {len(events)} rebalances"
          + (f" ({skipped} skipped)" if skipped else "") + ", "
          f"{sum(e['experts_moved'] for e in events)} experts moved, "
          f"{sum(e['bytes_moved'] for e in events) / 1e6:.2f} MB, "
          f"{sum(e['seconds'] for e in events) * 1e3:.1f} ms rebalancing")
    if first is not None and first + 1 < len(records):
        after = slice(first + 1, None)
        print(f"mean balancedness (mean/max GPU load, 1.0 = perfect) after the first rebalance: "
              f"EPLB {bal[after].mean():.4f} vs static placement {static[after].mean():.4f} "
              f"(imbalance max/mean {1 / bal[after].mean():.3f} vs {1 / static[after].mean():.3f})")
    if verify_line:
        print(verify_line)
    if a.json:
        out = {"args": {k: v for k, v in vars(a).items() if k != "func"}, "run": job or {},
               "steps": records}
        if verify_record is not None:
            out["verify"] = verify_record
        with open(a.json, "w") as f:
            json.dump(out, f)
        print(f"wrote {a.json}")


# strength of log-popularity in the router's selection bias. Router scores are softmax
# probabilities (~1/N); chosen so that the synthetic workload's hottest expert is a few
# times the mean, as in the real ESFT and OLMoE traces (measured by
# benchmarks/diag/hf_bf16_gap.py, benchmarks/README.md "Demo constants").
DEMO_BIAS_STRENGTH = 0.015


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m eplb.ops.demo` (one rank)."""
    p = SettingsParser(prog="python -m eplb.ops.demo", description=__doc__)
    add_demo_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (`python -m eplb.ops.demo` under torchrun or `eplb demo`)."""
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_demo_arguments(a)
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike: one message
            print(f"eplb demo: error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank once one exits: let rank 0 say why first
            time.sleep(3.0)
        return 2
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    try:
        return run(a)
    except ValueError as e:
        if dist.get_rank() == 0:
            print(f"eplb demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
