"""The reference MoE model: EP model == dense oracle, load counting, routing, protocol."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.placement import Placement
from eplb.protocol import MixtureOfExperts, is_mixture_of_experts, missing_members
from moe import (DenseMoEModel, GroupedExperts, MoEArgs, MoEModel, Router, eplb_state_for,
                 expert_weights_for, hash_replica, map_to_physical, sample_tokens,
                 write_expert_slots)
from moe.dispatch import KNUTH, count_slots

DEVICE = device_for(0)
# fp32 on CPU is bitwise-close; cuBLAS may block rows differently per batch size
TOL = dict(atol=1e-5, rtol=1e-5) if DEVICE.type == "cpu" else dict(atol=1e-4, rtol=1e-4)

TINY = dict(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8, top_k=2)


def tiny(**kw) -> MoEArgs:
    return MoEArgs(**{**TINY, **kw})


def random_bias(args: MoEArgs, seed: int, scale: float = 0.05) -> torch.Tensor:  # [L, N]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(args.num_layers, args.num_experts, generator=g) * scale


def random_placement(L: int, N: int, P: int, num_gpus: int, seed: int) -> Placement:
    """Every expert once (permuted) plus P - N random replicas, shuffled over slots."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(L):
        row = np.concatenate([rng.permutation(N), rng.choice(N, P - N)])
        rng.shuffle(row)
        rows.append(row)
    return Placement(np.stack(rows), N, num_gpus, policy="random")


def logical_from_physical(load: torch.Tensor, p2l: np.ndarray, N: int) -> torch.Tensor:
    """[L, P] physical load -> [L, N] logical load."""
    p2l_t = torch.from_numpy(np.array(p2l)).to(load.device)
    return torch.zeros(load.shape[0], N, dtype=load.dtype, device=load.device).scatter_add_(
        1, p2l_t, load)


# ---- single process: EP model == dense oracle -------------------------------------

