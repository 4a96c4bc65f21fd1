"""Executing transfer plans over real process groups (gloo here; EPLB_TEST_BACKEND=nccl on GPUs).

Weights encode their logical expert, so after every transition each slot can be checked
bitwise against the expert the new placement puts there.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.placement import Placement
from eplb.transfer import (
    TransferExecutor,
    allocate_staging,
    execute_layer_transfer,
    plan_layer_transfer,
    transfer_stats,
)

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
