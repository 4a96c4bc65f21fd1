"""Fuzzed placement transitions through the production path, `EplbRuntime` ->
`PlacementChange`, on gloo ranks, and transfer verification (EplbConfig.verify_transfers).

Counting: one *transition* is one `runtime.apply_placement(new)` from the placement in
force to the next: synchronously (`wait=True`) or asynchronously (`wait=False`, then
`runtime.step()` until it is done; `EplbConfig(async_rebalance=True)`). The reference
model (`moe.MoEModel`) has L_FUZZ = 2 MoE layers; each layer's change is drawn
independently from KINDS (some transitions are identical as a whole). After every
transition, on every rank: every local slot of every layer equals bitwise its expert's
reference weights (`moe.expert_weights_for`), the routing maps equal the weights
(`check_routing_maps`: physical_to_logical, logical_to_physical_map,
logical_replica_count) and the placement asked for, the replica cdf equals the
placement's shares, every rank holds the same maps, and storage never moves
(`data_ptr`). Asynchronously the same holds
after every step, every rank's maps are compared with every other rank's after every
step, and at most one layer switches per step. Every SAMPLE_EVERY-th transition the
model's outputs are compared with the dense reference (mid-flight too, asynchronously).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import assert_same_on_every_rank, device_for, run_distributed
from _faults import Fault, moving_target, p2p_transport
from eplb.runtime.verify import slot_checksums

L_FUZZ = 2
SAMPLE_EVERY = 50
# per layer; "shares" (only the replica shares change) needs weighted replicas
KINDS = ("random", "same", "permute", "hot", "dup_on_rank", "swap", "move_replica", "shares")
# a transition that changes nothing at all (placement and shares): every
# IDENTICAL_EVERY-th and with probability P_IDENTICAL
IDENTICAL_EVERY, P_IDENTICAL = 25, 0.03


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
    if kind in ("same", "shares"):
        return prev.copy()
    if kind == "permute":  # every expert stays, slots shuffled over all ranks
        return rng.permutation(prev)
    if kind == "swap":  # two slots exchange their experts
        row = prev.copy()
        i, j = rng.choice(P, 2, replace=False)
        row[i], row[j] = row[j], row[i]
        return row
    if kind == "move_replica":  # a replica of an expert with several moves to another rank
        row = prev.copy()
        counts = np.bincount(row, minlength=N)
        src = int(rng.choice(np.flatnonzero(counts[row] > 1)))
        others = np.flatnonzero(np.arange(P) // S != src // S)
        dst = int(rng.choice(others))
        row[src], row[dst] = row[dst], row[src]
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


def random_shares(rng, p2l: np.ndarray, N: int) -> np.ndarray:  # [L, P]
    """Each expert's replicas get random positive shares summing to 1."""
    shares = np.zeros(p2l.shape)
    for layer, row in enumerate(p2l):
        for e in range(N):
            slots = np.flatnonzero(row == e)
            shares[layer, slots] = rng.dirichlet(np.ones(len(slots)))
    return shares


def fuzz_sequence(seed: int, n: int, L: int, N: int, P: int, M: int, weighted: bool):
    """n + 1 (p2l [L, P], shares [L, P] or None, kinds); the first is the initial placement."""
    rng = np.random.default_rng(seed)
    cur, shares = np.tile(np.arange(P) % N, (L, 1)), None
    yield cur, None, ("init",) * L
    kinds_of = KINDS if weighted else tuple(k for k in KINDS if k != "shares")
    for i in range(n):
        if i % IDENTICAL_EVERY == IDENTICAL_EVERY // 2 or rng.random() < P_IDENTICAL:
            yield cur, shares, ("identical",) * L
            continue
        kinds = tuple(kinds_of[int(rng.integers(len(kinds_of)))] for _ in range(L))
        new = np.stack([next_row(rng, cur[layer], N, M, k) for layer, k in enumerate(kinds)])
        for row in new:
            assert set(row.tolist()) == set(range(N))
        new_shares = None
        if weighted and ("shares" in kinds or rng.random() < 0.5):
            new_shares = random_shares(rng, new, N)
            if shares is not None:  # layers of another kind keep their shares where they can
                for layer, k in enumerate(kinds):
                    if k == "same":
                        new_shares[layer] = shares[layer]
        cur, shares = new, new_shares
        yield cur, shares, kinds


