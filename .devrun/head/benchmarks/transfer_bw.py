"""Expert-weight transfer bandwidth: raw peer copy vs one layer of experts, 2 or more ranks.

One command, one run (it starts its own processes):

    python benchmarks/transfer_bw.py              # 2 GPUs, NCCL, DeepSeek-V3-sized experts
    python benchmarks/transfer_bw.py --nproc 8    # all-ranks mode: 8 GPUs send and receive at once
    python benchmarks/transfer_bw.py --cpu        # 2 CPU ranks on gloo, tiny sizes (a check)
    python benchmarks/transfer_bw.py --cpu --nproc 4 --experts 16

It measures, in the same run:

(a) raw peer copy cuda:0 -> cuda:1 of 2 GiB (`tensor.copy_`, median of several runs);
(b) moving one layer of experts between the two ranks: per expert w13 `[2I, H]` and w2
    `[H, I]` (bf16; DeepSeek-V3: H = 7168, I = 2048, 256 experts, so S = 128 local slots
    and ~11.3 GB per rank), for two placement changes, each applied back and forth:
    `swap` (every expert changes rank) and `partial` (a random ~25% of each rank's slots
    trade experts with the other rank);
    with the executor before this change (`legacy`: one message per tensor per expert,
    all in one `batch_isend_irecv`) and the new transports (`nccl` coalesced and chunked,
    at several chunk sizes; `ipc` pulls through CUDA IPC into staging, then the write;
    `ipc-move`: `IpcTransport.move`, the synchronous in-place pass with a hold buffer,
    timed as a whole: what `execute_layer_transfer` and a synchronous rebalance do).

Per method and case it prints the median time of `exchange_layer` (the network phase,
what an asynchronous rebalance overlaps with serving) and of the whole layer (exchange +
write), the per-direction GB/s (bytes one rank receives / time; both directions run at
once), the ratio to (a), the peak extra GPU memory (`torch.cuda.max_memory_allocated` over
the allocated weights, staging included) next to one layer of local experts, and checks
that every slot ends bitwise equal to its expert. Then one JSON line with everything.

All-ranks mode (`--nproc N`, N > 2): the experts are spread over N ranks (S = experts / N
each) and every rank sends and receives at once: `swap` moves every expert to the next
rank, `random` gives --partial of every rank's slots an expert of another rank (random
peers). Besides the slowest rank's figures it reports each rank's GB/s (bytes it received
/ the slowest rank's time, min-max in the table) and the aggregate (all bytes / that time),
against the raw peer copy cuda:0 -> cuda:1.
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

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb.core.transfer_plan import plan_layer_transfer  # noqa: E402
from eplb.runtime.ipc import IpcTransport  # noqa: E402
from eplb.runtime.transfer import exchange_layer, execute_layer_transfer  # noqa: E402
from eplb.runtime.staging import allocate_staging, write_layer  # noqa: E402
from eplb.runtime.transport_choice import make_transport  # noqa: E402
from eplb.runtime.transports import (  # noqa: E402
    DEFAULT_CHUNK_BYTES,
    DEFAULT_HOLD_CHUNK_BYTES,
    P2PTransport,
)

INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parse_bytes(text: str) -> int:
    """'64M' -> 67108864; suffixes K, M, G (powers of 1024)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


# ---- weights whose bits say which expert they hold --------------------------------------

def _base(shape, itemsize: int, device) -> torch.Tensor:  # [*shape] integer pattern
    r = torch.arange(shape[0], device=device, dtype=torch.int64)[:, None]
    c = torch.arange(shape[1], device=device, dtype=torch.int64)[None, :]
    return ((r * 7 + c) % 64).to(INT_OF[itemsize])


def fill(w: torch.Tensor, experts: np.ndarray, base: torch.Tensor) -> None:
    """Slot s gets bits `expert * 64 + base` (finite bf16/float values, unique per expert)."""
    wi = w.view(INT_OF[w.element_size()])
    for s, e in enumerate(experts.tolist()):
        wi[s].copy_(base + e * 64)