VARIANTS = {
    "softmax": dict(),
    "softmax_redundant_shared": dict(num_redundant_experts=3, num_shared_experts=1),
    "sigmoid_nonorm": dict(score_func="sigmoid", norm_topk_prob=False),
    "sigmoid_groups": dict(score_func="sigmoid", num_expert_groups=4, topk_groups=2,
                           num_redundant_experts=2, num_shared_experts=2),
    "softmax_groups_k3": dict(top_k=3, num_expert_groups=2, topk_groups=1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_single_process_matches_dense(variant):
    args = tiny(**VARIANTS[variant])
    model, ref = MoEModel(args, device=DEVICE), DenseMoEModel(args, DEVICE)
    bias = random_bias(args, 1).to(DEVICE)
    model.set_routing_bias(bias)
    ref.set_routing_bias(bias)
    x = sample_tokens(args, 40, seed=3, device=DEVICE)
    torch.testing.assert_close(model(x), ref(x), **TOL)


def test_initial_slots_hold_expert_p_mod_n_bitwise():
    args = tiny(num_redundant_experts=5)
    model = MoEModel(args, device=DEVICE)
    for layer, (w13, w2) in enumerate(model.expert_weights):
        assert w13.shape == (13, 16, 16) and w2.shape == (13, 16, 8)
        for p in range(13):
            e13, e2 = expert_weights_for(args, layer, p % 8, DEVICE)
            assert torch.equal(w13[p], e13) and torch.equal(w2[p], e2)


def test_weights_are_deterministic_and_distinct():
    args = tiny()
    a, b = expert_weights_for(args, 1, 3), expert_weights_for(args, 1, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], expert_weights_for(args, 0, 3)[0])
    assert not torch.equal(a[0], expert_weights_for(args, 1, 4)[0])
    assert not torch.equal(a[0], expert_weights_for(tiny(seed=1), 1, 3)[0])
    assert a[0].shape == (16, 16) and a[1].shape == (16, 8)
    r1, r2 = Router(args, 0), Router(args, 0)
    assert torch.equal(r1.weight, r2.weight)


def test_bf16_cpu_runs_and_tracks_dense():
    args = tiny(dtype="bfloat16", num_redundant_experts=2)
    model, ref = MoEModel(args, device=DEVICE), DenseMoEModel(args, DEVICE)
    x = sample_tokens(args, 24, device=DEVICE)
    y = model(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref(x).float(), atol=5e-2, rtol=5e-2)


# ---- router ------------------------------------------------------------------------

def test_group_limited_topk_stays_in_top_groups():
    args = tiny(num_experts=16, top_k=4, num_expert_groups=4, topk_groups=2)
    router = Router(args, 0)
    x = sample_tokens(args, 64)
    ids, w = router(x)
    groups = ids // 4  # [T, K]
    for row in groups:
        assert len(set(row.tolist())) <= 2
    torch.testing.assert_close(w.sum(-1), torch.ones(64))
    # the kept groups are the ones with the best top-2 sums
    scores = router.scores(x).view(64, 4, 4)
    best = scores.topk(2, -1).values.sum(-1).topk(2, -1).indices.sort(-1).values  # [T, 2]
    for row, kept in zip(groups, best):
        assert set(row.tolist()) <= set(kept.tolist())


def test_plain_topk_when_one_group():
    args = tiny(score_func="sigmoid", norm_topk_prob=False)
    router = Router(args, 0)
    x = sample_tokens(args, 32)
    ids, w = router(x)
    scores = router.scores(x)
    ref = scores.topk(2, -1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(w, ref.values)  # sigmoid scores, not renormalized


def test_selection_bias_changes_choice_not_gate_weight():
    args = tiny(norm_topk_prob=False)
    router = Router(args, 0)
    x = sample_tokens(args, 32)
    router.selection_bias[5] = 10.0  # everyone picks expert 5 ...
    ids, w = router(x)
    assert (ids == 5).any(-1).all()
    scores = router.scores(x)
    pos = (ids == 5).nonzero()
    torch.testing.assert_close(w[pos[:, 0], pos[:, 1]], scores[:, 5])  # ... at its own score


def test_set_routing_bias_writes_every_router_in_place():
    args = tiny()
    model = MoEModel(args)
    buffers = [layer.router.selection_bias for layer in model.moe_layers]
    bias = random_bias(args, 2)
    model.set_routing_bias(bias)
    for i, layer in enumerate(model.moe_layers):
        assert layer.router.selection_bias is buffers[i]
        assert torch.equal(layer.router.selection_bias, bias[i])
    with pytest.raises(ValueError, match="bias"):
        model.set_routing_bias(torch.zeros(3, 8))


# ---- replica choice and load counting ----------------------------------------------

def test_hash_replica_formula_and_range():
    index = torch.tensor([0, 1, 2, 7, 12345, 2**32 - 1, 2**32 + 5, 2**40 + 3])
    count = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    got = hash_replica(index, count).tolist()
    want = [(((i * KNUTH) & 0xFFFFFFFF) * c) >> 32 for i, c in zip(index.tolist(), count.tolist())]
    assert got == want
    big = hash_replica(torch.arange(10_000), torch.full((10_000,), 5))
    assert big.min() == 0 and big.max() == 4
    assert (torch.bincount(big) > 1800).all()  # near-uniform


def test_replicas_share_tokens_for_every_k():
    # expert 0 has slots 0, 8, 9 (3 replicas); everyone routes to expert 0 at k=0 and k=1
    placement = Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 0]]), 8, 1)
    _, l2p, count = eplb_state_for(placement)
    topk = torch.tensor([[0, 3], [3, 0]]).repeat(300, 1)  # [600, 2]
    phys = map_to_physical(topk, l2p[0], count[0])
    assert torch.equal(phys, map_to_physical(topk, l2p[0], count[0]))  # deterministic
    for k in range(2):
        rows = topk[:, k] == 0
        per_slot = torch.bincount(phys[rows, k], minlength=10)[[0, 8, 9]]
        assert (per_slot > 60).all(), per_slot  # 300 choices over 3 replicas, each used
    assert torch.equal(phys[topk == 3], torch.full((600,), 3))


