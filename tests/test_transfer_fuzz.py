"""Fuzzed placement transitions through the real TransferExecutor on gloo ranks, and
post-transfer verification (EplbConfig.verify_transfers).

Counting: one *transition* is one `TransferExecutor.execute` call from one placement to the
next; each call moves all L_FUZZ = 2 layers (each layer drawn independently), and every
slot of every layer is checked bitwise on every rank after every call.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.runtime.transfer import TransferExecutor, TransferVerificationError, slot_checksums

L_FUZZ = 2
KINDS = ("random", "same", "permute", "hot", "dup_on_rank", "swap")


# ---- tiny weights whose values encode (layer, expert) ----------------------------------

def expected(layer: int, experts: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """a: float32 [S, 3]; b: int64 [S, 2]; both a function of (layer, expert) only."""
    e = torch.as_tensor(experts, dtype=torch.int64, device=device)[:, None]  # [S, 1]
    a = (layer * 1000 + e * 10 + torch.arange(3, device=device)).to(torch.float32)  # [S, 3]
    b = -(layer * 100000 + e * 100 + torch.arange(2, device=device))  # [S, 2]
    return a, b


def make_layer(layer: int, experts: np.ndarray, device):
    """a [S, 3] contiguous, big [S, 4] int64 whose b = big[:, ::2] is a non-contiguous view."""
    a, b = expected(layer, experts, device)
    big = torch.full((len(experts), 4), 7, dtype=torch.int64, device=device)
    big[:, ::2] = b
    return a.clone(), big, big[:, ::2]


def check(layer: int, experts: np.ndarray, a, big, b) -> None:
    wa, wb = expected(layer, experts, a.device)
    assert torch.equal(a, wa), (layer, experts)
    assert torch.equal(b, wb), (layer, experts)
    assert (big[:, 1::2] == 7).all()


# ---- random transitions ----------------------------------------------------------------

def _repair(row: np.ndarray, N: int, rng) -> np.ndarray:
    """Put every missing expert back onto a slot whose expert has another replica."""
    for e in rng.permutation(np.setdiff1d(np.arange(N), row)).tolist():
        counts = np.bincount(row, minlength=N)
        dup = np.flatnonzero(counts[row] > 1)
        row[rng.choice(dup)] = e
    return row


def next_row(rng, prev: np.ndarray, N: int, M: int, kind: str) -> np.ndarray:  # [P]
    P = prev.shape[0]
    S = P // M
    if kind == "same":
        return prev.copy()
    if kind == "permute":  # every expert stays, slots shuffled over all ranks
        return rng.permutation(prev)
    if kind == "swap":  # two slots exchange their experts
        row = prev.copy()
        i, j = rng.choice(P, 2, replace=False)
        row[i], row[j] = row[j], row[i]
        return row
    row = rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P - N)]))
    if kind == "hot":  # one expert on (at least) one slot of every rank
        hot = int(rng.integers(N))
        row[np.arange(M) * S + rng.integers(0, S, M)] = hot
    elif kind == "dup_on_rank":  # one expert several times on one rank
        r, e = int(rng.integers(M)), int(rng.integers(N))
        k = int(rng.integers(2, S + 1))
        row[r * S + rng.choice(S, k, replace=False)] = e
    return _repair(row, N, rng) if kind in ("hot", "dup_on_rank") else row


def fuzz_sequence(seed: int, n: int, L: int, N: int, P: int, M: int):
    """n + 1 placements [L, P] (the first is the initial one); yields (p2l, kinds)."""
    rng = np.random.default_rng(seed)
    cur = np.tile(np.arange(P) % N, (L, 1))
    yield cur, ("init",) * L
    for _ in range(n):
        kinds = tuple(KINDS[int(rng.integers(len(KINDS)))] for _ in range(L))
        cur = np.stack([next_row(rng, cur[layer], N, M, k) for layer, k in enumerate(kinds)])
        for row in cur:
            assert set(row.tolist()) == set(range(N))
        yield cur, kinds


# ---- the fuzz body ---------------------------------------------------------------------

def _fuzz_body(rank: int, world: int, seed: int, n: int, N: int, S: int) -> None:
    device = device_for(rank)
    P = world * S
    local = slice(rank * S, (rank + 1) * S)
    seq = fuzz_sequence(seed, n, L_FUZZ, N, P, world)
    cur, _ = next(seq)
    layers = [make_layer(layer, cur[layer, local], device) for layer in range(L_FUZZ)]
    ptrs = [(a.data_ptr(), big.data_ptr()) for a, big, _ in layers]
    weights = [[a, b] for a, _big, b in layers]
    plain, verifying = TransferExecutor(), TransferExecutor(verify=True)
    done = 0
    kinds_seen = set()
    for i, (new, kinds) in enumerate(seq):
        executor = verifying if i % 2 else plain  # verification must never fire falsely
        executor.execute(cur, new, weights)
        for layer, (a, big, b) in enumerate(layers):
            check(layer, new[layer, local], a, big, b)
        cur = new
        done += 1
        kinds_seen.update(kinds)
    assert done == n
    assert kinds_seen == set(KINDS)
    assert [(a.data_ptr(), big.data_ptr()) for a, big, _ in layers] == ptrs


def test_fuzz_transitions_4_ranks():
    """Default suite: 200 transitions (x 2 layers) on 4 ranks."""
    run_distributed(_fuzz_body, 4, 101, 200, 6, 3)


@pytest.mark.slow
@pytest.mark.parametrize("world,N,S", [(4, 6, 3), (8, 10, 2)])
def test_fuzz_transitions_slow(world, N, S):
    """Slow suite: 2,500 transitions (x 2 layers) on 4 ranks and 2,500 on 8 ranks."""
    t0 = time.perf_counter()
    run_distributed(_fuzz_body, world, 1000 + world, 2500, N, S, timeout=1200)
    print(f"\n{world} ranks: 2500 transitions x {L_FUZZ} layers in {time.perf_counter() - t0:.1f} s")


# ---- verification ----------------------------------------------------------------------

def test_slot_checksums_see_one_flipped_bit_and_ignore_layout():
    a = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    base = slot_checksums([a])
    assert base.shape == (4,) and len(set(base.tolist())) == 4
    b = a.clone()
    b.view(torch.int32)[2, 3] ^= 1  # one bit of one element of slot 2
    got = slot_checksums([b])
    assert (got != base).tolist() == [False, False, True, False]
    # a non-contiguous view with the same values has the same checksums
    big = torch.zeros(4, 12)
    big[:, ::2] = a
    assert torch.equal(slot_checksums([big[:, ::2]]), base)
    # swapping two elements within a slot changes its checksum
    c = a.clone()
    c[1, [0, 1]] = c[1, [1, 0]]
    assert slot_checksums([c])[1] != base[1]


def _corrupt_body(rank: int, world: int, bad_layer: int, bad_rank: int) -> None:
    """Layer `bad_layer`'s copy into a slot flips a value on `bad_rank` only: every rank
    raises TransferVerificationError, before that layer's on_layer_done; earlier layers
    are done and correct."""
    import eplb.runtime.transfer

    device = device_for(rank)
    N, S, L = 6, 3, 4
    P = world * S
    local = slice(rank * S, (rank + 1) * S)
    rng = np.random.default_rng(5)  # same on every rank
    old = np.tile(np.arange(P) % N, (L, 1))
    new = np.stack([rng.permutation(old[0]) for _ in range(L)])
    layers = [make_layer(layer, old[layer, local], device) for layer in range(L)]
    weights = [[a, b] for a, _big, b in layers]
    real = eplb.runtime.transfer.execute_layer_transfer

    def corrupting(plan, ws, group=None, staging=None):
        got = real(plan, ws, group, staging)
        if ws[0] is weights[bad_layer][0] and rank == bad_rank and plan.num_slots_written:
            ws[0][int(plan.write_dst[0]), 1] += 1.0  # a wrong value lands in a written slot
        return got

    done = []
    eplb.runtime.transfer.execute_layer_transfer = corrupting
    try:
        with pytest.raises(TransferVerificationError, match=f"layer {bad_layer}") as info:
            TransferExecutor(verify=True).execute(old, new, weights, on_layer_done=done.append)
    finally:
        eplb.runtime.transfer.execute_layer_transfer = real
    assert done == list(range(bad_layer))
    assert info.value.layer == bad_layer and len(info.value.bad_slots) == 1
    assert info.value.bad_slots[0] // S == bad_rank
    for layer in range(bad_layer):
        check(layer, new[layer, local], *layers[layer])
    for layer in range(bad_layer + 1, L):  # never started
        check(layer, old[layer, local], *layers[layer])
    dist.barrier()  # nobody is stuck in a collective


@pytest.mark.parametrize("world", [4])
def test_corruption_is_detected_on_every_rank(world):
    run_distributed(_corrupt_body, world, 2, world - 1, timeout=120)


def _runtime_corrupt_body(rank: int, world: int) -> None:
    """Through EplbRuntime with verify_transfers: an expert corrupted on its way into
    staging (third changed layer, rank 0 only) makes the rebalance fail on every rank
    before that layer is written; layers before it are new, it and later layers old, maps
    matching weights in every layer, and the model keeps serving."""
    import eplb.runtime.transfer
    from moe import DenseMoEModel, MoEModel, sample_tokens

    from eplb.core.config import EplbConfig
    from eplb.runtime import EplbRuntime, RebalanceError
    from test_runtime import _args, _check_slots

    device = device_for(rank)
    args = _args(num_layers=4, num_redundant_experts=world)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, rebalance_interval=0,
                                            verify_transfers=True))
    old = runtime.placement
    rng = np.random.default_rng(11)
    target = np.stack([rng.permutation(np.arange(old.num_slots) % args.num_experts) for _ in range(4)])
    real = eplb.runtime.transfer.exchange_layer
    calls = []

    def corrupting(plan, ws, group, staging, **kw):
        got = real(plan, ws, group, staging, **kw)
        calls.append(1)
        if len(calls) == 3 and rank == 0:
            assert plan.num_staged > 0
            staging[0][0].view(-1)[0] += 1
        return got

    eplb.runtime.transfer.exchange_layer = corrupting
    try:
        with pytest.raises(RebalanceError, match="after 2 of 4 changed layers.*(TransferVerificationError|rank 0 failed)"):
            runtime.apply_placement(old.with_physical_to_logical(target, "test"))
    finally:
        eplb.runtime.transfer.exchange_layer = real
    p2l = runtime.placement.physical_to_logical
    assert np.array_equal(p2l[:2], target[:2]) and np.array_equal(p2l[2:], old.physical_to_logical[2:])
    _check_slots(args, runtime, device)  # every layer, the failed one too, matches its maps
    x = sample_tokens(args, 32, seed=rank, device=device)
    torch.testing.assert_close(model(x), DenseMoEModel(args, device=device)(x), rtol=1e-5, atol=1e-5)
    dist.barrier()


def test_runtime_verification_failure_keeps_earlier_layers():
    run_distributed(_runtime_corrupt_body, 2, timeout=120)


def test_verify_transfers_config_field():
    from eplb.core.config import EplbConfig

    assert EplbConfig().verify_transfers is False
    assert EplbConfig(verify_transfers=True).verify(8, 2, num_physical_experts=8).verify_transfers
    with pytest.raises(ValueError, match="verify_transfers must be a bool"):
        EplbConfig(verify_transfers=1).verify(8, 2)


# ---- cost of verification (not a test): python tests/test_transfer_fuzz.py -------------

def _cost_body(rank: int, world: int, L: int, N: int, S: int, shape: tuple, reps: int) -> None:
    P = world * S
    local = slice(rank * S, (rank + 1) * S)
    seq = [np.tile(np.arange(P) % N, (L, 1))]
    # 2 tensors per layer; replicas of one expert hold the same values (a function of expert)
    base = torch.randn(N, *shape, generator=torch.Generator().manual_seed(0))  # [N, *shape]
    experts = torch.from_numpy(seq[0][0, local])
    weights = [[base[experts] + layer + t for t in range(2)] for layer in range(L)]
    rng = np.random.default_rng(0)
    seq += [np.stack([rng.permutation(seq[0][0]) for _ in range(L)]) for _ in range(2 * reps)]
    times = {False: [], True: []}
    for i, (old, new) in enumerate(zip(seq[:-1], seq[1:])):
        verify = bool(i % 2)
        dist.barrier()
        t0 = time.perf_counter()
        TransferExecutor(verify=verify).execute(old, new, weights)
        dist.barrier()
        times[verify].append(time.perf_counter() - t0)
    if rank == 0:
        mb = L * S * 2 * int(np.prod(shape)) * 4 / 1e6
        plain, ver = np.median(times[False]), np.median(times[True])
        print(f"{world} gloo ranks, {L} layers, {S} slots/rank, {N} experts, 2 x {shape} float32 "
              f"per expert ({mb:.1f} MB of local expert weights per rank): median of {reps} "
              f"full-permutation transfers: {plain * 1e3:.1f} ms plain, {ver * 1e3:.1f} ms verified "
              f"(+{(ver / plain - 1) * 100:.0f}%)")


if __name__ == "__main__":
    run_distributed(_cost_body, 4, 8, 16, 5, (256, 256), 10, timeout=600)