def count_bad(w: torch.Tensor, experts: np.ndarray, base: torch.Tensor) -> int:
    wi = w.view(INT_OF[w.element_size()])
    return sum(not torch.equal(wi[s], base + e * 64) for s, e in enumerate(experts.tolist()))


# ---- the executor before this change, kept here as the baseline -----------------------

def legacy_exchange(plan, weights, group, staging) -> int:
    """Phases 1-2 of the old `execute_layer_transfer`: one message per tensor per expert."""
    for k in np.flatnonzero(plan.stage_src_slot >= 0).tolist():
        for w, b in zip(weights, staging):
            b[k].copy_(w[int(plan.stage_src_slot[k])])
    p2p, received = [], 0
    for kind, peer, _expert, idx in plan.p2p_ops():
        for w, b in zip(weights, staging):
            if kind == "send":
                p2p.append(dist.P2POp(dist.isend, w[idx], peer, group))
            else:
                p2p.append(dist.P2POp(dist.irecv, b[idx], peer, group))
                received += b[idx].nbytes
    if p2p:
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
    return received


def legacy_write(plan, weights, staging) -> None:
    for dst, src, st in zip(plan.write_dst.tolist(), plan.write_src.tolist(),
                            plan.write_from_stage.tolist()):
        for w, b in zip(weights, staging):
            w[dst].copy_(b[src] if st else w[src])


# ---- one rank -----------------------------------------------------------------------------

def raw_peer_copy(nbytes: int, iters: int) -> float:
    """Median GB/s of `dst.copy_(src)` from cuda:0 to cuda:1 (run by rank 0 alone)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i >= 2:  # the first two enable peer access and warm up
            times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def placements(S: int, frac: float, seed: int, world: int = 2) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`[P]` old and new rows. On 2 ranks: every expert swaps rank (`swap`); or k = frac * S
    random slots per rank trade experts with random slots of the other rank (`partial`).
    On `world` > 2 ranks (the all-ranks mode): every expert moves to the next rank
    (`swap`, a ring); or k random slots of every rank each take an expert of another rank
    (`random`): every rank sends and receives at once."""
    if world > 2:
        return {"swap": (np.arange(world * S), np.roll(np.arange(world * S), S)),
                "random": random_change(S, frac, seed, world)}
    old = np.arange(2 * S)
    swap = np.concatenate([old[S:], old[:S]])
    rng = np.random.default_rng(seed)
    k = max(1, round(frac * S))
    a = rng.choice(S, k, replace=False)  # rank 0's slots
    b = S + rng.choice(S, k, replace=False)  # rank 1's slots, paired with a
    partial = old.copy()
    partial[a], partial[b] = old[b], old[a]
    return {"swap": (old, swap), "partial": (old, partial)}