def test_one_tokens_k_choices_are_not_locked_together():
    # experts 0 and 1 have two replicas each: 0 -> slots 0, 4; 1 -> slots 1, 5
    placement = Placement(np.array([[0, 1, 2, 3, 0, 1]]), 4, 1)
    _, l2p, count = eplb_state_for(placement)
    topk = torch.tensor([[0, 1]]).repeat(400, 1)  # every token: expert 0 at k=0, 1 at k=1
    phys = map_to_physical(topk, l2p[0], count[0])
    second_a, second_b = phys[:, 0] == 4, phys[:, 1] == 5  # took the second replica
    for took_second in (second_a, second_b):  # each k spreads over both replicas
        assert 0.35 < took_second.float().mean() < 0.65
    # a token's two choices are not locked to the same replica number (with the index
    # t*K + k consecutive hashes differ by 0.618 of the range: about 24 % agree here)
    assert (second_a == second_b).float().mean() < 0.5


@pytest.mark.parametrize("variant", ["softmax_redundant_shared", "sigmoid_groups"])
def test_load_view_counts_every_choice(variant):
    args = tiny(**VARIANTS[variant])
    model, ref = MoEModel(args, device=DEVICE), DenseMoEModel(args, DEVICE)
    load = model.expert_load_view
    T, K = 50, args.top_k
    x = sample_tokens(args, T, seed=9, device=DEVICE)
    model(x)
    ref(x)
    assert torch.equal(load.sum(1).cpu(), torch.full((2,), T * K))
    placement = Placement.initial(2, args.num_experts, args.num_physical_experts, 1)
    # physical -> logical equals the oracle's direct count
    assert torch.equal(logical_from_physical(load, placement.physical_to_logical, 8),
                       ref.logical_load)
    # per-slot: equals a direct count of the layer-0 choices
    layer0 = model.moe_layers[0]
    ids, _ = layer0.router(model.layers[0].norm(x))
    phys = map_to_physical(ids, layer0.logical_to_physical_map, layer0.logical_replica_count)
    assert torch.equal(load[0], torch.bincount(phys.reshape(-1), minlength=load.shape[1]))
    model(x)  # counts accumulate until the runtime zeroes the view
    assert torch.equal(load.sum(1).cpu(), torch.full((2,), 2 * T * K))
    model.set_record_load(False)
    model(x)
    assert torch.equal(load.sum(1).cpu(), torch.full((2,), 2 * T * K))


# ---- protocol ----------------------------------------------------------------------

def test_protocol_members():
    args = tiny(num_redundant_experts=4, num_shared_experts=1, num_expert_groups=2,
                topk_groups=2)
    model = MoEModel(args)
    assert isinstance(model, MixtureOfExperts) and is_mixture_of_experts(model)
    assert missing_members(model) == []
    assert (model.num_moe_layers, model.num_logical_experts, model.num_routed_experts,
            model.num_physical_experts, model.num_local_physical_experts,
            model.num_redundant_experts, model.num_shared_experts,
            model.num_expert_groups) == (2, 8, 8, 12, 12, 4, 1, 2)
    assert len(list(model.moe_layers)) == 2
    for layer, weights in zip(model.moe_layers, model.expert_weights):
        assert weights[0] is layer.experts.w13 and weights[1] is layer.experts.w2


def test_set_eplb_state_registers_views_and_in_place_updates_apply():
    args = tiny(num_redundant_experts=2)
    model, ref = MoEModel(args), DenseMoEModel(args)
    expert_weights = model.expert_weights
    placement = Placement.initial(2, 8, 10, 1)
    load, l2p, count = eplb_state_for(placement, max_replicas=6)
    model.set_eplb_state(load, l2p, count)
    assert model.expert_weights is expert_weights and len(expert_weights) == 2
    for i, layer in enumerate(model.moe_layers):
        assert layer.expert_load_view.data_ptr() == load[i].data_ptr()
        assert layer.logical_to_physical_map.data_ptr() == l2p[i].data_ptr()
        assert layer.logical_replica_count.data_ptr() == count[i].data_ptr()
    x = sample_tokens(args, 32)
    torch.testing.assert_close(model(x), ref(x), **TOL)

    # what the runtime does: new placement, weights and maps rewritten in place
    new = random_placement(2, 8, 10, 1, seed=4)
    ptrs = [w.data_ptr() for ws in expert_weights for w in ws]
    for i, (w13, w2) in enumerate(expert_weights):
        write_expert_slots(w13, w2, args, i, new.physical_to_logical[i])
    _, new_l2p, new_count = eplb_state_for(new, max_replicas=6)
    l2p.copy_(new_l2p)
    count.copy_(new_count)
    load.zero_()
    ref.reset_load()
    torch.testing.assert_close(model(x), ref(x), **TOL)
    assert ptrs == [w.data_ptr() for ws in expert_weights for w in ws]
    assert torch.equal(logical_from_physical(load, new.physical_to_logical, 8), ref.logical_load)


