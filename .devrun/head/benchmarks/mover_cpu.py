"""Host-side cost of moving layers through the runtime, on CPU ranks (gloo): what the
layer mover's bookkeeping (planning the transfer, staging, agreeing, switching maps)
costs per rebalance and per step, with weights small enough that copying them is cheap.

    python benchmarks/mover_cpu.py                      # this checkout
    python benchmarks/mover_cpu.py --tree /path/to/other/checkout --json out.json

It starts `--ranks` gloo processes on 127.0.0.1 with a reference MoE model, then:
  sync   `runtime.apply_placement(new)` (synchronous) alternating between two placements
         that change every layer on every rank: median and max ms per rebalance;
  async  the same moves with `wait=False` and `runtime.step()` until done: steps per
         move, median of the per-step host time spent in the change (RebalanceEvent
         seconds_step_loop / steps) and its max (max_step_loop_seconds).
Only public names (`from eplb import ...`) are used, so `--tree` can point at an older
checkout of this project to compare the two side by side on the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from eplb import EplbConfig, EplbRuntime
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
                   num_experts=a.experts, top_k=2, num_redundant_experts=a.redundant, seed=0)
    model = MoEModel(args, group=dist.group.WORLD)
    results = {}
    for mode in ("sync", "async"):
        cfg = EplbConfig(num_redundant_experts=a.redundant, rebalance_interval=0,
                         async_rebalance=mode == "async")
        runtime = EplbRuntime(model, cfg)
        start = runtime.placement
        p2l = start.physical_to_logical
        S = p2l.shape[1] // world
        other = start.with_physical_to_logical(np.roll(p2l, S // 2 + 1, axis=1), start.policy)
        times, per_step, max_step, steps = [], [], [], []
        for i in range(a.moves):
            target = other if i % 2 == 0 else start
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sync":
                event = runtime.apply_placement(target)
            else:
                runtime.apply_placement(target, wait=False)
                event = None
                for _ in range(10 * a.layers + 100):
                    event = runtime.step()
                    if event is not None:
                        break
                    time.sleep(a.step_seconds)
                assert event is not None, "asynchronous move did not finish"
                per_step.append(event.seconds_step_loop / max(1, event.steps_in_flight))
                max_step.append(event.max_step_loop_seconds)
                steps.append(event.steps_in_flight)
            times.append(time.perf_counter() - t0)
            assert event.experts_moved > 0
        runtime.close()
        r = {"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times)}
        if mode == "async":
            r.update(steps_median=statistics.median(steps),
                     step_loop_ms_median=1e3 * statistics.median(per_step),
                     step_loop_ms_max=1e3 * max(max_step))
        results[mode] = r
    if rank == 0:
        import eplb

        results["eplb_file"] = eplb.__file__  # which checkout the ranks imported
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]),
                   help="checkout whose eplb and moe to import (default: this one)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--redundant", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=32)
    p.add_argument("--moves", type=int, default=20)
    p.add_argument("--step-seconds", type=float, default=0.002,
                   help="sleep between steps in async mode, standing in for a forward")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    sys.path.insert(0, a.tree)
    os.environ["PYTHONPATH"] = os.pathsep.join([a.tree, os.environ.get("PYTHONPATH", "")])
    import tempfile

    import torch.multiprocessing as mp

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(_rank, args=(a.ranks, _free_port(), a, out), nprocs=a.ranks,
                       start_method="spawn")
    res = json.loads(Path(out).read_text())
    res["tree"], res["args"] = a.tree, {k: v for k, v in vars(a).items() if k not in ("json", "tree")}
    print(f"{res['eplb_file']}: sync {res['sync']['median_ms']:.1f} ms median ({res['sync']['max_ms']:.1f} max) "
          f"per rebalance; async {res['async']['steps_median']:.0f} steps, step loop "
          f"{res['async']['step_loop_ms_median']:.2f} ms median per step "
          f"({res['async']['step_loop_ms_max']:.2f} max)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
