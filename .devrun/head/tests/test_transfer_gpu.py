"""Transports on real GPUs (2 CUDA devices, NCCL): coalesced/chunked point-to-point and
CUDA IPC pulls, bitwise, called the way the asynchronous runtime calls them (exchange in a
background thread on a side stream, write on the caller's stream after an event).

Skipped without 2 CUDA devices; on the GPU machine: `python3 -m pytest tests/test_transfer_gpu.py`.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from test_transfer_dist import (
    SENTINEL,
    check_layer,
    expected_rows,
    make_layer3,
    transitions,
)

from eplb.runtime.executor import TransferExecutor
from eplb.core.transfer_plan import plan_layer_transfer
from eplb.runtime.ipc import IpcTransport
from eplb.runtime.transfer import exchange_layer, execute_layer_transfer
from eplb.runtime.staging import allocate_staging, staging_rows, write_layer
from eplb.runtime.transport_choice import AUTO_PREFERS_IPC, make_transport
from eplb.runtime.transports import P2PTransport

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices (runs in full on the GPU machine)")


@pytest.fixture(autouse=True)
def _nccl(monkeypatch):
    monkeypatch.setenv("EPLB_TEST_BACKEND", "nccl")  # the spawned ranks use NCCL, cuda:rank


def exchange_in_background(plan, weights, group, staging, transport, device) -> int:
    """exchange_layer in a thread with a side stream current; the caller's stream waits
    for an event recorded after it (as `PlacementChange` does)."""
    box = {}

    def body():
        try:
            torch.cuda.set_device(device)
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                box["got"] = exchange_layer(plan, weights, group, staging, transport=transport)
                box["event"] = torch.cuda.Event()
                box["event"].record(side)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    torch.cuda.current_stream(device).wait_event(box["event"])
    return box["got"]


def _layers(seq, L, local, device):
    return [make_layer3(layer, seq[0][layer, local], device) for layer in range(L)]


def _check(layer, experts, w1, big, w2, big3, w3):
    check_layer(layer, experts, w1, big, w2)
    assert torch.equal(w3, expected_rows(layer, experts, w3.device)[2])
    assert (big3[:, 2:] == SENTINEL).all()


def _split_halves(rank: int, world: int) -> None:
    """Every transport, random transitions: the background exchange leaves the weights
    untouched and fills staging bitwise; after a barrier, write_layer finishes the layer."""
    device = device_for(rank)
    group = dist.group.WORLD
    L, N, P = 2, 6, 8
    S = P // world
    local = slice(rank * S, (rank + 1) * S)
    seq = transitions(31, L, N, P, world)
    layers = _layers(seq, L, local, device)
    weights = [[w1, w2, w3] for w1, _b, w2, _b3, w3 in layers]
    ipc = make_transport("ipc", weights, group)
    auto = make_transport("auto", weights, group)
    assert isinstance(ipc, IpcTransport)
    assert isinstance(auto, IpcTransport if AUTO_PREFERS_IPC else P2PTransport)
    transports = [P2PTransport(20), P2PTransport(48), P2PTransport(1 << 20), None, ipc]
    ptrs = [[t.data_ptr() for t in ts] for ts in layers]
    for transport in transports:
        for old, new in zip(seq[:-1], seq[1:]):
            for layer, (w1, big, w2, big3, w3) in enumerate(layers):
                plan = plan_layer_transfer(old[layer], new[layer], world, rank)
                K = staging_rows(plan)
                staging = allocate_staging(weights[layer], K)
                before = [big.clone(), w1.clone(), big3.clone()]
                got = exchange_in_background(plan, weights[layer], group, staging, transport, device)
                torch.cuda.current_stream(device).synchronize()
                assert got == plan.num_received * sum(w[0].nbytes for w in weights[layer])
                assert torch.equal(big, before[0]) and torch.equal(w1, before[1])
                assert torch.equal(big3, before[2]), f"{transport}: exchange wrote the weights"
                for b, want in zip(staging, expected_rows(layer, plan.stage_expert, device)):
                    assert torch.equal(b[:K], want), (transport, layer)
                dist.barrier()  # every rank staged the layer (and finished reading peers)
                write_layer(plan, weights[layer], staging)
                _check(layer, new[layer, local], w1, big, w2, big3, w3)
        assert [[t.data_ptr() for t in ts] for ts in layers] == ptrs
    ipc.close()
    auto.close()


def _back_to_back(rank: int, world: int) -> None:
    """No host barriers: execute_layer_transfer (IPC: settle before the write) and
    TransferExecutor with 'ipc' and 'auto', over many layers and transitions."""
    device = device_for(rank)
    group = dist.group.WORLD
    L, N, P = 4, 10, 16
    S = P // world
    local = slice(rank * S, (rank + 1) * S)
    seq = transitions(32, L, N, P, world)
    layers = _layers(seq, L, local, device)
    weights = [[w1, w2, w3] for w1, _b, w2, _b3, w3 in layers]
    ipc = make_transport("ipc", weights, group)
    for old, new in zip(seq[:-1], seq[1:]):
        for layer in range(L):
            plan = plan_layer_transfer(old[layer], new[layer], world, rank)
            execute_layer_transfer(plan, weights[layer], group, transport=ipc)
    for layer, ts in enumerate(layers):
        _check(layer, seq[-1][layer, local], *ts)
    for kind in ("ipc", "auto", "nccl"):
        executor = TransferExecutor(transport=kind, chunk_bytes=64, verify=kind == "auto")
        for old, new in zip(seq[:-1], seq[1:]):
            res = executor.execute(old, new, weights, group)
            assert res.bytes_received == res.experts_received * sum(w[0].nbytes for w in weights[0])
            for layer, ts in enumerate(layers):
                _check(layer, new[layer, local], *ts)
        executor.close()
    assert ipc.moves > 0, "execute_layer_transfer did not move in place over IPC"
    ipc.close()


def _large_experts(rank: int, world: int) -> None:
    """bf16 experts of 2 MiB (w13-like [S, 2I, H] and w2-like [S, H, I]), chunks of 256 KiB
    and 1 MiB, swap and partial changes, NCCL and IPC: bitwise."""
    device = device_for(rank)
    group = dist.group.WORLD
    S, H, I = 8, 512, 512
    g = torch.Generator(device=device).manual_seed(0)
    allw13 = torch.randn(world * S, 2 * I, H, generator=g, device=device).to(torch.bfloat16)
    allw2 = torch.randn(world * S, H, I, generator=g, device=device).to(torch.bfloat16)
    w13, w2 = allw13[rank * S:(rank + 1) * S].clone(), allw2[rank * S:(rank + 1) * S].clone()
    weights = [w13, w2]
    ipc = make_transport("ipc", [weights], group)
    old = np.arange(world * S)
    rng = np.random.default_rng(1)
    swap = np.concatenate([old[S:], old[:S]])
    partial = old.copy()
    a, b = rng.choice(S, 3, replace=False), S + rng.choice(S, 3, replace=False)
    partial[a], partial[b] = old[b], old[a]
    staging = allocate_staging(weights)
    for transport in (P2PTransport(256 << 10), P2PTransport(1 << 20), ipc):
        for new in (swap, partial):
            for src, dst in ((old, new), (new, old)):
                plan = plan_layer_transfer(src, dst, world, rank)
                exchange_in_background(plan, weights, group, staging, transport, device)
                dist.barrier()
                write_layer(plan, weights, staging)
                experts = torch.as_tensor(dst[rank * S:(rank + 1) * S], device=device)
                assert torch.equal(w13, allw13[experts]) and torch.equal(w2, allw2[experts])
    ipc.close()


def _in_place(rank: int, world: int) -> None:
    """`IpcTransport.move` (the synchronous in-place path): bf16 experts of 2 MiB, hold
    chunks of one expert (a token per expert) and of the default size, whole-layer swaps,
    partial trades and random rows with duplicates, back to back with no barrier: bitwise
    equal to the source experts, hold buffer within one layer, no new GPU memory."""
    device = device_for(rank)
    group = dist.group.WORLD
    S, H, I, N = 8, 512, 512, 12
    g = torch.Generator(device=device).manual_seed(1)
    allw13 = torch.randn(N, 2 * I, H, generator=g, device=device).to(torch.bfloat16)  # [N, 2I, H]
    allw2 = torch.randn(N, H, I, generator=g, device=device).to(torch.bfloat16)  # [N, H, I]
    rng = np.random.default_rng(3)

    def row() -> np.ndarray:  # [2S] every expert at least once, duplicates possible
        return rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, world * S - N)]))

    rows = [np.arange(world * S) % N]
    rows.append(np.concatenate([rows[0][S:], rows[0][:S]]))  # every slot changes rank
    rows += [row() for _ in range(8)]
    rows.append(rows[0])
    local = slice(rank * S, (rank + 1) * S)
    expert_bytes = (allw13[0].nbytes + allw2[0].nbytes)
    for chunk in (expert_bytes, 3 * expert_bytes, None):
        first = torch.as_tensor(rows[0][local], device=device)
        w13, w2 = allw13[first].clone(), allw2[first].clone()
        kw = {} if chunk is None else {"hold_chunk_bytes": chunk}
        ipc = IpcTransport([[w13, w2]], group, **kw)
        assert ipc.can_move([w13, w2]) and ipc.hold_bytes == w13.nbytes + w2.nbytes
        torch.cuda.synchronize(device)
        mem = torch.cuda.memory_allocated(device)
        for old, new in zip(rows[:-1], rows[1:]):
            plan = plan_layer_transfer(old, new, world, rank)
            got = execute_layer_transfer(plan, [w13, w2], group, transport=ipc)
            assert got == plan.num_received * expert_bytes
            experts = torch.as_tensor(new[local], device=device)
            assert torch.equal(w13, allw13[experts]) and torch.equal(w2, allw2[experts]), (chunk, new)
            del experts
        assert ipc.moves > 0 and torch.cuda.memory_allocated(device) == mem
        ipc.close()
        dist.barrier()
        del ipc


def _all(rank: int, world: int) -> None:
    import faulthandler
    import sys
    import traceback

    faulthandler.dump_traceback_later(120, exit=True)  # a hang prints every thread's stack
    try:
        for phase in (_split_halves, _back_to_back, _large_experts, _in_place):
            print(f"rank {rank}: {phase.__name__}", flush=True)
            phase(rank, world)
            # IPC shutdown order: mappings closed on every rank, then the weights go
            dist.barrier()
            torch.cuda.synchronize(device_for(rank))
            torch.cuda.ipc_collect()
        print(f"rank {rank}: done", flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_transports_on_two_gpus():
    run_distributed(_all, 2, timeout=150)
