"""The pure transfer planner: plans of all ranks together must match and be complete."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.core.senders import assign_senders
from eplb.core.transfer_plan import (
    LayerTransferPlan,
    in_place_ops,
    plan_layer_transfer,
    plan_layer_transfers,
    transfer_stats,
)


def random_row(rng, N: int, P: int) -> np.ndarray:  # [P]
    """Every expert at least once, the redundant slots random (duplicates on a rank happen)."""
    row = np.concatenate([np.arange(N), rng.integers(0, N, P - N)])
    return rng.permutation(row)


def simulate(old, new, plans: list[LayerTransferPlan]) -> None:
    """Run all ranks' plans on integer slot contents and check every invariant."""
    M = len(plans)
    S = len(old) // M
    old_r = np.asarray(old).reshape(M, S)  # [M, S]
    new_r = np.asarray(new).reshape(M, S)  # [M, S]

    # every send matches one receive with the same expert, in the same order per pair
    sends = defaultdict(list)  # (src, dst) -> experts in op order
    recvs = defaultdict(list)
    payload = {}  # (src, dst, expert) -> what the sender's slot holds before any write
    for p in plans:
        for kind, peer, expert, idx in p.p2p_ops():
            if kind == "send":
                assert old_r[p.rank, idx] == expert, "sender slot must hold the expert in old"
                sends[(p.rank, peer)].append(expert)
                payload[(p.rank, peer, expert)] = old_r[p.rank, idx]
            else:
                assert p.stage_expert[idx] == expert
                recvs[(peer, p.rank)].append(expert)
    assert sends == recvs
    for (src, dst), experts in sends.items():
        assert src != dst
        assert experts == sorted(experts)
        assert expert_set_ok(old_r[src], experts)

    for p in plans:
        r = p.rank
        assert p.num_staged <= S
        contents = old_r[r].copy()  # [S]
        staging = np.full(p.num_staged, -1)  # [K]
        # each remote expert received at most once, and only if not held locally in old
        got = p.stage_expert[p.recv_rows]
        assert len(set(got.tolist())) == len(got)
        assert not np.isin(got, old_r[r]).any()
        for k in range(p.num_staged):
            if p.stage_src_slot[k] >= 0:
                staging[k] = contents[p.stage_src_slot[k]]
            else:
                src = p.stage_src_rank[k]
                assert src != r and p.stage_expert[k] in old_r[src]
                staging[k] = payload[(src, r, p.stage_expert[k])]
        assert (staging == p.stage_expert).all()
        unchanged = old_r[r] == new_r[r]  # [S]
        assert np.array_equal(p.unchanged, np.flatnonzero(unchanged))
        assert not np.isin(p.write_dst, p.unchanged).any(), "unchanged slot written"
        assert len(set(p.write_dst.tolist())) == len(p.write_dst)
        for dst, src, st in zip(p.write_dst, p.write_src, p.write_from_stage):
            if not st:
                assert unchanged[src], "direct copies only read slots that are never written"
            contents[dst] = staging[src] if st else contents[src]
        assert np.array_equal(contents, new_r[r])
        assert p.num_slots_written == int((~unchanged).sum())


def expert_set_ok(src_row, experts) -> bool:
    return all(e in src_row for e in experts) and len(set(experts)) == len(experts)


CASES = [  # (N, P, M)
    (8, 8, 2), (8, 12, 4), (16, 24, 4), (6, 16, 8), (5, 8, 1), (32, 40, 8), (4, 16, 4),
]


@pytest.mark.parametrize("N,P,M", CASES)
def test_random_transitions(N, P, M):
    rng = np.random.default_rng(N * 1000 + P * 10 + M)
    for _ in range(40):
        old, new = random_row(rng, N, P), random_row(rng, N, P)
        simulate(old, new, plan_layer_transfers(old, new, M))