def test_set_eplb_state_rejects_bad_tensors():
    model = MoEModel(tiny(num_redundant_experts=2))
    load, l2p, count = eplb_state_for(Placement.initial(2, 8, 10, 1))
    with pytest.raises(ValueError, match="expert_load_view"):
        model.set_eplb_state(load[:, :8], l2p, count)
    with pytest.raises(ValueError, match="num_moe_layers"):
        model.set_eplb_state(load[:1], l2p[:1], count[:1])
    with pytest.raises(ValueError, match="logical_replica_count"):
        model.set_eplb_state(load, l2p, count.float())


def test_update_physical_experts_metadata():
    args = tiny(num_redundant_experts=2)
    model = MoEModel(args)
    x = sample_tokens(args, 8)
    model.update_physical_experts_metadata(10, 10)  # unchanged: still runs
    model(x)
    with pytest.raises(ValueError, match="num_local_physical_experts"):  # re-allocation: test_resize.py
        model.update_physical_experts_metadata(20, 0)
    # P grows (as if a second rank joined with 10 more slots): counts update, the old
    # maps are dropped until the runtime registers [L, 20] tensors and an EP group
    model.update_physical_experts_metadata(20, 10)
    assert (model.num_physical_experts, model.num_redundant_experts) == (20, 12)
    with pytest.raises(RuntimeError, match="set_eplb_state"):
        model(x)


# ---- args ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw, ranks, field", [
    (dict(num_redundant_experts=1), 2, "num_redundant_experts"),
    (dict(top_k=9), 1, "top_k"),
    (dict(num_expert_groups=3), 1, "num_expert_groups"),
    (dict(num_expert_groups=2, topk_groups=3), 1, "topk_groups"),
    (dict(num_expert_groups=4, topk_groups=1, top_k=3), 1, "topk_groups"),
    (dict(score_func="relu"), 1, "score_func"),
    (dict(hidden_size=0), 1, "hidden_size"),
    (dict(num_shared_experts=-1), 1, "num_shared_experts"),
    (dict(), 0, "num_ranks"),
])
def test_args_validation_names_the_field(kw, ranks, field):
    with pytest.raises(ValueError, match=field):
        tiny(**kw).validate(ranks)


def test_args_dtype_names_and_sizes():
    args = tiny(dtype="bfloat16", num_redundant_experts=4)
    assert args.dtype is torch.bfloat16
    assert args.num_physical_experts == 12 and args.num_local_physical_experts(4) == 3
    with pytest.raises(ValueError, match="dtype"):
        tiny(dtype="int8")
    with pytest.raises(ValueError, match="num_redundant_experts=2"):  # suggests a fix
        tiny(num_redundant_experts=1).validate(2)
    assert tiny(num_redundant_experts=2).validate(2) is not None


