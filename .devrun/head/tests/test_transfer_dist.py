"""Executing transfer plans over real process groups (gloo here; EPLB_TEST_BACKEND=nccl on GPUs).

Weights encode their logical expert, so after every transition each slot can be checked
bitwise against the expert the new placement puts there.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.placement import Placement
from eplb.runtime.executor import TransferExecutor
from eplb.core.transfer_plan import plan_layer_transfer, transfer_stats
from eplb.runtime.transfer import execute_layer_transfer
from eplb.runtime.staging import allocate_staging

SHAPE1 = (3, 4)  # w1: contiguous float32 [S, 3, 4]
BIG2 = (5, 6)  # w2: int32 view [S, 3, 3] = big[:, 1:4, ::2] of big [S, 5, 6]
SENTINEL = -7
BYTES_PER_EXPERT = 3 * 4 * 4 + 3 * 3 * 4


def pattern(expert: int, layer: int, shape, dtype, device) -> torch.Tensor:  # [*shape]
    n = int(np.prod(shape))
    return (expert * 1000 + layer * 100 + torch.arange(n, device=device)).reshape(shape).to(dtype)


def make_layer(layer: int, experts: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w1 [S, 3, 4], big [S, 5, 6], w2 [S, 3, 3] (non-contiguous view of big), filled for `experts [S]`."""
    S = len(experts)
    w1 = torch.empty(S, *SHAPE1, dtype=torch.float32, device=device)
    big = torch.full((S, *BIG2), SENTINEL, dtype=torch.int32, device=device)
    w2 = big[:, 1:4, ::2]
    assert not w2.is_contiguous() and not w2[0].is_contiguous()
    for s, e in enumerate(experts.tolist()):
        w1[s].copy_(pattern(e, layer, SHAPE1, torch.float32, device))
        w2[s].copy_(pattern(e, layer, (3, 3), torch.int32, device))
    return w1, big, w2


def check_layer(layer: int, experts: np.ndarray, w1, big, w2) -> None:
    """Every slot holds exactly its expert's weights; big is untouched outside the view."""
    for s, e in enumerate(experts.tolist()):
        assert torch.equal(w1[s], pattern(e, layer, SHAPE1, torch.float32, w1.device)), (layer, s, e)
        assert torch.equal(w2[s], pattern(e, layer, (3, 3), torch.int32, w2.device)), (layer, s, e)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[:, 1:4, ::2] = False
    assert (big[outside] == SENTINEL).all()


def random_p2l(rng, L: int, N: int, P: int) -> np.ndarray:  # [L, P]
    return np.stack([rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P - N)]))
                     for _ in range(L)])


