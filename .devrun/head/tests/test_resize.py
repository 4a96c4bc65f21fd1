"""Planned resize of the EP group (eplb.runtime.resize) and the model methods it uses.

The pure plan is checked by simulating it on expert ids and against a naive
re-implementation; the whole resize runs on real gloo ranks (4 -> 2 -> 4, 2 -> 4 with
idle ranks joining and P changing, 2 -> 1 -> 2 with a rank outside each): afterwards
every slot holds its expert bitwise, the expert-parallel model equals the dense reference
on every rank of the new group, and a rebalance inside the new group still works.
Requests that cannot work fail with ValueError on every rank involved, and a valid
resize after them still succeeds (nobody hung, nothing moved); a value corrupted in
flight fails the resize's checksum verification on every rank.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import assert_same_on_every_rank, device_for, run_distributed
from _faults import PolicySwitch
from eplb import EplbFatalError, RebalanceError
from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.core.planning import plan
from eplb.runtime.resize import plan_resize
from eplb.runtime.resize_transfer import ResizeVerificationError


def _args(**kw):
    from moe import MoEArgs

    base = dict(hidden_size=32, intermediate_size=16, num_layers=2, num_experts=8, top_k=2,
                num_redundant_experts=4, seed=5)
    base.update(kw)
    return MoEArgs(**base)


# ---- the pure plan ---------------------------------------------------------------------

def _simulate(rs, old_p2l, new_p2l):
    """Run the plan on expert ids: returns new slots [L, P_new] as filled, and checks that
    every sender holds what it sends and every (receiver, expert) arrives once."""
    S_old, S_new = rs.slots_per_rank_old, rs.slots_per_rank_new
    filled = np.full(new_p2l.shape, -1)
    for layer, lp in enumerate(rs.layers):
        old_of = {r: old_p2l[layer, i * S_old:(i + 1) * S_old] for i, r in enumerate(rs.old_ranks)}
        base = {r: i * S_new for i, r in enumerate(rs.new_ranks)}
        seen = set()
        for e, sr, ss, dr, ds in zip(lp.recv_expert, lp.src_rank, lp.src_slot, lp.dst_rank, lp.dst_slot):
            assert old_of[int(sr)][ss] == e, "the sender does not hold the expert it sends"
            assert e not in old_of.get(int(dr), ()), "a network copy of an expert held locally"
            assert (int(dr), int(e)) not in seen
            seen.add((int(dr), int(e)))
            filled[layer, base[int(dr)] + ds] = e
        for r, d, s, from_new in zip(lp.copy_rank, lp.copy_dst, lp.copy_src, lp.copy_from_new):
            src = filled[layer, base[int(r)] + s] if from_new else old_of[int(r)][s]
            assert src >= 0
            filled[layer, base[int(r)] + d] = src
    return filled


@pytest.mark.parametrize("old_ranks,new_ranks,P_old,P_new", [
    ([0, 1, 2, 3], [0, 1], 12, 12),  # shrink, S 3 -> 6
    ([0, 1], [0, 1, 2, 3], 10, 12),  # grow, P changes too
    ([0, 1], [2, 3], 8, 8),  # move to other ranks
    ([0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 5], 16, 9),
])
def test_plan_fills_every_new_slot(old_ranks, new_ranks, P_old, P_new):
    rng = np.random.default_rng(1)
    N, L = 8, 3
    for _ in range(30):
        old = np.stack([rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P_old - N)]))
                        for _ in range(L)])
        new = np.stack([rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P_new - N)]))
                        for _ in range(L)])
        rs = plan_resize(old, new, old_ranks, new_ranks)
        assert np.array_equal(_simulate(rs, old, new), new)
        again = plan_resize(old, new, old_ranks, new_ranks)  # deterministic
        assert all(np.array_equal(a.src_rank, b.src_rank) for a, b in zip(rs.layers, again.layers))


def test_plan_prefers_same_node_and_spreads_senders():
    # one hot expert (0) held by every old rank, 4 ranks on 2 nodes grow to 8 ranks on 4 nodes
    old = np.array([[0, 1, 0, 2, 0, 3, 0, 4]])  # [1, 8], old ranks 0..3 hold expert 0
    new = np.array([[0, 1, 0, 2, 0, 3, 0, 4] * 2])  # [1, 16]: new ranks 0..7 (S = 2) all want expert 0
    rs = plan_resize(old, new, [0, 1, 2, 3], list(range(8)), ranks_per_node=2)
    lp = rs.layers[0]
    hot = lp.recv_expert == 0
    # receivers 4..7 sit on nodes without a holder; ranks 0..3 held expert 0 already
    assert sorted(lp.dst_rank[hot].tolist()) == [4, 5, 6, 7]
    counts = np.bincount(lp.src_rank[hot], minlength=4)
    assert counts.max() == 1, "the four copies of the hot expert come from four different holders"
    # same node first: ranks 0 and 1 share node 0; expert 1 only on rank 0, wanted by rank 1
    old = np.array([[1, 0, 2, 3, 1, 2, 3, 0]])  # ranks 0..3 (S = 2) on nodes 0, 0, 1, 1
    new = np.array([[0, 1, 2, 3, 1, 0, 2, 3]])  # same ranks
    lp = plan_resize(old, new, [0, 1, 2, 3], [0, 1, 2, 3], ranks_per_node=2).layers[0]
    for e, sr, dr in zip(lp.recv_expert, lp.src_rank, lp.dst_rank):
        holders = {p // 2 for p in range(8) if old[0, p] == e}
        if any(h // 2 == dr // 2 for h in holders):
            assert sr // 2 == dr // 2, (e, sr, dr)


def _reference_plan(old, new, old_ranks, new_ranks, ranks_per_node):
    """The resize plan written out naively, one layer at a time: per layer the network
    rows (expert, sender, sender's old slot, receiver, new slot) sorted by (expert,
    receiver), and the copy rows (rank, new slot, source slot, from a new slot)."""
    S_old, S_new = old.shape[1] // len(old_ranks), new.shape[1] // len(new_ranks)
    ring = max(old_ranks + new_ranks) + 1
    node = (lambda r: 0) if ranks_per_node is None else (lambda r: r // ranks_per_node)
    sends = {r: 0 for r in old_ranks}  # carried across layers
    layers = []
    for layer in range(old.shape[0]):
        held = {r: old[layer, i * S_old:(i + 1) * S_old].tolist() for i, r in enumerate(old_ranks)}
        copies, wanted, got = [], [], {}
        for q, e in enumerate(new[layer].tolist()):
            r, s = new_ranks[q // S_new], q % S_new
            if e in held.get(r, []):
                copies.append((r, s, held[r].index(e), False))
            elif (r, e) in got:
                copies.append((r, s, got[(r, e)], True))
            else:
                got[(r, e)] = s
                wanted.append((e, r, s))

        def candidates(e, r):
            everyone = [h for h in old_ranks if e in held[h]]
            return [h for h in everyone if node(h) == node(r)] or everyone

        sender, left = {}, list(wanted)
        while left:  # the scarcest pair first, to the least busy candidate, then the nearest
            e, r, s = min(left, key=lambda t: (len(candidates(t[0], t[1])), t[0], t[1]))
            left.remove((e, r, s))
            h = min(candidates(e, r), key=lambda h: (sends[h], (h - r) % ring))
            sends[h] += 1
            sender[(e, r)] = h
        rows = [(e, sender[(e, r)], held[sender[(e, r)]].index(e), r, s) for e, r, s in sorted(wanted)]
        layers.append((rows, copies))
    return layers


def test_plan_matches_a_straightforward_reimplementation():
    rng = np.random.default_rng(11)
    for _ in range(300):
        N, L, world = int(rng.integers(2, 10)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        old_ranks, new_ranks = (sorted(rng.choice(world, int(rng.integers(1, world + 1)),
                                                  replace=False).tolist()) for _ in range(2))
        if old_ranks == new_ranks:
            continue
        P_old, P_new = ((-(-N // len(r)) + int(rng.integers(0, 3))) * len(r) for r in (old_ranks, new_ranks))
        old, new = (np.stack([rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P - N)]))
                              for _ in range(L)]) for P in (P_old, P_new))
        rpn = [None, 1, 2, 3][int(rng.integers(0, 4))]
        rs = plan_resize(old, new, old_ranks, new_ranks, ranks_per_node=rpn)
        for lp, (rows, copies) in zip(rs.layers, _reference_plan(old, new, old_ranks, new_ranks, rpn)):
            got = list(zip(*(a.tolist() for a in (lp.recv_expert, lp.src_rank, lp.src_slot,
                                                  lp.dst_rank, lp.dst_slot))))
            assert got == rows, (old_ranks, new_ranks, rpn)
            assert list(zip(lp.copy_rank.tolist(), lp.copy_dst.tolist(), lp.copy_src.tolist(),
                            lp.copy_from_new.tolist())) == copies


def test_plan_rejects_bad_requests():
    old = Placement.initial(1, 8, 12, 4).physical_to_logical
    with pytest.raises(ValueError, match="new: 12 slots do not divide over 5 new_ranks"):
        plan_resize(old, old, [0, 1, 2, 3], [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="old_ranks: duplicate"):
        plan_resize(old, old, [0, 1, 1, 3], [0, 1])
    with pytest.raises(ValueError, match="new_ranks: must name at least one rank"):
        plan_resize(old, old, [0, 1, 2, 3], [])
    with pytest.raises(ValueError, match="new_ranks: ranks .* outside"):
        plan_resize(old, old, [0, 1, 2, 3], [-1, 0])
    partial = old.copy()
    partial[0, 8:] = 0  # experts 0..7 all still present
    with pytest.raises(ValueError, match=r"experts \[9\] are in the new placement"):
        plan_resize(partial, np.array([[9] + [0] * 11]), [0, 1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="layers"):
        plan_resize(old, np.concatenate([old, old]), [0, 1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="ranks_per_node"):
        plan_resize(old, old, [0, 1, 2, 3], [0, 1], ranks_per_node=0)


def _execute_body(rank, world):
    """The transfer alone (no runtime), on the test backend (gloo, or NCCL with 2 GPUs):
    one rank holding everything spreads to two, then the two shrink onto rank 1."""
    from eplb.runtime.resize_transfer import execute_resize

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    dist.all_reduce(torch.zeros(1, device=device))  # NCCL wants a collective before p2p
    rng = np.random.default_rng(4)  # same on every rank
    L, N = 3, 6

    def tensors(p2l_rows, S):  # [S, 5] float32 and [S, 2, 3] int64 per layer, values encode (layer, expert)
        out = []
        for layer, row in enumerate(p2l_rows):
            e = torch.as_tensor(row, device=device)  # [S]
            a = (layer * 100 + e)[:, None].float() + torch.arange(5, device=device)  # [S, 5]
            b = (layer * 100 + e)[:, None, None] * 10 + torch.arange(6, device=device).view(2, 3)  # [S, 2, 3]
            out.append([a.contiguous(), b.contiguous()])
        return out

    for old_ranks, new_ranks, P_old, P_new in (([0], [0, 1], 6, 10), ([0, 1], [1], 10, 8)):
        old = np.stack([rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P_old - N)]))
                        for _ in range(L)])  # [L, P_old]
        new = np.stack([rng.permutation(np.concatenate([np.arange(N), rng.integers(0, N, P_new - N)]))
                        for _ in range(L)])  # [L, P_new]
        rs = plan_resize(old, new, old_ranks, new_ranks)
        S_old, S_new = P_old // len(old_ranks), P_new // len(new_ranks)
        old_w = new_w = None
        if rank in old_ranks:
            i = old_ranks.index(rank)
            old_w = tensors(old[:, i * S_old:(i + 1) * S_old], S_old)
        if rank in new_ranks:
            i = new_ranks.index(rank)
            new_w = [[torch.full_like(t[:1].expand(S_new, *t.shape[1:]), -1).contiguous()
                      for t in tensors(new[:, :1], 1)[layer]] for layer in range(L)]
        execute_resize(rs, old_w, new_w, None)
        if new_w is not None:
            want = tensors(new[:, i * S_new:(i + 1) * S_new], S_new)
            for layer in range(L):
                for w, v in zip(new_w[layer], want[layer]):
                    assert torch.equal(w, v), (old_ranks, new_ranks, layer)
        dist.barrier()


def test_execute_spreads_and_gathers_2_ranks():
    run_distributed(_execute_body, 2)


# ---- model methods ---------------------------------------------------------------------

def test_model_reallocates_and_releases_slots():
    from moe import MoEModel, sample_tokens

    args = _args()
    model = MoEModel(args)  # one process, S = P = 12
    old = [list(ws) for ws in model.expert_weights]
    model.update_physical_experts_metadata(12, 6, reallocate=True)
    for layer, ws in enumerate(model.expert_weights):
        assert [tuple(w.shape) for w in ws] == [(6, 32, 32), (6, 32, 16)]
        assert all(w.abs().sum() == 0 for w in ws)
        assert all(w.data_ptr() != o.data_ptr() for w, o in zip(ws, old[layer]))
        assert model.moe_layers[layer].experts.w13 is ws[0]
    assert old[0][0].abs().sum() > 0  # the old tensors are intact while referenced
    assert model.moe_layers[0].logical_to_physical_map is None  # routing state dropped
    with pytest.raises(ValueError, match=r"group: 1 ranks x 6 local slots != num_physical_experts \(12\)"):
        model.set_expert_parallel_group(None)
    model.update_physical_experts_metadata(12, 12, reallocate=False)  # S changes: reallocates anyway
    assert model.expert_weights[0][0].shape[0] == 12
    model.set_expert_parallel_group(None)
    for bad, field in (((12, 5), "num_physical_experts"), ((7, 7), "num_physical_experts"),
                       ((12, 0), "num_local_physical_experts"), ((12.0, 6), "num_physical_experts"),
                       ((12, True), "num_local_physical_experts")):
        with pytest.raises(ValueError, match=field):
            model.update_physical_experts_metadata(*bad)
    model.release_expert_slots()
    assert model.num_local_physical_experts == 0
    assert all(w.shape[0] == 0 for ws in model.expert_weights for w in ws)
    with pytest.raises(RuntimeError):
        model(sample_tokens(args, 4))


# ---- the whole resize on real ranks --------------------------------------------------------

def _skewed_bias(step, L, N):
    rng = np.random.default_rng(step // 3)  # same on every rank
    p = rng.dirichlet(np.full(N, 0.3), size=L)  # [L, N]
    return torch.from_numpy(0.02 * np.log(np.maximum(p, 1e-9))).float()


def _check_slots(args, runtime, device):
    """Every local slot holds bitwise the weights of the expert its placement names."""
    from moe import expert_weights_for

    S = runtime.model.num_local_physical_experts
    p2l = runtime.placement.physical_to_logical  # [L, P]
    assert torch.equal(runtime.physical_to_logical.cpu(), torch.from_numpy(p2l.copy()))
    for layer, weights in enumerate(runtime.model.expert_weights):
        assert [w.shape[0] for w in weights] == [S, S]
        for s in range(S):
            want = expert_weights_for(args, layer, int(p2l[layer, runtime.rank * S + s]), device)
            for w, v in zip(weights, want):
                assert torch.equal(w[s], v), f"layer {layer} slot {s} holds the wrong expert"


def _check_outputs(args, model, reference, rank, device, steps=range(3), runtime=None):
    """Model equals the dense reference on a few skewed batches (collective on the EP group);
    with a runtime, record each step (a rebalance may run)."""
    from moe import sample_tokens

    for step in steps:
        bias = _skewed_bias(step, args.num_layers, args.num_experts).to(device)
        model.set_routing_bias(bias)
        reference.set_routing_bias(bias)
        x = sample_tokens(args, 40, seed=100 * step + rank, device=device)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
        if runtime is not None:
            runtime.step()
            torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
            runtime.expert_load_pass.zero_()


def _round_trip_body(rank, world):
    """world -> world/2 (planned on the recorded window) -> world (planned on a given load)."""
    from moe import DenseMoEModel, MoEModel

    from eplb.runtime.resize import resize_expert_parallel
    from eplb.runtime import EplbRuntime

    device = device_for(rank)
    args = _args()
    switch = PolicySwitch.get("test-resize-switch")  # plans like "default" until armed
    cfg = EplbConfig(num_redundant_experts=4, window_size=3, rebalance_interval=3,
                     policy=switch.name)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, cfg)
    reference = DenseMoEModel(args, device=device)
    _check_outputs(args, model, reference, rank, device, steps=range(5), runtime=runtime)
    assert len(runtime.events) == 1
    ptrs = [w.data_ptr() for ws in model.expert_weights for w in ws]
    everyone, half = list(range(world)), list(range(world // 2))

    res = resize_expert_parallel(model, everyone, half, runtime=runtime, load="window")
    if rank in half:
        rt = res.runtime
        assert res.member and rt.world_size == len(half) and rt.group is res.group
        assert model.num_local_physical_experts == 12 // len(half) and model.num_physical_experts == 12
        assert res.event is not None and res.event.trigger == "resize"
        assert res.placement == rt.placement and rt.placement.num_gpus == len(half)
        assert rt.placement.replica_count().max() > 1  # the window's hot experts got replicas
        assert not set(ptrs) & {w.data_ptr() for ws in model.expert_weights for w in ws}
        _check_slots(args, rt, device)
        _check_outputs(args, model, reference, rank, device, steps=range(10, 17), runtime=rt)
        assert len(rt.events) == 3  # the resize's move plus two interval rebalances
        _check_slots(args, rt, device)
        runtime = rt
    else:
        assert not res.member and res.runtime is None and res.placement is None
        assert model.num_local_physical_experts == 0
        assert all(w.numel() == 0 for ws in model.expert_weights for w in ws)
        with pytest.raises(RuntimeError):
            model(torch.zeros(2, args.hidden_size, device=device))
        runtime = None
    assert res.experts_moved > 0

    # grow back; old members take their runtime's config, the joiners pass it. The load
    # adds up 100 steps: one step is 1% of it, few enough tokens that decode-aware packing
    # spreads the cold experts' weight reads (it changes this plan)
    load = np.random.default_rng(2).lognormal(0, 3, (args.num_layers, args.num_experts)) * 10  # [L, N]
    res = resize_expert_parallel(model, half, everyone, runtime=runtime,
                                 config=None if rank in half else cfg, load=load, load_steps=100)
    rt = res.runtime
    assert res.member and rt.world_size == world and model.num_local_physical_experts == 12 // world
    per_step = load.sum() / args.num_layers / 100  # token-expert choices per step and layer
    want = plan(load, world, 12, 1, 1, cfg.policy, move_tolerance=cfg.move_tolerance,
                read_tokens=cfg.read_tokens, step_choices=per_step, dispatch_tokens=cfg.dispatch_tokens,
                tile_rows=cfg.tile_rows)
    tokens_only = plan(load, world, 12, 1, 1, cfg.policy, move_tolerance=cfg.move_tolerance)
    assert not np.array_equal(want.physical_to_logical, tokens_only.physical_to_logical)
    assert np.array_equal(rt.placement.physical_to_logical, want.physical_to_logical)
    _check_slots(args, rt, device)
    _check_outputs(args, model, reference, rank, device, steps=range(20, 27), runtime=rt)
    _check_slots(args, rt, device)
    assert_same_on_every_rank(rt.physical_to_logical)

    # A rebalance that fails on the grown group makes the runtime renew its plan and
    # transfer groups, collectively over the members only. The members' histories of
    # group creation differ here (ranks outside the shrunk group made fewer groups), so
    # groups the members made alone would get different names and hang; the resize made
    # spare groups on every world rank, and the renewal takes those. The next move then
    # runs on the renewed groups.
    spares = len(rt.groups.spares)
    assert spares > 0
    before = rt.placement
    switch.arm(RuntimeError("planning failed on purpose"))
    with pytest.raises(RebalanceError):
        rt.rebalance()
    switch.disarm()
    assert rt.placement == before and len(rt.groups.spares) == spares - 1
    rolled = np.roll(before.physical_to_logical, 1, axis=1)  # every rank's slots change
    event = rt.apply_placement(before.with_physical_to_logical(rolled, before.policy))
    assert event.experts_moved > 0
    _check_slots(args, rt, device)
    _check_outputs(args, model, reference, rank, device, steps=range(30, 33), runtime=rt)
    assert_same_on_every_rank(rt.physical_to_logical)
    # the second failure takes the last spare; with none left, a third is fatal with a
    # clear reason instead of making members-only groups that could hang
    in_force = rt.placement.physical_to_logical.copy()  # [L, P]
    switch.arm(RuntimeError("planning failed on purpose"))
    with pytest.raises(RebalanceError) as second:
        rt.rebalance()
    assert not isinstance(second.value, EplbFatalError) and len(rt.groups.spares) == spares - 2 == 0
    with pytest.raises(EplbFatalError, match="no spare process groups left"):
        rt.rebalance()
    switch.disarm()
    with pytest.raises(EplbFatalError):
        rt.step()  # the job must stop
    assert np.array_equal(rt.placement.physical_to_logical, in_force)  # nothing moved


def test_shrink_4_to_2_and_grow_back():
    run_distributed(_round_trip_body, 4)


def _idle_ranks_join_body(rank, world):
    """EP group {0, 1} with P = 10, ranks 2 and 3 idle; grow to 4 ranks with P = 12."""
    from moe import DenseMoEModel, MoEModel

    from eplb.runtime.resize import resize_expert_parallel
    from eplb.runtime import EplbRuntime

    device = device_for(rank)
    args = _args(num_redundant_experts=2)  # P = 10
    cfg = EplbConfig(num_redundant_experts=2, window_size=4, rebalance_interval=0)
    g01 = dist.new_group([0, 1])  # every rank calls new_group
    reference = DenseMoEModel(args, device=device)
    if rank < 2:
        model = MoEModel(args, group=g01, device=device)
        runtime = EplbRuntime(model, cfg, group=g01)
        _check_outputs(args, model, reference, rank, device)
    else:
        # a standby copy, on a group of one (None would be the world): its slots are ignored
        alone = dist.new_group([rank], use_local_synchronization=True)
        model = MoEModel(args, group=alone, device=device)
        runtime = None

    # P = 10 does not divide over 3 ranks, P = 6 < N: every rank of the union {0, 1, 2}
    # refuses; rank 3 is not in it and only takes part in making the groups
    for kw, match in (({}, "10 slots do not divide over 3 new ranks; pass num_physical_experts=9 or 12"),
                      (dict(num_physical_experts=6), r"num_physical_experts: 6 < num_logical_experts \(8\)")):
        if rank < 3:
            with pytest.raises(ValueError, match=match):
                resize_expert_parallel(model, [0, 1], [0, 1, 2], runtime=runtime, config=cfg, **kw)
        else:
            res = resize_expert_parallel(model, [0, 1], [0, 1, 2], runtime=runtime, config=cfg, **kw)
            assert not res.member and res.runtime is None

    res = resize_expert_parallel(model, [0, 1], [0, 1, 2, 3], runtime=runtime, config=cfg,
                                 num_physical_experts=12)
    rt = res.runtime
    assert res.member and res.num_physical_experts == 12
    assert (model.num_physical_experts, model.num_local_physical_experts) == (12, 3)
    assert model.num_redundant_experts == 4 and rt.config.num_redundant_experts == 4
    assert rt.placement == Placement.initial(2, 8, 12, 4)  # no load given
    assert res.event is None
    # every expert the joiners got came over the network from rank 0 or 1
    # per layer: rank 0 keeps 0 1 2; rank 1 keeps 5, gets 3 4; ranks 2, 3 get all 3 of theirs
    assert res.experts_moved == 2 * 8 and res.local_copies == 2 * 4
    bytes_per_expert = (2 * 16 * 32 + 32 * 16) * 4  # w13 [2I, H] + w2 [H, I], float32
    assert res.bytes_received == 2 * [0, 2, 3, 3][rank] * bytes_per_expert
    _check_slots(args, rt, device)
    _check_outputs(args, model, reference, rank, device)


def test_idle_ranks_join_and_slots_change():
    run_distributed(_idle_ranks_join_body, 4)


def _one_rank_body(rank, world):
    """World of 3: EP group {0, 1} shrinks to {1} (a one-rank group: no runtime groups on
    any rank, rank 2 outside it all), then grows to {1, 2} (rank 0 outside it all)."""
    from moe import DenseMoEModel, MoEModel

    from eplb.runtime import EplbRuntime
    from eplb.runtime.resize import resize_expert_parallel

    device = device_for(rank)
    args = _args(num_redundant_experts=0)  # P = 8
    cfg = EplbConfig(num_redundant_experts=0, rebalance_interval=0)
    g01 = dist.new_group([0, 1])
    reference = DenseMoEModel(args, device=device)
    # rank 2 stands by with all slots on its own (group=None would mean the default group)
    alone = None if rank < 2 else dist.new_group([rank], use_local_synchronization=True)
    model = MoEModel(args, group=g01 if rank < 2 else alone, device=device)
    runtime = EplbRuntime(model, cfg, group=g01) if rank < 2 else None
    res = resize_expert_parallel(model, [0, 1], [1], runtime=runtime)
    assert res.member == (rank == 1)
    if rank == 1:
        assert res.runtime.world_size == 1 and res.runtime.groups.transfer is None
        _check_slots(args, res.runtime, device)
        _check_outputs(args, model, reference, rank, device)
    res = resize_expert_parallel(model, [1], [1, 2], runtime=res.runtime,
                                 config=cfg if rank == 2 else None)
    assert res.member == (rank > 0)
    if rank > 0:
        assert res.runtime.world_size == 2 and model.num_local_physical_experts == 4
        _check_slots(args, res.runtime, device)
        _check_outputs(args, model, reference, rank, device, runtime=res.runtime)


def test_shrink_to_one_rank_and_grow_with_ranks_outside():
    run_distributed(_one_rank_body, 3)


def _bad_requests_body(rank, world):
    from moe import DenseMoEModel, MoEModel

    from eplb.runtime.resize import resize_expert_parallel
    from eplb.runtime import EplbRuntime

    device = device_for(rank)
    args = _args()
    cfg = EplbConfig(num_redundant_experts=4, rebalance_interval=0)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, cfg)
    everyone = [0, 1, 2, 3]

    # refused on every rank before any group is made
    for kw, match in (
            (dict(new_ranks=[0, 1], num_physical_experts=9),
             "num_physical_experts: 9 slots do not divide over 2 new ranks; try 8 or 10"),
            (dict(new_ranks=[0, 0]), "new_ranks: duplicate ranks"),
            (dict(new_ranks=[0, 7]), r"new_ranks: ranks \[7\] outside \[0, 4\)"),
            (dict(new_ranks=everyone), "nothing to resize"),
            (dict(new_ranks=[0, 1], load="recent"), "load: must be None, 'window'"),
            (dict(new_ranks=[0, 1], load="window", load_steps=10), "load_steps: only with an"),
            (dict(new_ranks=[0, 1], load=np.ones((2, 8)), load_steps=0), "load_steps: must be a number > 0"),
            (dict(new_ranks=[0, 1], num_physical_experts=0), "num_physical_experts: must be an int")):
        with pytest.raises(ValueError, match=match):
            resize_expert_parallel(model, kw.pop("old_ranks", everyone), runtime=runtime, **kw)
    # refused after the agreement round: the bad rank names its problem, the others name it
    with pytest.raises(ValueError, match=("old_ranks: \\[0, 1\\] but rank" if rank < 2
                                          else r"refused by rank\(s\) \[0, 1\]")):
        resize_expert_parallel(model, [0, 1], everyone, runtime=runtime)
    with pytest.raises(ValueError, match=("runtime: rank 2 is in old_ranks" if rank == 2
                                          else r"refused by rank\(s\) \[2\]")):
        resize_expert_parallel(model, everyone, [0, 1], runtime=None if rank == 2 else runtime)
    with pytest.raises(ValueError, match="verify: ranks passed different values"):
        resize_expert_parallel(model, everyone, [0, 1], runtime=runtime, verify=rank != 1)
    odd = EplbConfig(num_redundant_experts=4, rebalance_interval=0, window_size=7 if rank == 1 else 1000)
    with pytest.raises(ValueError, match="config: the ranks of the new group have different"):
        resize_expert_parallel(model, everyone, [0, 1], runtime=runtime, config=odd)
    bad_load = np.ones((3, 8))  # [L+1, N]: planning fails on rank 0 only
    with pytest.raises(ValueError, match=(r"load: shape \[3, 8\] does not fit the model's \[L, N\] = \[2, 8\]"
                                          if rank == 0 else "planning the new placement failed")):
        resize_expert_parallel(model, everyone, [0, 1], runtime=runtime, load=bad_load)
    # nothing moved: the model still serves on 4 ranks, and a valid resize works
    reference = DenseMoEModel(args, device=device)
    _check_slots(args, runtime, device)
    _check_outputs(args, model, reference, rank, device)
    res = resize_expert_parallel(model, everyone, [0, 1], runtime=runtime)
    if rank < 2:
        _check_slots(args, res.runtime, device)
        _check_outputs(args, model, reference, rank, device)

    # one value corrupted on its way into rank 3 (injected through the resize's test seam,
    # after the real copy): the checksums catch it on every rank, naming the layer and slot
    def corrupt(layer, new):
        if rank == 3 and layer == 0:
            new[0][0].view(-1)[0] += 1.0  # layer 0, new slot 0 of rank 3 = slot 9

    with pytest.raises(ResizeVerificationError, match="verification failed on layer 0: new slots "
                                                      r"\[9\]") as e:
        resize_expert_parallel(model, [0, 1], everyone, runtime=res.runtime, config=cfg,
                               transfer_hook=corrupt)
    assert e.value.layer == 0 and e.value.bad_slots == [9]


def test_bad_requests_fail_on_every_rank_without_moving_anything():
    run_distributed(_bad_requests_body, 4)


def test_resize_needs_torch_distributed():
    from moe import MoEModel

    from eplb.runtime.resize import resize_expert_parallel

    with pytest.raises(ValueError, match="not initialized"):
        resize_expert_parallel(MoEModel(_args()), [0], [0, 1])