def random_change(S: int, frac: float, seed: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """k = frac * S random slots per rank, their experts shuffled so that each of these
    slots gets an expert from another rank (a random permutation, then conflicts swapped
    away; bounded). Returns (old [P], new [P]) with old = arange(P)."""
    rng = np.random.default_rng(seed)
    k = max(1, round(frac * S))
    old = np.arange(world * S)
    chosen = np.concatenate([r * S + rng.choice(S, k, replace=False) for r in range(world)])  # [W*k]
    experts = chosen[rng.permutation(chosen.size)]  # [W*k] expert for each chosen slot
    for _ in range(100 * chosen.size):  # repair: no slot takes an expert of its own rank
        bad = np.flatnonzero(experts // S == chosen // S)
        if bad.size == 0:
            break
        i, j = bad[0], rng.integers(chosen.size)
        if experts[j] // S != chosen[i] // S and experts[i] // S != chosen[j] // S:
            experts[i], experts[j] = experts[j], experts[i]
    else:
        raise RuntimeError("could not build the random change")
    new = old.copy()
    new[chosen] = experts
    return old, new


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.current_stream().synchronize()


def worker(rank: int, world: int, port: int, cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = not cfg["cpu"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1 if not cuda else 4)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            device_id=device if cuda else None)
    group = dist.group.WORLD
    out = {"config": cfg, "torch": torch.__version__, "host": socket.gethostname(),
           "results": [], "raw_peer_copy_GBps": None}
    try:
        if cuda:
            out["device"] = torch.cuda.get_device_name(device)
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            if rank == 0 and cfg["raw_bytes"]:
                out["raw_peer_copy_GBps"] = raw_peer_copy(cfg["raw_bytes"], cfg["raw_iters"])
            dist.barrier()
        _layers(rank, device, group, cfg, out)
        if cuda:  # IPC shutdown order: mappings closed everywhere, then free, then collect
            dist.barrier()
            torch.cuda.synchronize(device)
            torch.cuda.ipc_collect()
            dist.barrier()
    finally:
        if rank == 0:
            _report(out)
        dist.destroy_process_group()


def _layers(rank: int, device, group, cfg: dict, out: dict) -> None:
    cuda = device.type == "cuda"
    W = cfg["world"]
    S, H, I = cfg["experts"] // W, cfg["hidden"], cfg["intermediate"]
    dtype = getattr(torch, cfg["dtype"])
    w13 = torch.empty(S, 2 * I, H, dtype=dtype, device=device)  # [S, 2I, H]
    w2 = torch.empty(S, H, I, dtype=dtype, device=device)  # [S, H, I]
    weights = [w13, w2]
    bases = [_base(w.shape[1:], w.element_size(), device) for w in weights]
    layer_bytes = sum(w.nbytes for w in weights)  # one layer of local experts
    expert_bytes = layer_bytes // S
    cases = placements(S, cfg["partial"], cfg["seed"], W)
    local = slice(rank * S, (rank + 1) * S)

    methods: list[tuple[str, object]] = []  # (name, transport or a factory of one)
    for m in cfg["methods"]:
        if m == "legacy":
            methods.append(("legacy", None))
        elif m == "nccl":
            methods += [(f"nccl@{c >> 20}M" if c >= 1 << 20 else f"nccl@{c}B", P2PTransport(c))
                        for c in cfg["chunks"]]
        elif m in ("ipc", "auto"):  # set up when its turn comes (collective)
            methods.append((m, lambda m=m: make_transport(m, [weights], group)))
        elif m == "ipc-move":  # one per hold chunk size
            methods += [(f"ipc-move@{c >> 20}M", lambda c=c: IpcTransport([weights], group, hold_chunk_bytes=c))
                        for c in cfg["hold_chunks"]]
    side = torch.cuda.Stream(device) if cuda else None

    if rank == 0:
        _header(out)
    made = []  # transports to close before the weights go
    for name, transport in methods:
        if callable(transport):
            try:
                transport = transport()
            except RuntimeError as e:
                out.setdefault("unavailable", {})[name] = str(e)
                continue
            made.append(transport)
            if name == "auto":
                out["auto_picks"] = type(transport).__name__
                continue
        for case, (old, new) in cases.items():
            rows = (old, new)
            plans = [plan_layer_transfer(rows[d], rows[1 - d], W, rank) for d in (0, 1)]
            for w, base in zip(weights, bases):
                fill(w, old[local], base)
            sync(cuda)
            if cuda:
                torch.cuda.empty_cache()
                base_mem = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            in_place = name.startswith("ipc-move")  # one in-place pass: no exchange/write split
            # S rows, as the executors keep it (the in-place move has its hold buffer)
            staging = None if in_place else allocate_staging(weights)
            t_ex, t_all, received = [], [], 0
            n_iter = cfg["warmup"] + cfg["iters"]
            n_iter += n_iter % 2  # even: the weights end on the old placement
            for it in range(n_iter):
                plan = plans[it % 2]
                dist.barrier()
                sync(cuda)
                t0 = time.perf_counter()
                if in_place:
                    received = execute_layer_transfer(plan, weights, group, transport=transport)
                    sync(cuda)
                    t1 = t2 = time.perf_counter()
                elif cuda:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # as the asynchronous runtime calls it
                        received = _exchange(name, transport, plan, weights, group, staging)
                    side.synchronize()
                else:
                    received = _exchange(name, transport, plan, weights, group, staging)
                if not in_place:
                    t1 = time.perf_counter()
                    if transport is not None:
                        transport.settle(plan, group)
                        write_layer(plan, weights, staging)
                    else:
                        legacy_write(plan, weights, staging)
                    sync(cuda)
                    t2 = time.perf_counter()
                both = torch.tensor([t1 - t0, t2 - t0], dtype=torch.float64, device=device)
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                if it >= cfg["warmup"]:
                    t_ex.append(float(both[0]))
                    t_all.append(float(both[1]))
            peak = (torch.cuda.max_memory_allocated(device) - base_mem) if cuda else None
            if peak is not None:  # the IPC transport's hold buffer, allocated with it
                peak += getattr(transport, "hold_bytes", 0)
            del staging
            bad = sum(count_bad(w, old[local], base) for w, base in zip(weights, bases))
            bad_all = torch.tensor([bad, received], dtype=torch.int64, device=device)
            dist.all_reduce(bad_all)
            per_rank = torch.zeros(W, dtype=torch.int64, device=device)  # bytes each rank received
            per_rank[rank] = received
            dist.all_reduce(per_rank)
            ex, full = statistics.median(t_ex), statistics.median(t_all)
            raw = out["raw_peer_copy_GBps"]
            res = {
                "method": name, "case": case, "experts_received": plans[0].num_received,
                "bytes_received": received, "exchange_ms": None if in_place else ex * 1e3,
                "full_ms": full * 1e3,
                "exchange_GBps": None if in_place else received / ex / 1e9,
                "full_GBps": received / full / 1e9,
                "messages": getattr(transport, "last_messages", None) if transport is not None
                else 2 * len(plans[0].p2p_ops()),
                "pack_bytes": getattr(transport, "last_pack_bytes", None),
                "peak_extra_bytes": peak, "layer_bytes": layer_bytes, "expert_bytes": expert_bytes,
                "bad_slots_all_ranks": int(bad_all[0]), "iters": len(t_ex),
                # all ranks: bytes each received over the slowest rank's time, and their sum
                "per_rank_full_GBps": [b / full / 1e9 for b in per_rank.tolist()],
                "aggregate_full_GBps": int(bad_all[1]) / full / 1e9,
            }
            if raw:
                res["exchange_ratio"] = None if in_place else res["exchange_GBps"] / raw
                res["full_ratio"] = res["full_GBps"] / raw
            out["results"].append(res)
            if rank == 0:
                _row(res)
    for t in made:
        if hasattr(t, "close"):
            t.close()
    methods, made, transport = [], [], None
    dist.barrier()  # every rank dropped its mappings of the peer's weights


def _exchange(name, transport, plan, weights, group, staging) -> int:
    if transport is None:
        return legacy_exchange(plan, weights, group, staging)
    return exchange_layer(plan, weights, group, staging, transport=transport)


def _header(out: dict) -> None:
    raw = out["raw_peer_copy_GBps"]
    cfg = out["config"]
    print(f"# transfer_bw: {out.get('device', 'cpu/gloo')} x{cfg['world']}, torch {out['torch']}, "
          f"nccl {out.get('nccl', '-')}; experts {cfg['experts']} (S={cfg['experts'] // cfg['world']}), "
          f"H={cfg['hidden']}, I={cfg['intermediate']}, {cfg['dtype']}")
    print(f"(a) raw peer copy cuda:0 -> cuda:1, {cfg['raw_bytes'] / 2**30:g} GiB: "
          + (f"{raw:.1f} GB/s" if raw else "n/a"))
    print("| method | case | experts in | GB in | exchange ms | exchange GB/s | x raw | "
          "layer ms | layer GB/s | x raw | messages | peak extra GB | one layer GB | bad slots | "
          "per-rank layer GB/s min-max | all ranks GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)


def _row(r: dict) -> None:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    peak = None if r["peak_extra_bytes"] is None else r["peak_extra_bytes"] / 1e9
    print(f"| {r['method']} | {r['case']} | {r['experts_received']} | "
          f"{r['bytes_received'] / 1e9:.3f} | {f(r['exchange_ms'], '.2f')} | {f(r['exchange_GBps'], '.1f')} | "
          f"{f(r.get('exchange_ratio'), '.3f')} | {r['full_ms']:.2f} | {r['full_GBps']:.1f} | "
          f"{f(r.get('full_ratio'), '.3f')} | {f(r['messages'], 'd')} | {f(peak, '.3f')} | "
          f"{r['layer_bytes'] / 1e9:.3f} | {r['bad_slots_all_ranks']} | "
          f"{min(r['per_rank_full_GBps']):.1f}-{max(r['per_rank_full_GBps']):.1f} | "
          f"{r['aggregate_full_GBps']:.1f} |", flush=True)


def _report(out: dict) -> None:
    for k, v in out.get("unavailable", {}).items():
        print(f"{k}: unavailable: {v}")
    if "auto_picks" in out:
        print(f"make_transport('auto') picks {out['auto_picks']}")
    print(json.dumps(out, default=str), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="CPU ranks on gloo, tiny sizes")
    ap.add_argument("--nproc", type=int, default=2,
                    help="ranks (GPUs); more than 2 is the all-ranks mode: cases swap (a ring) "
                         "and random (--partial of every rank's slots take other ranks' experts)")
    ap.add_argument("--experts", type=int, default=None, help="experts over both ranks (256)")
    ap.add_argument("--hidden", type=int, default=None, help="H (7168)")
    ap.add_argument("--intermediate", type=int, default=None, help="I (2048)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU) / float32 (--cpu)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per method and case")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--partial", type=float, default=0.25, help="fraction of slots in 'partial'")
    ap.add_argument("--chunks", default=None,
                    help="chunk sizes of the nccl transport, e.g. 64M,256M,1G")
    ap.add_argument("--methods", default=None, help="legacy,nccl,ipc,ipc-move,auto")
    ap.add_argument("--hold-chunks", default=None,
                    help="hold chunk sizes of ipc-move (IpcTransport.hold_chunk_bytes), e.g. 128M,512M")
    ap.add_argument("--raw-gib", type=float, default=2.0, help="size of the raw peer copy")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cpu:
        d = dict(experts=16, hidden=64, intermediate=32, dtype="float32", iters=2,
                 chunks="4K,32K,1M", methods="legacy,nccl,auto")
    else:
        d = dict(experts=256, hidden=7168, intermediate=2048, dtype="bfloat16", iters=8,
                 chunks=f"64M,256M,{DEFAULT_CHUNK_BYTES >> 20}M,4G", methods="legacy,nccl,ipc,ipc-move,auto")
        if torch.cuda.device_count() < a.nproc:
            print(f"needs {a.nproc} GPUs, {torch.cuda.device_count()} visible (use --cpu)", file=sys.stderr)
            return 2
    pick = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in d.items()}
    if a.nproc < 2:
        raise SystemExit("--nproc must be >= 2")
    if pick["experts"] < a.nproc or pick["experts"] % a.nproc:
        raise SystemExit(f"--experts must be a multiple of --nproc ({a.nproc})")
    cfg = dict(cpu=a.cpu, world=a.nproc, experts=pick["experts"], hidden=pick["hidden"],
               intermediate=pick["intermediate"], dtype=pick["dtype"], iters=pick["iters"],
               warmup=a.warmup, partial=a.partial, seed=a.seed,
               chunks=sorted({parse_bytes(c) for c in pick["chunks"].split(",")}),
               methods=pick["methods"].split(","),
               hold_chunks=sorted({parse_bytes(c) for c in (a.hold_chunks or f"{DEFAULT_HOLD_CHUNK_BYTES >> 20}M").split(",")}),
               raw_bytes=0 if a.cpu else int(a.raw_gib * 2**30), raw_iters=10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(a.nproc, port, cfg), nprocs=a.nproc, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
