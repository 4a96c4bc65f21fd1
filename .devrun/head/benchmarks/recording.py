"""Load recording overhead: MoE forward time with load counting on vs off, and proof that
the recording path makes no host synchronisation.

    python benchmarks/recording.py          # one GPU, realistic size (bf16, grouped GEMM)
    python benchmarks/recording.py --cpu    # tiny, on the CPU (smoke; no sync check)

One process, no EP group (every slot on this device: dispatch is a local permutation),
so the forward is the model's whole MoE compute and nothing else. Measured, each as the
median over `--iters` iterations, variants interleaved so drift hits them alike:

  off          model(x) with `model.set_record_load(False)`
  on           model(x) with load counting (one [P] add per layer of the slot histogram
               dispatch computes anyway)
  on + step    model(x) then `runtime.step()` (the recorder folds the counts into its
               window: a scatter, a sum and a zero per step)
  separate     `record_load` as its own pass per layer (a scatter_add of T*K ones: what
               counting costs when it is not fused into dispatch), timed alone

On CUDA each variant is timed with CUDA events, eagerly and as a replayed CUDA graph (no
launch overhead, so the difference is the device work alone). Overhead = (on - off) /
off. Sync check: `torch.cuda.set_sync_debug_mode("error")` around the recording ops
(the [P] add and `runtime.step()`) and around the whole forward + step; a synchronising
call would raise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb.core.config import EplbConfig  # noqa: E402
from eplb.runtime import EplbRuntime  # noqa: E402
from moe import MoEArgs, MoEModel, sample_tokens  # noqa: E402
from moe.dispatch import count_slots, map_to_physical, record_load  # noqa: E402

GPU_DEFAULTS = dict(layers=2, hidden=4096, intermediate=1408, experts=64, redundant=8, top_k=8,
                    tokens=8192, iters=40, dtype="bfloat16")
CPU_DEFAULTS = dict(layers=2, hidden=64, intermediate=32, experts=64, redundant=8, top_k=8,
                    tokens=512, iters=20, dtype="float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU")
    for name in GPU_DEFAULTS:
        if name != "dtype":
            p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                           help=f"default {GPU_DEFAULTS[name]} (--cpu: {CPU_DEFAULTS[name]})")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument("--bias", type=float, default=0.05, help="std of a random routing bias (skew)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    a = p.parse_args(argv)
    for name, value in (CPU_DEFAULTS if a.cpu else GPU_DEFAULTS).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    for name in ("layers", "hidden", "intermediate", "experts", "top_k", "tokens", "iters"):
        if getattr(a, name) < 1:
            raise SystemExit(f"recording: --{name.replace('_', '-')} must be >= 1")
    return a


class Timer:
    """Times a callable: CUDA events on a GPU, perf_counter on the CPU (milliseconds)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)


def interleaved_medians(variants: dict, iters: int, timer: Timer) -> dict[str, float]:
    """Median ms of each callable, run round-robin `iters` times after two warm-up rounds."""
    samples = {name: [] for name in variants}
    for i in range(iters + 2):
        for name, fn in variants.items():
            ms = timer(fn)
            if i >= 2:
                samples[name].append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