# ---- the fuzz body ---------------------------------------------------------------------

class Reference:
    """Every (layer, expert)'s reference weights, built once."""

    def __init__(self, args, device) -> None:
        from moe import expert_weights_for

        self.w = [[expert_weights_for(args, layer, e, device) for e in range(args.num_experts)]
                  for layer in range(args.num_layers)]

    def check_slots(self, runtime) -> None:
        """Every local slot holds bitwise the expert the committed map names."""
        S = runtime.model.num_local_physical_experts
        p2l = runtime.physical_to_logical.cpu().numpy()  # [L, P]
        for layer, weights in enumerate(runtime.expert_weights):
            for s in range(S):
                e = int(p2l[layer, runtime.rank * S + s])
                for w, v in zip(weights, self.w[layer][e]):
                    assert torch.equal(w[s], v), f"layer {layer} slot {s} does not hold expert {e}"


def check_state(ref: Reference, runtime) -> None:
    from test_runtime import check_routing_maps

    check_routing_maps(runtime)
    ref.check_slots(runtime)


def check_target(runtime, p2l: np.ndarray, shares) -> None:
    """The runtime ended on the placement asked for: maps, shares and replica cdf."""
    from moe.model import replica_cdf_for

    placement = runtime.placement
    assert np.array_equal(placement.physical_to_logical, p2l)
    assert np.array_equal(runtime.physical_to_logical.cpu().numpy(), p2l)
    if shares is None:
        assert placement.shares is None
    else:
        assert np.array_equal(placement.shares, shares)
    want = replica_cdf_for(placement, "cpu", runtime.logical_replica_cdf.shape[-1])
    assert torch.equal(runtime.logical_replica_cdf.cpu(), want)


def check_outputs(args, model, dense, seed: int, device) -> None:
    from moe import sample_tokens

    x = sample_tokens(args, 16, seed=seed, device=device)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)


def same_maps_on_every_rank(runtime) -> None:
    """Every rank holds the same physical_to_logical, logical_to_physical_map,
    logical_replica_count and logical_replica_cdf (bitwise; one all_gather)."""
    cdf = runtime.logical_replica_cdf.contiguous().view(torch.int32).to(torch.int64)
    assert_same_on_every_rank(torch.cat([
        runtime.physical_to_logical.reshape(-1), runtime.logical_to_physical_map.reshape(-1),
        runtime.logical_replica_count.reshape(-1), cdf.reshape(-1)]).cpu())