def test_special_cases():
    N, P, M = 8, 16, 4
    S = P // M
    rng = np.random.default_rng(0)
    base = random_row(rng, N, P)
    # no change: nothing at all happens
    for p in plan_layer_transfers(base, base, M):
        assert p.is_noop and p.num_staged == 0 and len(p.unchanged) == S
    # full permutation of distinct experts
    old = np.arange(P) % N
    perm = rng.permutation(old)
    simulate(old, perm, plan_layer_transfers(old, perm, M))
    perm = rng.permutation(P) % N
    simulate(old, perm, plan_layer_transfers(old, perm, M))
    # a hot expert replicated on every rank; the others fill the rest
    new = np.concatenate([np.arange(1, N), rng.integers(1, N, P - N - M + 1)])
    new = rng.permutation(new).reshape(M, S - 1)
    new = np.concatenate([np.zeros((M, 1), int), new], 1).ravel()
    plans = plan_layer_transfers(old, new, M)
    simulate(old, new, plans)
    # expert 0 lives on ranks 0 and 2 in `old`: it goes to ranks 1, 3, one send each
    senders = Counter(int(p.rank) for p in plans for e in p.send_expert if e == 0)
    assert sum(senders.values()) == 2 and max(senders.values()) == 1
    # one expert on every slot of a rank, from a single remote holder: received once
    old = np.arange(P) % N
    new = old.copy()
    new[:S] = 7  # rank 0 holds only expert 7 (slots 0..3); 0..3 move to rank 3
    new[3 * S:] = [0, 1, 2, 3]
    plans = plan_layer_transfers(old, new, M)
    simulate(old, new, plans)
    assert plans[0].num_received == 1 and plans[0].num_slots_written == S
    # duplicates of one expert on a rank, filled from one local slot that changes too
    old = np.arange(P) % N
    new = old.copy()
    new[0:3] = [1, 1, 0]  # rank 0: [0 1 2 3] -> [1 1 0 3]
    new[4:8] = [2, 5, 6, 7]  # rank 1 loses expert 4, which rank 3 still has
    new[12:16] = [4, 2, 6, 7]
    simulate(old, new, plan_layer_transfers(old, new, M))


def test_world_size_one_is_purely_local():
    rng = np.random.default_rng(1)
    for _ in range(20):
        old, new = random_row(rng, 6, 9), random_row(rng, 6, 9)
        (p,) = plan_layer_transfers(old, new, 1)
        assert p.num_sent == 0 and p.num_received == 0 and p.p2p_ops() == []
        simulate(old, new, [p])


def test_senders_spread_and_prefer_own_node():
    # expert 0 held on ranks 0 and 4 (node 0: ranks 0-3, node 1: ranks 4-7), wanted everywhere
    M, S = 8, 2
    old = np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 14])  # [P]
    new = old.copy()
    new[1::S] = 0
    new[1] = 1  # ranks 0 and 4 keep their copy in slot 0 (and 1 stays at slot 1 on rank 0)
    new[9] = 8
    plans = plan_layer_transfers(old, new, M, num_nodes=2)
    simulate(old, new, plans)
    for p in plans:
        for e, peer in zip(p.send_expert, p.send_peer):
            if e == 0:
                assert p.rank // 4 == peer // 4, "sender should be on the receiver's node"
    # without nodes the 6 receivers split 3/3 between the two holders
    plans = plan_layer_transfers(old, new, M)
    simulate(old, new, plans)
    assert sorted(p.num_sent for p in plans if p.num_sent) == [3, 3]


def test_falls_back_to_other_node():
    M = 4
    old = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # expert 0 only on rank 0 (node 0)
    new = np.array([0, 1, 2, 3, 4, 5, 0, 7])  # rank 3 (node 1) wants it
    plans = plan_layer_transfers(old, new, M, num_nodes=2)
    simulate(old, new, plans)
    assert plans[0].send_peer.tolist() == [3]


def test_senders_balance_across_experts():
    # every expert has two holders; the greedy must not pile all sends on one of them
    N, M = 8, 4
    old = np.tile(np.arange(N), 2)  # [P] ranks 0-1 and ranks 2-3 each hold all experts
    new = np.array([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7])  # [P]
    plans = plan_layer_transfers(old, new, M)  # rank 1 needs 0-3 from {0, 2}, rank 2 4-7 from {1, 3}
    simulate(old, new, plans)
    assert [p.num_sent for p in plans] == [2, 2, 2, 2]