# ---- grouped GEMM fast path (CUDA only) ------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_path_matches_loop():
    experts = GroupedExperts(4, 64, 32, torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(4, 64, 64, generator=g) * 0.125)
        experts.w2.copy_(torch.randn(4, 64, 32, generator=g) * 0.18)
    counts_host = [5, 0, 17, 10]
    counts = torch.tensor(counts_host, device="cuda")
    x = torch.randn(32, 64, generator=g).to("cuda", torch.bfloat16)
    assert experts.grouped_mm_applies(x)
    loop = experts.forward_loop(x, counts_host)
    fast = experts(x, counts)
    assert experts.use_grouped_mm, "torch._grouped_mm refused the inputs and fell back"
    torch.testing.assert_close(fast.float(), loop.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_cuda_model_uses_grouped_mm_and_tracks_dense():
    args = MoEArgs(hidden_size=64, intermediate_size=32, num_layers=2, num_experts=8, top_k=2,
                   num_redundant_experts=2, dtype=torch.bfloat16)
    model, ref = MoEModel(args, device="cuda"), DenseMoEModel(args, "cuda")
    x = sample_tokens(args, 64, device="cuda")
    y = model(x)
    assert all(layer.experts.use_grouped_mm for layer in model.moe_layers)
    assert torch.equal(model.expert_load_view.sum(1).cpu(), torch.full((2,), 128))
    torch.testing.assert_close(y.float(), ref(x).float(), atol=6e-2, rtol=6e-2)


# ---- multi-process: EP over real ranks == dense oracle -------------------------------

EP_ARGS = dict(TINY, num_redundant_experts=4, num_shared_experts=1)


def _ep_worker(rank: int, world: int, args_kw: dict, seed: int) -> None:
    device = device_for(rank)
    tol = dict(atol=1e-5, rtol=1e-5) if device.type == "cpu" else dict(atol=1e-4, rtol=1e-4)
    args = MoEArgs(**args_kw)
    L, N, P, K = args.num_layers, args.num_experts, args.num_physical_experts, args.top_k
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    S = model.num_local_physical_experts
    assert S * world == P and model.ep_rank == rank
    ref = DenseMoEModel(args, device)
    bias = random_bias(args, seed).to(device)
    model.set_routing_bias(bias)
    ref.set_routing_bias(bias)
    token_counts = [20 + 7 * r for r in range(world)]  # a different batch size per rank
    T = token_counts[rank]

    # the initial placement (slot p holds p % N) first, then two random ones written in
    # place into the same weight tensors and map tensors, as the runtime would
    load, l2p, count = eplb_state_for(Placement.initial(L, N, P, world), device, max_replicas=P)
    model.set_eplb_state(load, l2p, count)
    placements = [Placement.initial(L, N, P, world)]
    placements += [random_placement(L, N, P, world, seed + i) for i in (1, 2)]
    for step, placement in enumerate(placements):
        assert step == 0 or not np.array_equal(placement.physical_to_logical,
                                               placements[0].physical_to_logical)
        local = placement.physical_to_logical[:, rank * S:(rank + 1) * S]  # [L, S]
        for i, (w13, w2) in enumerate(model.expert_weights):
            write_expert_slots(w13, w2, args, i, local[i])
            for s in range(S):
                e13, e2 = expert_weights_for(args, i, int(local[i, s]), device)
                assert torch.equal(w13[s], e13) and torch.equal(w2[s], e2)
        _, new_l2p, new_count = eplb_state_for(placement, device, max_replicas=P)
        l2p.copy_(new_l2p)
        count.copy_(new_count)
        load.zero_()
        ref.reset_load()

        x = sample_tokens(args, T, seed=100 * step + rank, device=device)
        torch.testing.assert_close(model(x), ref(x), **tol)

        # local counts: every (token, k) of this rank's batch once per layer
        assert torch.equal(load.sum(1).cpu(), torch.full((L,), T * K))
        assert torch.equal(logical_from_physical(load, placement.physical_to_logical, N),
                           ref.logical_load)
        # global counts: the all-reduced view sums to all ranks' tokens x K
        total = load.clone()
        dist.all_reduce(total)
        assert torch.equal(total.sum(1).cpu(), torch.full((L,), sum(token_counts) * K))
        ref_total = ref.logical_load.clone()
        dist.all_reduce(ref_total)
        assert torch.equal(logical_from_physical(total, placement.physical_to_logical, N),
                           ref_total)
        # a replicated expert's tokens reach more than one of its slots
        if step:
            repl = np.flatnonzero(placement.replica_count()[0] > 1)
            slots = l2p[0, repl].flatten()
            used = (total[0, slots[slots >= 0]] > 0).sum().item()
            assert used > len(repl), (used, repl)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ep_matches_dense_across_ranks(world):
    run_distributed(_ep_worker, world, EP_ARGS, 11)


def test_ep_group_limited_sigmoid_two_ranks():
    kw = dict(TINY, num_redundant_experts=2, score_func="sigmoid", num_expert_groups=4,
              topk_groups=2, norm_topk_prob=True)
    run_distributed(_ep_worker, 2, kw, 23)


# ---- load counting fused into dispatch; "fixed" dispatch ------------------------------

def test_count_slots_is_the_histogram_of_slot_ids():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 13, (50, 3), generator=g)
    assert torch.equal(count_slots(ids, 16), torch.bincount(ids.reshape(-1), minlength=16))