def _fuzz_runs(rank: int, world: int, runs: list, N: int, S: int, times: list | None = None) -> None:
    """`runs`: (seed, n, asynchronous, transport, verify, weighted); each builds a fresh
    model and runtime and applies n random transitions."""
    from moe import DenseMoEModel, MoEArgs, MoEModel

    from eplb.core.config import EplbConfig
    from eplb.runtime import EplbRuntime

    device = device_for(rank)
    P = world * S
    for seed, n, asynchronous, transport, verify, weighted in runs:
        t0 = time.perf_counter()
        args = MoEArgs(hidden_size=8, intermediate_size=4, num_layers=L_FUZZ, num_experts=N,
                       top_k=2, num_redundant_experts=P - N, seed=seed % 7)
        model = MoEModel(args, group=dist.group.WORLD, device=device)
        dense = DenseMoEModel(args, device=device)
        ref = Reference(args, device)
        # the fuzz goes through an injected transport with no fault: every exchange of
        # the runtime must reach the object it was given
        injected = p2p_transport(rank=rank) if transport == "injected" else None
        runtime = EplbRuntime(model, EplbConfig(
            num_redundant_experts=P - N, rebalance_interval=0, control_interval=0,
            async_rebalance=asynchronous, transport="nccl" if injected else transport,
            verify_transfers=verify, weighted_replicas=weighted, transfer_timeout=60),
            transport=injected)
        assert runtime.transport.name == "nccl"  # gloo point-to-point ("auto" falls back)
        assert runtime.routing.supported
        failures = []
        runtime.add_failure_listener(lambda trigger, e: failures.append(e))
        ptrs = [w.data_ptr() for ws in runtime.expert_weights for w in ws]
        seq = fuzz_sequence(seed, n, L_FUZZ, N, P, world, weighted)
        next(seq)
        check_state(ref, runtime)
        done, kinds_seen, steps, moved = 0, set(), 0, 0
        for i, (p2l, shares, kinds) in enumerate(seq):
            new = runtime.placement.with_physical_to_logical(p2l, "fuzz", shares)
            sample = i % SAMPLE_EVERY == SAMPLE_EVERY - 1
            before = runtime.physical_to_logical.clone()
            if not asynchronous:
                event = runtime.apply_placement(new, wait=True)
                assert event is not None
            else:
                assert runtime.apply_placement(new, wait=False) is None
                event = None
                for _ in range(100):  # 2 layers: a handful of steps
                    prev = runtime.physical_to_logical.clone()
                    event = runtime.step()
                    steps += 1
                    # every rank routes by the same maps after every step, and the weights
                    # match them mid-flight
                    same_maps_on_every_rank(runtime)
                    check_state(ref, runtime)
                    assert (runtime.physical_to_logical != prev).any(1).sum() <= 1
                    if sample:
                        check_outputs(args, model, dense, 1000 * i + steps, device)
                    if not runtime.rebalance_in_flight:
                        break
                assert not runtime.rebalance_in_flight, "the change did not finish in 100 steps"
                assert event is not None
            assert not failures, failures
            check_state(ref, runtime)
            check_target(runtime, p2l, shares)
            moved += int((runtime.physical_to_logical != before).any(1).sum())
            same_maps_on_every_rank(runtime)
            if sample:
                check_outputs(args, model, dense, 7 + i, device)
            done += 1
            kinds_seen.update(kinds)
        assert done == n
        want = set(KINDS if weighted else [k for k in KINDS if k != "shares"]) | {"identical"}
        assert kinds_seen == want, want - kinds_seen
        assert moved > 0
        assert [w.data_ptr() for ws in runtime.expert_weights for w in ws] == ptrs
        if injected is not None:
            assert injected.calls["exchange"] > 0, "the runtime did not use the injected transport"
        same_maps_on_every_rank(runtime)
        check_outputs(args, model, dense, 99, device)
        runtime.close()
        if times is not None:
            times.append((seed, n, asynchronous, transport, verify, weighted,
                          time.perf_counter() - t0))
    if rank == 0 and times is not None:
        for seed, n, a, t, v, w, sec in times:
            print(f"\n  {world} ranks, {'async' if a else 'sync '} {t:8s} verify={v!s:5} "
                  f"weighted={w!s:5}: {n} transitions in {sec:.1f} s", end="")


# (seed, transitions, asynchronous, transport, verify_transfers, weighted_replicas)
DEFAULT_RUNS = [
    (101, 60, False, "nccl", False, False),
    (102, 50, False, "auto", True, True),
    (103, 50, True, "injected", True, False),
    (104, 50, True, "auto", False, True),
]


def test_fuzz_transitions_4_ranks():
    """Default suite: 210 transitions on 4 ranks, sync and async, nccl (gloo p2p), auto and
    an injected transport, with and without verification, weighted replicas in half."""
    assert sum(r[1] for r in DEFAULT_RUNS) >= 200
    run_distributed(_fuzz_runs, 4, DEFAULT_RUNS, 6, 3, [], timeout=300)