def test_deterministic_and_per_rank_equals_all_ranks():
    rng = np.random.default_rng(7)
    for _ in range(10):
        old, new = random_row(rng, 12, 24), random_row(rng, 12, 24)
        a = assign_senders(old, new, 4, 2)
        b = assign_senders(old.copy(), new.copy(), 4, 2)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        all_plans = plan_layer_transfers(old, new, 4, 2)
        for r in range(4):
            single = plan_layer_transfer(old, new, 4, r, 2)
            for f in LayerTransferPlan.__dataclass_fields__:
                x, y = getattr(single, f), getattr(all_plans[r], f)
                assert np.array_equal(x, y), f


def test_transfer_stats_matches_plans():
    rng = np.random.default_rng(3)
    L, N, P, M = 5, 10, 16, 4
    old = np.stack([random_row(rng, N, P) for _ in range(L)])  # [L, P]
    new = np.stack([random_row(rng, N, P) for _ in range(L)])  # [L, P]
    new[2] = old[2]
    moved = local = written = 0
    for layer in range(L):
        for p in plan_layer_transfers(old[layer], new[layer], M):
            moved += p.num_received
            local += p.num_local_copies
            written += p.num_slots_written
    st = transfer_stats(Placement(old, N, M), Placement(new, N, M), M, bytes_per_expert=100)
    assert (st.experts_moved, st.local_copies, st.slots_changed) == (moved, local, written)
    assert st.bytes_moved == 100 * moved
    assert transfer_stats(old, old, M) == transfer_stats(old, old, M).__class__(0, 0, 0, None)


def test_bad_inputs():
    with pytest.raises(ValueError, match="divisible"):
        plan_layer_transfer(np.arange(6), np.arange(6), 4, 0)
    with pytest.raises(ValueError, match="no rank holds"):
        plan_layer_transfers(np.array([0, 1, 1, 0]), np.array([0, 1, 2, 0]), 2)
    with pytest.raises(ValueError, match="rank"):
        plan_layer_transfer(np.arange(4), np.arange(4), 2, 2)
    with pytest.raises(ValueError, match="num_nodes"):
        plan_layer_transfer(np.arange(4), np.arange(4), 2, 0, num_nodes=3)


def test_receivers_know_the_slot_their_sender_reads():
    """`stage_src_peer_slot` (what the IPC transport pulls from, with no message): for
    every received row it is the very slot the sender's plan sends that expert from."""
    rng = np.random.default_rng(7)
    for M, N, P in ((2, 6, 8), (4, 10, 16), (4, 16, 16)):
        old = Placement.initial(1, N, P, M).physical_to_logical[0]
        for _ in range(20):
            new = np.concatenate([rng.permutation(N), rng.integers(0, N, P - N)])
            plans = plan_layer_transfers(old, new, M)
            for r, plan in enumerate(plans):
                local = plan.stage_src_rank < 0
                assert (plan.stage_src_peer_slot[local] == -1).all()
                for k in plan.recv_rows.tolist():
                    q, e = int(plan.stage_src_rank[k]), int(plan.stage_expert[k])
                    sender = plans[q]
                    hit = np.flatnonzero((sender.send_expert == e) & (sender.send_peer == r))
                    assert hit.size == 1
                    assert sender.send_slot[hit[0]] == plan.stage_src_peer_slot[k]