def graph_of(fn):
    """Capture fn() in a CUDA graph (after a side-stream warm-up); returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sync_check(model: MoEModel, runtime: EplbRuntime, x: torch.Tensor) -> dict[str, str]:
    """Run the recording ops, then a whole forward + step, under sync debug mode 'error'."""
    layer = model.moe_layers[0]
    ids, _ = layer.router(model.layers[0].norm(x))
    physical = map_to_physical(ids, layer.logical_to_physical_map, layer.logical_replica_count,
                               layer.logical_replica_cdf)  # [T, K]
    counts = count_slots(physical, layer.num_physical_experts)  # [P] what dispatch computes
    torch.cuda.synchronize()
    out = {}
    checks = {
        "recording ops (load view add, runtime.step)":
            lambda: (layer.expert_load_view.add_(counts), runtime.step()),
        "whole forward + runtime.step": lambda: (model(x), runtime.step()),
    }
    for name, fn in checks.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            out[name] = "no host sync"
        except RuntimeError as e:
            out[name] = f"SYNC: {' '.join(str(e).split())[:200]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device("cpu" if a.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("recording: no CUDA device (use --cpu for the small CPU mode)")
    args = MoEArgs(hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
                   num_experts=a.experts, top_k=a.top_k, num_redundant_experts=a.redundant,
                   dtype=a.dtype).validate(1)
    t0 = time.perf_counter()
    model = MoEModel(args, device=device)
    seconds_init = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    model.set_routing_bias((torch.randn(a.layers, a.experts, generator=g) * a.bias).to(device))
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=a.redundant, window_size=64,
                                            rebalance_interval=0, control_interval=0))
    x = sample_tokens(args, a.tokens, seed=1, device=device)
    timer = Timer(device)

    def fwd_on():
        model.set_record_load(True)
        model(x)

    def fwd_off():
        model.set_record_load(False)
        model(x)

    def fwd_on_step():
        model.set_record_load(True)
        model(x)
        runtime.step()

    # the separate-pass counting, alone: the slot ids of every layer, counted again
    physical = []
    for block in model.layers:
        ids, _ = block.moe.router(block.norm(x))
        physical.append(map_to_physical(ids, block.moe.logical_to_physical_map,
                                        block.moe.logical_replica_count,
                                        block.moe.logical_replica_cdf))  # [T, K]
    scratch = torch.zeros(a.layers, args.num_physical_experts, dtype=torch.int64, device=device)

    def separate():
        for i, ids in enumerate(physical):
            record_load(scratch[i], ids)

    eager = interleaved_medians({"off": fwd_off, "on": fwd_on, "on + step": fwd_on_step,
                                 "separate": separate}, a.iters, timer)
    results = {"eager": eager}
    if device.type == "cuda":
        graphs = {}
        model.set_record_load(False)
        graphs["off"] = graph_of(lambda: model(x))
        model.set_record_load(True)  # captured with counting: the graph keeps its ops
        graphs["on"] = graph_of(lambda: model(x))
        graphs["on + step"] = graph_of(lambda: (model(x), runtime.recorder.record(
            runtime.expert_load_pass, runtime.physical_to_logical)))
        graphs["separate"] = graph_of(separate)
        results["graph"] = interleaved_medians(graphs, a.iters, timer)
        runtime.expert_load_pass.zero_()
        results["sync_check"] = sync_check(model, runtime, x)

    name = "cpu" if a.cpu else torch.cuda.get_device_name(0)
    print(f"recording: {name}, {a.layers} MoE layers, H={a.hidden}, I={a.intermediate}, "
          f"N={a.experts} (top-{a.top_k}), P={args.num_physical_experts} slots on one device, "
          f"{str(args.dtype).removeprefix('torch.')}, {a.tokens} tokens, {a.iters} iterations "
          f"(median); model init {seconds_init:.1f} s")
    print(f"{'timing':<7} {'off ms':>9} {'on ms':>9} {'on+step ms':>11} {'separate ms':>12} "
          f"{'overhead on':>12} {'on+step':>9} {'separate':>9}")
    summary = {}
    for kind, m in results.items():
        if kind == "sync_check":
            continue
        over = 100 * (m["on"] - m["off"]) / m["off"]
        over_step = 100 * (m["on + step"] - m["off"]) / m["off"]
        sep = 100 * m["separate"] / m["off"]
        summary[kind] = dict(m, overhead_on_pct=over, overhead_on_step_pct=over_step,
                             separate_pct=sep)
        print(f"{kind:<7} {m['off']:>9.3f} {m['on']:>9.3f} {m['on + step']:>11.3f} "
              f"{m['separate']:>12.4f} {over:>11.3f}% {over_step:>8.3f}% {sep:>8.3f}%")
    for check, verdict in results.get("sync_check", {}).items():
        print(f"sync check, {check}: {verdict}")
    worst = max(s["overhead_on_step_pct"] for s in summary.values())
    print(f"recording overhead (forward + step, worst of the timings): {worst:.3f}% "
          f"(target <= 1%: {'met' if worst <= 1.0 else 'NOT met'})")
    record = {"benchmark": "recording", "date": datetime.date.today().isoformat(),
              "device": name, "torch": torch.__version__, "args": vars(a), "results": summary,
              "sync_check": results.get("sync_check")}
    print("RECORDING_JSON " + json.dumps(record))
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