def _slow_runs(world: int, total: int) -> list:
    q = total // 4
    return [(1000 + world, q, False, "nccl", False, False),
            (1001 + world, q, False, "auto", True, True),
            (1002 + world, q, True, "injected", True, True),
            (1003 + world, total - 3 * q, True, "nccl", False, False)]


@pytest.mark.slow
@pytest.mark.parametrize("world,N,S,total", [(4, 6, 3, 5000), (8, 10, 2, 2500)])
def test_fuzz_transitions_slow(world, N, S, total):
    """Slow suite: 5,000 transitions on 4 ranks and 2,500 on 8 ranks, half of them
    asynchronous."""
    runs = _slow_runs(world, total)
    assert sum(r[1] for r in runs) == total
    t0 = time.perf_counter()
    run_distributed(_fuzz_runs, world, runs, N, S, [], timeout=3000)
    print(f"\n{world} ranks: {total} transitions in {time.perf_counter() - t0:.1f} s")


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


def _corrupt_body(rank: int, world: int, asynchronous: bool, action: str, bad_layer: int,
                  bad_rank: int, verify: bool) -> None:
    """Through EplbRuntime: rank `bad_rank`'s injected transport flips a bit at a random
    offset of every weight tensor ("corrupt") or of w2 only ("corrupt_w2") of one staged
    expert of changed layer `bad_layer`. With verify_transfers the change fails on every
    rank before that layer is written (RebalanceError; asynchronously through the failure
    listener): earlier layers new, it and later ones old, maps matching weights, outputs
    equal to the dense reference, and the next change goes through. Without verification
    (the control) the bad bits land in a slot and the slot check sees them."""
    from moe import DenseMoEModel, MoEArgs, MoEModel

    from eplb.core.config import EplbConfig
    from eplb.runtime import EplbRuntime, RebalanceError

    device = device_for(rank)
    L, N = 4, 8
    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=L, num_experts=N, top_k=2,
                   num_redundant_experts=world, seed=5)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    fault = Fault("exchange", bad_layer + 1, action, ranks=[bad_rank], seed=bad_layer)
    transport = p2p_transport([fault], rank)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, rebalance_interval=0,
                                            control_interval=0, async_rebalance=asynchronous,
                                            verify_transfers=verify, transfer_timeout=30),
                          transport=transport)
    ref, dense = Reference(args, device), DenseMoEModel(args, device=device)
    failures = []
    runtime.add_failure_listener(lambda trigger, e: failures.append(e))
    old = runtime.placement
    target = moving_target(old.physical_to_logical, world, N, seed=11)  # same on every rank
    new = old.with_physical_to_logical(target, "test")
    if not verify:  # the control: the corruption is real and the slot check sees it
        runtime.apply_placement(new, wait=not asynchronous)
        runtime.finish_rebalance()
        assert bool(fault.fired) == (rank == bad_rank)
        if rank == bad_rank:
            with pytest.raises(AssertionError, match="does not hold expert"):
                ref.check_slots(runtime)
        dist.barrier()
        return
    expect = f"after {bad_layer} of {L} changed layers"
    if asynchronous:
        assert runtime.apply_placement(new, wait=False) is None
        for _ in range(500):
            runtime.step()
            same_maps_on_every_rank(runtime)
            check_state(ref, runtime)
            if not runtime.rebalance_in_flight:
                break
        assert len(failures) == 1 and isinstance(failures[0], RebalanceError), failures
        assert expect in str(failures[0]), failures[0]
    else:
        with pytest.raises(RebalanceError, match=expect + ".*(TransferVerificationError|rank . failed)"):
            runtime.apply_placement(new)
    assert not runtime.rebalance_in_flight
    if rank == bad_rank:
        (row, flips), = fault.fired
        assert [t for t, _, _ in flips] == ([1] if action == "corrupt_w2" else [0, 1])
    else:
        assert not fault.fired
    p2l = runtime.placement.physical_to_logical
    assert np.array_equal(p2l[:bad_layer], target[:bad_layer])
    assert np.array_equal(p2l[bad_layer:], old.physical_to_logical[bad_layer:])
    assert np.array_equal(runtime.physical_to_logical.cpu().numpy(), p2l)
    check_state(ref, runtime)  # every layer, the failed one too, matches its maps
    same_maps_on_every_rank(runtime)
    check_outputs(args, model, dense, rank, device)
    runtime.apply_placement(new)  # the fault fired once: the next change goes through
    check_state(ref, runtime)
    check_target(runtime, target, None)
    check_outputs(args, model, dense, rank + 10, device)
    runtime.close()