def run_in_place(old, new, M: int, rng) -> np.ndarray:
    """Carry out the in-place move of every rank on integer slot contents: all holds first,
    then every rank's sends (written into the receiver's slot) and local writes
    interleaved at random, then the further copies of received experts; every read
    asserts that what it reads is still the expert it wants. Returns `[P]`."""
    plans = plan_layer_transfers(old, new, M)
    S = len(old) // M
    w = np.asarray(old).reshape(M, S).copy()  # [M, S] live slots
    changed = np.asarray(old).reshape(M, S) != np.asarray(new).reshape(M, S)  # [M, S]
    hold = [w[r, p.hold_slots].copy() for r, p in enumerate(plans)]  # [H_r] per rank
    ops = []  # (rank written, dst slot, expert wanted, read) with read() -> the expert copied
    for r, p in enumerate(plans):
        for e, q, slot, row, d in zip(p.send_expert, p.send_peer, p.send_slot, p.send_hold_row,
                                      p.send_dst_slot):
            assert row >= 0 or not changed[r, slot], "a changed slot must be sent from its hold"
            ops.append((int(q), int(d), int(e), (lambda r=r, row=row, slot=slot:
                                                 hold[r][row] if row >= 0 else w[r, slot])))
        o = in_place_ops(p)
        for d, h, src in zip(o.local_dst, o.local_hold_row, o.local_src_slot):
            assert h >= 0 or not changed[r, src]
            ops.append((r, int(d), int(new[r * S + d]),
                        (lambda r=r, h=h, src=src: hold[r][h] if h >= 0 else w[r, src])))
    written = Counter()
    for i in rng.permutation(len(ops)).tolist():
        r, d, want, read = ops[i]
        got = read()
        assert got == want, f"rank {r} slot {d}: read expert {got}, wanted {want}"
        w[r, d] = got
        written[(r, d)] += 1
    for r, p in enumerate(plans):  # once every sender is done
        o = in_place_ops(p)
        for d, src in zip(o.dup_dst, o.dup_src):
            w[r, d] = w[r, src]
            written[(r, int(d))] += 1
    assert set(written) == {(r, d) for r, d in zip(*np.nonzero(changed))}
    assert max(written.values(), default=1) == 1, "a slot written twice"
    for r, p in enumerate(plans):
        assert len(p.hold_slots) <= S and changed[r, p.hold_slots].all()
        sends_changed = changed[r, p.send_slot]
        assert ((p.send_hold_row >= 0) == sends_changed).all()
        assert (p.hold_slots[p.send_hold_row[sends_changed]] == p.send_slot[sends_changed]).all()
    return w.reshape(-1)


def test_in_place_move_ends_on_the_new_placement_in_any_write_order():
    """The hold rows let every rank write its changed slots straight away (no staging of
    received experts): with all holds done first, any interleaving of the ranks' writes
    reads only hold rows or unchanged slots and ends exactly on `new`."""
    rng = np.random.default_rng(11)
    for M, N, P in ((2, 8, 8), (2, 6, 8), (4, 10, 16), (4, 16, 16), (8, 24, 32)):
        old_fixed = Placement.initial(1, N, P, M).physical_to_logical[0]
        for t in range(25):
            old = old_fixed if t % 2 else random_row(rng, N, P)
            new = random_row(rng, N, P)
            assert np.array_equal(run_in_place(old, new, M, rng), new)
    swap = np.concatenate([np.arange(8, 16), np.arange(8)])  # every expert changes rank
    assert np.array_equal(run_in_place(np.arange(16), swap, 2, rng), swap)


def test_senders_know_where_their_receiver_wants_each_expert():
    """`send_dst_slot` / `send_dst_hold_row`, computed by the sender alone from the layer
    rows, are the receiver's own `recv_dst` for that expert and its hold row of that slot
    (the hold chunk whose completion the sender waits for)."""
    rng = np.random.default_rng(5)
    for M, N, P in ((2, 6, 8), (4, 10, 16)):
        for _ in range(30):
            old, new = random_row(rng, N, P), random_row(rng, N, P)
            plans = plan_layer_transfers(old, new, M)
            for r, plan in enumerate(plans):
                o = in_place_ops(plan)
                for k, (q, d) in enumerate(zip(o.recv_peer.tolist(), o.recv_dst.tolist())):
                    e = int(plan.stage_expert[plan.recv_rows[k]])
                    hit = np.flatnonzero((plans[q].send_expert == e) & (plans[q].send_peer == r))
                    assert hit.size == 1 and plans[q].send_dst_slot[hit[0]] == d
                    held = np.flatnonzero(plan.hold_slots == d)
                    assert plans[q].send_dst_hold_row[hit[0]] == (held[0] if held.size else -1)