def test_load_view_of_any_integer_dtype_counts_every_choice():
    """The layer adds dispatch's int64 slot histogram into the registered view, whatever
    integer dtype the runtime gave it."""
    args = tiny(num_redundant_experts=2)
    model = MoEModel(args)
    load, l2p, count = eplb_state_for(Placement.initial(2, 8, 10, 1))
    load = load.to(torch.int32)
    model.set_eplb_state(load, l2p, count)
    model(sample_tokens(args, 30))
    assert load.dtype == torch.int32
    assert torch.equal(load.sum(1), torch.full((2,), 30 * args.top_k, dtype=torch.int32))


def test_dispatch_mode_is_validated():
    with pytest.raises(ValueError, match="dispatch_mode"):
        tiny(dispatch_mode="padded").validate(1)
    assert tiny(dispatch_mode="fixed").validate(1).dispatch_mode == "fixed"


def _fixed_dispatch_worker(rank: int, world: int, seed: int) -> None:
    """The same model and batch through "exact" and "fixed" dispatch: identical outputs
    (the experts see the same rows in the same order) and identical load, both equal to
    the dense oracle, under the initial and a random placement with replicas."""
    device = device_for(rank)
    tol = dict(atol=1e-5, rtol=1e-5) if device.type == "cpu" else dict(atol=1e-4, rtol=1e-4)
    args = MoEArgs(**EP_ARGS, dispatch_mode="fixed")
    L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    assert all(layer.dispatch_mode == "fixed" for layer in model.moe_layers)
    S = model.num_local_physical_experts
    ref = DenseMoEModel(args, device)
    bias = random_bias(args, seed).to(device)
    model.set_routing_bias(bias)
    ref.set_routing_bias(bias)
    load, l2p, count = eplb_state_for(Placement.initial(L, N, P, world), device, max_replicas=P)
    model.set_eplb_state(load, l2p, count)
    for step, placement in enumerate([Placement.initial(L, N, P, world),
                                      random_placement(L, N, P, world, seed)]):
        local = placement.physical_to_logical[:, rank * S:(rank + 1) * S]  # [L, S]
        for i, (w13, w2) in enumerate(model.expert_weights):
            write_expert_slots(w13, w2, args, i, local[i])
        _, new_l2p, new_count = eplb_state_for(placement, device, max_replicas=P)
        l2p.copy_(new_l2p)
        count.copy_(new_count)
        x = sample_tokens(args, 24, seed=10 * step + rank, device=device)  # same T on every rank
        out = {}
        for mode in ("exact", "fixed"):
            for layer in model.moe_layers:
                layer.dispatch_mode = mode
            load.zero_()
            out[mode] = (model(x), load.clone())
        assert torch.equal(out["fixed"][0], out["exact"][0])
        assert torch.equal(out["fixed"][1], out["exact"][1])
        ref.reset_load()
        torch.testing.assert_close(out["fixed"][0], ref(x), **tol)
        assert torch.equal(logical_from_physical(out["fixed"][1], placement.physical_to_logical, N),
                           ref.logical_load)


def _fixed_dispatch_unequal_batches_worker(rank: int, world: int) -> None:
    args = MoEArgs(**EP_ARGS, dispatch_mode="fixed")
    model = MoEModel(args, group=dist.group.WORLD, device=device_for(rank))
    with pytest.raises(ValueError, match="same number of tokens"):
        model(sample_tokens(args, 10 + rank, device=device_for(rank)))


def test_fixed_dispatch_rejects_unequal_batches_on_every_rank():
    run_distributed(_fixed_dispatch_unequal_batches_worker, 2)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fixed_dispatch_matches_exact_and_dense(world):
    run_distributed(_fixed_dispatch_worker, world, 10 + world)