def transitions(seed: int, L: int, N: int, P: int, M: int) -> list[np.ndarray]:
    """Initial placement, random ones, no change, a hot expert on every rank, back to initial."""
    rng = np.random.default_rng(seed)
    init = Placement.initial(L, N, P, M).physical_to_logical
    seq = [init] + [random_p2l(rng, L, N, P) for _ in range(4)]
    seq.append(seq[-1].copy())  # no change at all
    hot = random_p2l(rng, L, N, P)  # [L, P]
    hot[:, :: P // M] = 0  # expert 0 on the first slot of every rank
    for row in hot:  # [P] put back experts that lost their only slot, onto duplicate slots
        for e in np.setdiff1d(np.arange(N), row):
            dup = [p for p in range(P) if p % (P // M) and (row == row[p]).sum() > 1]
            row[dup[0]] = e
    seq += [hot, init]
    for p2l in seq:
        Placement(p2l, N, M)  # valid: every expert present
    return seq


def _run_world(rank: int, world_size: int, seed: int, L: int, N: int, P: int, num_nodes: int) -> None:
    device = device_for(rank)
    S = P // world_size
    seq = transitions(seed, L, N, P, world_size)
    local = slice(rank * S, (rank + 1) * S)
    layers = [make_layer(layer, seq[0][layer, local], device) for layer in range(L)]
    ptrs = [(w1.data_ptr(), big.data_ptr(), w2.data_ptr()) for w1, big, w2 in layers]
    expert_weights = [[w1, w2] for w1, _big, w2 in layers]  # [L] of [w1 [S,3,4], w2 [S,3,3]]
    executor = TransferExecutor(num_nodes=num_nodes)
    for old, new in zip(seq[:-1], seq[1:]):
        old_pl, new_pl = Placement(old, N, world_size), Placement(new, N, world_size, num_nodes)
        res = executor.execute(old_pl, new_pl, expert_weights)
        written = local_copies = received = 0
        for layer, (w1, big, w2) in enumerate(layers):
            check_layer(layer, new[layer, local], w1, big, w2)
            plan = plan_layer_transfer(old[layer], new[layer], world_size, rank, num_nodes)
            assert not np.isin(plan.write_dst, np.flatnonzero(old[layer, local] == new[layer, local])).any()
            written += plan.num_slots_written
            local_copies += plan.num_local_copies
            received += plan.num_received
        assert [(a.data_ptr(), b.data_ptr(), c.data_ptr()) for a, b, c in layers] == ptrs
        assert (res.slots_written, res.local_copies, res.experts_received) == (written, local_copies, received)
        assert res.slots_written == int((old[:, local] != new[:, local]).sum())
        assert res.bytes_received == res.experts_received * BYTES_PER_EXPERT
        # totals over ranks match the whole-model summary
        tot = torch.tensor([res.experts_received, res.local_copies, res.slots_written,
                            res.bytes_sent, res.bytes_received], device=device)
        dist.all_reduce(tot)
        st = transfer_stats(old, new, world_size, BYTES_PER_EXPERT)
        assert tot.tolist() == [st.experts_moved, st.local_copies, st.slots_changed,
                                st.bytes_moved, st.bytes_moved]


def _run_subgroups(rank: int, world_size: int, seed: int, L: int, N: int, P: int) -> None:
    """Two disjoint 2-rank groups ({0, 2} and {1, 3}) transfer at once with group-relative
    plans, via execute_layer_transfer (fresh staging, and a reused one)."""
    device = device_for(rank)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # first op on the group: all ranks
    g_rank, g_size = dist.get_rank(group), dist.get_world_size(group)
    S = P // g_size
    seq = transitions(seed + rank % 2, L, N, P, g_size)
    local = slice(g_rank * S, (g_rank + 1) * S)
    layers = [make_layer(layer, seq[0][layer, local], device) for layer in range(L)]
    staging = allocate_staging([layers[0][0], layers[0][2]])
    for i, (old, new) in enumerate(zip(seq[:-1], seq[1:])):
        for layer, (w1, big, w2) in enumerate(layers):
            plan = plan_layer_transfer(old[layer], new[layer], g_size, g_rank)
            got = execute_layer_transfer(plan, [w1, w2], group, staging if i % 2 else None)
            assert got == plan.num_received * BYTES_PER_EXPERT
            check_layer(layer, new[layer, local], w1, big, w2)


def _run_all(rank: int, world_size: int, seed: int) -> None:
    if world_size == 2:
        _run_world(rank, world_size, seed, L=3, N=6, P=8, num_nodes=1)
    else:
        _run_world(rank, world_size, seed, L=3, N=10, P=16, num_nodes=2)
        _run_subgroups(rank, world_size, seed, L=2, N=5, P=8)


def test_transfer_two_ranks():
    run_distributed(_run_all, 2, 11)


def test_transfer_four_ranks_nodes_and_subgroups():
    run_distributed(_run_all, 4, 12)


def test_single_process_without_distributed():
    """World size 1 and no process group: purely local moves."""
    assert not dist.is_initialized()
    L, N, P = 2, 5, 7
    seq = transitions(5, L, N, P, 1)
    layers = [make_layer(layer, seq[0][layer], "cpu") for layer in range(L)]
    ptrs = [w1.data_ptr() for w1, _, _ in layers]
    executor = TransferExecutor()
    for old, new in zip(seq[:-1], seq[1:]):
        res = executor.execute(old, new, [[w1, w2] for w1, _, w2 in layers])
        assert res.experts_received == 0 and res.bytes_received == 0
        assert res.slots_written == int((old != new).sum())
        for layer, (w1, big, w2) in enumerate(layers):
            check_layer(layer, new[layer], w1, big, w2)
    assert [w1.data_ptr() for w1, _, _ in layers] == ptrs


# ---- exchange_layer / write_layer: coalesced, chunked point-to-point (gloo here) ---------

SHAPE3, BIG3 = (2, 3), (4, 3)  # w3 = big3[:, :2, :]: each slot contiguous, slot runs not


def make_layer3(layer: int, experts: np.ndarray, device):
    """(w1, big, w2) as `make_layer`, plus big3 [S, 4, 3] float64 and w3 = big3[:, :2, :]."""
    w1, big, w2 = make_layer(layer, experts, device)
    big3 = torch.full((len(experts), *BIG3), SENTINEL, dtype=torch.float64, device=device)
    w3 = big3[:, :2, :]
    assert w3[0].is_contiguous() and not w3[:2].is_contiguous()
    for s, e in enumerate(experts.tolist()):
        w3[s].copy_(pattern(e, layer, SHAPE3, torch.float64, device))
    return w1, big, w2, big3, w3


def expected_rows(layer: int, experts, device) -> list[torch.Tensor]:
    """What staging (or a slot range) holds for `experts`: [w1 rows, w2 rows, w3 rows]."""
    return [torch.stack([pattern(int(e), layer, shape, dtype, device) for e in experts])
            if len(experts) else torch.empty(0, *shape, dtype=dtype, device=device)
            for shape, dtype in ((SHAPE1, torch.float32), ((3, 3), torch.int32),
                                 (SHAPE3, torch.float64))]


def expected_messages(plan, chunk: int, sizes) -> int:
    """Messages the coalesced transport posts: per peer stream and tensor ceil(bytes/chunk)."""
    counts = [int((plan.send_peer == q).sum()) for q in np.unique(plan.send_peer)]
    counts += [int((plan.stage_src_rank[plan.recv_rows] == q).sum())
               for q in np.unique(plan.stage_src_rank[plan.recv_rows])]
    total = 0
    for n in counts:
        for numel, itemsize in sizes:
            step = max(1, chunk // itemsize)
            total += -(-n * numel // step)
    return total


CHUNKS = (3, 20, 36, 48, 100, 1 << 30)  # < one element, < one expert, = w2's, = w1's, >, whole


def _run_chunked(rank: int, world_size: int, seed: int, N: int, P: int) -> None:
    """Every chunk size, random transitions: exchange_layer leaves weights untouched and
    fills staging bitwise; write_layer then gives every slot its new expert."""
    from eplb.runtime.transfer import exchange_layer
    from eplb.runtime.staging import staging_rows, write_layer
    from eplb.runtime.transports import P2PTransport

    device = device_for(rank)
    S = P // world_size
    seq = transitions(seed, 2, N, P, world_size)
    local = slice(rank * S, (rank + 1) * S)
    for ci, chunk in enumerate(CHUNKS):
        transport = P2PTransport(chunk)
        layers = [make_layer3(layer, seq[0][layer, local], device) for layer in range(2)]
        ptrs = [[t.data_ptr() for t in ts] for ts in layers]
        for old, new in zip(seq[:-1], seq[1:]):
            for layer, (w1, big, w2, big3, w3) in enumerate(layers):
                weights = [w1, w2, w3]
                plan = plan_layer_transfer(old[layer], new[layer], world_size, rank)
                K = staging_rows(plan)
                staging = allocate_staging(weights, K + ci % 2)  # spare rows are fine
                before = [big.clone(), w1.clone(), big3.clone()]
                got = exchange_layer(plan, weights, dist.group.WORLD, staging, transport=transport)
                assert torch.equal(big, before[0]) and torch.equal(w1, before[1])
                assert torch.equal(big3, before[2]), "exchange_layer wrote the weights"
                assert got == plan.num_received * (BYTES_PER_EXPERT + 6 * 8)
                for b, want in zip(staging, expected_rows(layer, plan.stage_expert, device)):
                    assert torch.equal(b[:K], want), (chunk, layer, plan.stage_expert)
                if not plan.is_noop:
                    sizes = [(w[0].numel(), w.element_size()) for w in weights]
                    assert transport.last_messages == expected_messages(plan, chunk, sizes)
                    peers = len(np.unique(plan.send_peer))
                    assert transport.last_pack_bytes <= 2 * peers * max(chunk, 8)
                write_layer(plan, weights, staging)
                check_layer(layer, new[layer, local], w1, big, w2)
                assert torch.equal(w3, expected_rows(layer, new[layer, local], device)[2])
                assert (big3[:, 2:] == SENTINEL).all()
        assert [[t.data_ptr() for t in ts] for ts in layers] == ptrs


def _run_swap_direct(rank: int, world_size: int) -> None:
    """Whole-layer swap with contiguous weights: one message per tensor and direction,
    sent straight from the weights (no pack buffer); chunked, several per tensor."""
    from eplb.runtime.transfer import exchange_layer
    from eplb.runtime.staging import write_layer
    from eplb.runtime.transports import P2PTransport

    device = device_for(rank)
    S = 6
    old = np.arange(2 * S)
    new = np.concatenate([old[S:], old[:S]])
    w1, _big, _w2 = make_layer(0, old[rank * S:(rank + 1) * S], device)
    for chunk, per_tensor in ((1 << 20, 1), (2 * 48, 3)):  # 6 experts of 48 bytes: 1 or 3 pieces
        plan = plan_layer_transfer(old, new, 2, rank)
        assert plan.num_received == S and plan.num_sent == S
        t = P2PTransport(chunk)
        staging = allocate_staging([w1])
        assert exchange_layer(plan, [w1], None, staging, transport=t) == S * 48
        assert t.last_messages == 2 * per_tensor and t.last_pack_bytes == 0
        write_layer(plan, [w1], staging)
        assert torch.equal(w1, expected_rows(0, new[rank * S:(rank + 1) * S], device)[0])
        old, new = new, old


def _run_pack_in_spare_rows(rank: int, world_size: int) -> None:
    """Scattered sends are packed; with staging for S rows and few rows used, the pack
    buffers live in the unused rows (nothing allocated), else they are allocated."""
    from eplb.runtime.transfer import exchange_layer
    from eplb.runtime.staging import write_layer
    from eplb.runtime.transports import P2PTransport

    device = device_for(rank)
    S = 8
    old = np.arange(2 * S)
    new = old.copy()
    new[[1, 4]], new[[S + 2, S + 6]] = old[[S + 2, S + 6]], old[[1, 4]]  # scattered trades
    w1, big, w2 = make_layer(0, old[rank * S:(rank + 1) * S], device)
    for rows, allocated in ((S, False), (2, True)):
        plan = plan_layer_transfer(old, new, 2, rank)
        assert plan.num_staged == 2
        t = P2PTransport(48)  # w1 (contiguous): direct; w2 (non-contiguous view): packed
        staging = allocate_staging([w1, w2], rows)
        assert exchange_layer(plan, [w1, w2], None, staging, transport=t) == 2 * BYTES_PER_EXPERT
        assert (t.last_pack_bytes > 0) == allocated
        write_layer(plan, [w1, w2], staging)
        check_layer(0, new[rank * S:(rank + 1) * S], w1, big, w2)
        old, new = new, old
    # 12-byte rows: the unused rows start at an address an int64 pack view cannot use as is
    old = np.arange(2 * S)
    new = old.copy()
    new[3], new[S + 5] = old[S + 5], old[3]  # one trade: one staged row
    mine = old[rank * S:(rank + 1) * S]
    a = torch.as_tensor(mine, dtype=torch.float32, device=device)[:, None] * 10 + torch.arange(3.0)
    bigl = torch.zeros(S, 4, dtype=torch.int64, device=device)
    bigl[:, ::2] = torch.as_tensor(mine, device=device)[:, None] * 100 + torch.arange(2)
    b = bigl[:, ::2]  # [S, 2] int64, non-contiguous: packed
    plan = plan_layer_transfer(old, new, 2, rank)
    t = P2PTransport(1 << 20)
    staging = allocate_staging([a, b])
    exchange_layer(plan, [a, b], None, staging, transport=t)
    assert t.last_pack_bytes == 0  # fitted, aligned, into the unused rows
    write_layer(plan, [a, b], staging)
    want = torch.as_tensor(new[rank * S:(rank + 1) * S], device=device)[:, None]  # [S, 1]
    assert torch.equal(a, want.float() * 10 + torch.arange(3.0, device=device))
    assert torch.equal(b, want * 100 + torch.arange(2, device=device))


def _run_executor_transports(rank: int, world_size: int, seed: int) -> None:
    """TransferExecutor with a small chunk and with 'auto' (gloo: point-to-point); on CPU
    'ipc' fails on every rank with one clear error."""
    from eplb.runtime.transport_choice import make_transport
    from eplb.runtime.transports import P2PTransport

    device = device_for(rank)
    N, P = 6, 4 * world_size
    S = P // world_size
    seq = transitions(seed, 3, N, P, world_size)
    local = slice(rank * S, (rank + 1) * S)
    for executor in (TransferExecutor(chunk_bytes=20), TransferExecutor(transport="auto")):
        layers = [make_layer(layer, seq[0][layer, local], device) for layer in range(3)]
        for old, new in zip(seq[:-1], seq[1:]):
            res = executor.execute(old, new, [[w1, w2] for w1, _b, w2 in layers])
            assert res.bytes_received == res.experts_received * BYTES_PER_EXPERT
            for layer, (w1, big, w2) in enumerate(layers):
                check_layer(layer, new[layer, local], w1, big, w2)
    if device.type == "cpu":  # tests/test_transfer_gpu.py covers 'auto' and 'ipc' on GPUs
        weights = [[w1, w2] for w1, _b, w2 in layers]
        assert isinstance(make_transport("auto", weights), P2PTransport)
        with pytest.raises(RuntimeError, match="CUDA IPC transport unavailable.*not all CUDA"):
            make_transport("ipc", weights)


def _run_chunked_subgroups(rank: int, world_size: int, seed: int) -> None:
    """Disjoint 2-rank groups ({0, 2}, {1, 3}), chunks smaller than an expert: peers are
    group-relative and mapped to global ranks."""
    from eplb.runtime.transports import P2PTransport

    device = device_for(rank)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    g_rank = dist.get_rank(group)
    N, P = 5, 8
    S = P // 2
    seq = transitions(seed + rank % 2, 2, N, P, 2)
    local = slice(g_rank * S, (g_rank + 1) * S)
    layers = [make_layer(layer, seq[0][layer, local], device) for layer in range(2)]
    for old, new in zip(seq[:-1], seq[1:]):
        for layer, (w1, big, w2) in enumerate(layers):
            plan = plan_layer_transfer(old[layer], new[layer], 2, g_rank)
            got = execute_layer_transfer(plan, [w1, w2], group, transport=P2PTransport(28))
            assert got == plan.num_received * BYTES_PER_EXPERT
            check_layer(layer, new[layer, local], w1, big, w2)


def _run_coalesced(rank: int, world_size: int, seed: int) -> None:
    if world_size == 2:
        _run_chunked(rank, world_size, seed, N=6, P=8)
        _run_swap_direct(rank, world_size)
        _run_pack_in_spare_rows(rank, world_size)
        _run_executor_transports(rank, world_size, seed)
    elif world_size == 3:
        _run_chunked(rank, world_size, seed, N=8, P=12)
    else:
        _run_chunked_subgroups(rank, world_size, seed)


def test_coalesced_chunked_two_ranks():
    run_distributed(_run_coalesced, 2, 21)


@pytest.mark.slow
def test_coalesced_chunked_three_ranks():
    run_distributed(_run_coalesced, 3, 22)


def test_coalesced_chunked_subgroups():
    run_distributed(_run_coalesced, 4, 23)


def test_copy_flat_range_matches_flatten():
    """Packing reads any element range of any strided view in row-major order."""
    from eplb.runtime.transports import _copy_flat_range, _gather

    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 6, 7, generator=g)
    views = [base, base[:, 1:5, ::2], base.transpose(1, 2), base[2], base[:, 3], base[1, :, 4]]
    for v in views:
        flat = v.flatten()
        n = flat.numel()
        for lo in range(0, n, 3):
            for hi in (lo + 1, lo + 7, lo + 29, n):
                hi = min(hi, n)
                dst = torch.full((hi - lo,), float("nan"))
                _copy_flat_range(dst, v, lo, hi)
                assert torch.equal(dst, flat[lo:hi]), (v.shape, v.stride(), lo, hi)
    w = base[:, 1:5, ::2]  # [5, 4, 4] non-contiguous slots
    slots = np.array([3, 4, 0, 2, 1])
    stream = torch.cat([w[s].flatten() for s in slots.tolist()])  # [5 * 16]
    for lo, hi in ((0, 80), (5, 37), (16, 48), (31, 33), (79, 80)):
        dst = torch.empty(hi - lo)
        _gather(dst, w, slots, 16, lo, hi)
        assert torch.equal(dst, stream[lo:hi])


def test_execution_input_errors():
    from eplb.runtime.transfer import exchange_layer
    from eplb.runtime.staging import write_layer
    from eplb.runtime.transport_choice import make_transport
    from eplb.runtime.transports import P2PTransport

    old, new = np.array([0, 1, 2, 3]), np.array([1, 0, 2, 3])
    plan = plan_layer_transfer(old, new, 1, 0)
    w = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="staging is required"):
        exchange_layer(plan, [w], None, None)
    with pytest.raises(ValueError, match="staging\\[0\\] must be contiguous"):
        exchange_layer(plan, [w], None, [torch.zeros(4, 2)])
    with pytest.raises(ValueError, match="weights\\[0\\] has 3 slots"):
        write_layer(plan, [torch.zeros(3, 3)], [torch.zeros(4, 3)])
    with pytest.raises(ValueError, match="needs set-up"):
        exchange_layer(plan, [w], None, [torch.zeros(4, 3)], transport="ipc")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive integer"):
        P2PTransport(0)
    with pytest.raises(ValueError, match="transport must be one of"):
        make_transport("shm", [[w]])
    with pytest.raises(ValueError, match="transport must be one of"):
        TransferExecutor(transport="rdma")
    # one rank, no process group: local moves only, through the split halves
    w = torch.arange(12.0).reshape(4, 3)
    staging = allocate_staging([w], plan.num_staged)
    assert exchange_layer(plan, [w], None, staging) == 0
    write_layer(plan, [w], staging)
    assert torch.equal(w, torch.arange(12.0).reshape(4, 3)[[1, 0, 2, 3]])


def test_benchmark_runs_on_cpu():
    """benchmarks/transfer_bw.py --cpu (2 gloo ranks, tiny sizes): every method moves every
    slot bitwise and the JSON line carries the figures."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "transfer_bw.py"), "--cpu", "--experts", "8",
         "--hidden", "16", "--intermediate", "8", "--iters", "1", "--warmup", "0",
         "--chunks", "100,1K"],
        cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["auto_picks"] == "P2PTransport"
    got = {(r["method"], r["case"]) for r in out["results"]}
    assert got == {(m, c) for m in ("legacy", "nccl@100B", "nccl@1024B") for c in ("swap", "partial")}
    for r in out["results"]:
        assert r["bad_slots_all_ranks"] == 0, r
        assert r["bytes_received"] == r["experts_received"] * r["expert_bytes"] > 0
    assert any(line.startswith("| nccl@100B | swap |") for line in lines)


def test_benchmark_all_ranks_mode_on_cpu():
    """transfer_bw.py --nproc 4 (the all-ranks mode): every rank sends and receives at once;
    the bytes each rank reports received match a count made here from the placements, and
    the aggregate is their sum over the same time."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import transfer_bw as bench
    finally:
        sys.path.pop(0)
    W, E, H, I = 4, 16, 16, 8
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "transfer_bw.py"), "--cpu", "--nproc", str(W),
         "--experts", str(E), "--hidden", str(H), "--intermediate", str(I), "--iters", "1",
         "--warmup", "0", "--chunks", "1K", "--methods", "nccl", "--partial", "0.5"],
        cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    S = E // W
    expert_bytes = 3 * H * I * 4  # float32 on --cpu
    cases = bench.placements(S, 0.5, 0, W)
    assert {r["case"] for r in out["results"]} == {"swap", "random"} == set(cases)
    for r in out["results"]:
        assert r["bad_slots_all_ranks"] == 0, r
        old, new = cases[r["case"]]
        want = []
        for rank in range(W):  # distinct experts a rank needs and did not hold, both directions
            mine_old, mine_new = set(old[rank * S:(rank + 1) * S]), set(new[rank * S:(rank + 1) * S])
            want.append(len(mine_new - mine_old) * expert_bytes)
        ms = r["full_ms"] / 1e3
        assert [round(g * ms * 1e9) for g in r["per_rank_full_GBps"]] == want
        assert r["aggregate_full_GBps"] == pytest.approx(sum(want) / ms / 1e9)
        assert all(w > 0 for w in want)  # every rank receives
    old, new = cases["random"]
    changed = np.flatnonzero(old != new)
    assert all(new[p] // S != p // S for p in changed)  # each changed slot takes another rank's expert
    assert len(changed) == W * round(0.5 * S)