@pytest.mark.parametrize("asynchronous,action,bad_layer,bad_rank", [
    (False, "corrupt", 2, 0), (False, "corrupt_w2", 1, 3), (True, "corrupt", 0, 2),
    (True, "corrupt_w2", 3, 1)])
def test_corruption_is_caught_before_the_layer_is_written(asynchronous, action, bad_layer, bad_rank):
    run_distributed(_corrupt_body, 4, asynchronous, action, bad_layer, bad_rank, True, timeout=120)


def test_corruption_without_verification_reaches_the_weights():
    """The control of the test above: the injected corruption is real."""
    run_distributed(_corrupt_body, 2, False, "corrupt", 1, 1, False, timeout=120)


def test_verify_transfers_config_field():
    from eplb.core.config import EplbConfig

    assert EplbConfig().verify_transfers is False
    assert EplbConfig(verify_transfers=True).verify(8, 2, num_physical_experts=8).verify_transfers
    with pytest.raises(ValueError, match="verify_transfers must be a bool"):
        EplbConfig(verify_transfers=1).verify(8, 2)


# ---- cost of verification (not a test): python tests/test_transfer_fuzz.py -------------

def _cost_body(rank: int, world: int, L: int, N: int, S: int, hidden: int, reps: int) -> None:
    """Median time of `apply_placement` (synchronous, full permutation of every layer)
    with and without verify_transfers, on the reference model."""
    from moe import MoEArgs, MoEModel

    from eplb.core.config import EplbConfig
    from eplb.runtime import EplbRuntime

    P = world * S
    args = MoEArgs(hidden_size=hidden, intermediate_size=hidden // 2, num_layers=L,
                   num_experts=N, top_k=2, num_redundant_experts=P - N, seed=0)
    rng = np.random.default_rng(0)
    times = {}
    for verify in (False, True):
        model = MoEModel(args, group=dist.group.WORLD)
        runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=P - N, rebalance_interval=0,
                                                control_interval=0, verify_transfers=verify))
        times[verify] = []
        for _ in range(reps):
            p2l = runtime.placement.physical_to_logical
            new = runtime.placement.with_physical_to_logical(
                np.stack([rng.permutation(row) for row in p2l]), "cost")
            dist.barrier()
            t0 = time.perf_counter()
            runtime.apply_placement(new)
            dist.barrier()
            times[verify].append(time.perf_counter() - t0)
        runtime.close()
    if rank == 0:
        mb = L * S * 3 * hidden * (hidden // 2) * 4 / 1e6
        plain, ver = np.median(times[False]), np.median(times[True])
        print(f"{world} gloo ranks, {L} layers, {S} slots/rank, {N} experts, hidden {hidden} "
              f"({mb:.1f} MB of local expert weights per rank): median of {reps} "
              f"full-permutation apply_placement: {plain * 1e3:.1f} ms plain, {ver * 1e3:.1f} ms "
              f"verified (+{(ver / plain - 1) * 100:.0f}%)")


if __name__ == "__main__":
    run_distributed(_cost_body, 4, 8, 16, 5, 256, 10, timeout=600)
