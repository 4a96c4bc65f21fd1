"""Weighted replicas: the runtime's `logical_replica_cdf` and the reference model's
weighted replica choice. Uneven shares move tokens between an expert's replicas (the
recorded per-slot load follows them), never change the function (outputs equal the
dense oracle), never reallocate a map, and even shares route bitwise as before."""
import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import assert_same_on_every_rank, device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.protocol import (MixtureOfExperts, SupportsReplicaWeights, replica_cdf,
                           supports_replica_weights)
from eplb.runtime import EplbRuntime

TOL = dict(rtol=1e-5, atol=1e-5)
SHARE_TOL = 0.03  # realised fraction vs planned share (thousands of choices per expert)
KNUTH_INV = pow(2654435769, -1, 2 ** 32)  # index -> h is a bijection of 32-bit ints


def _args(**kw):
    from moe import MoEArgs

    base = dict(hidden_size=32, intermediate_size=16, num_layers=2, num_experts=8, top_k=2,
                num_redundant_experts=4, seed=5)
    base.update(kw)
    return MoEArgs(**base)


def _uneven(p2l: np.ndarray, num_experts: int) -> Placement:
    """Shares proportional to 4^-r over an expert's replicas in slot order (reversed for
    odd experts): 0.8/0.2, 0.2/0.8, 0.76/0.19/0.05, ..."""
    p2l = np.asarray(p2l)
    shares = np.zeros(p2l.shape)
    for layer in range(p2l.shape[0]):
        for e in range(num_experts):
            slots = np.flatnonzero(p2l[layer] == e)
            w = 4.0 ** -np.arange(len(slots))
            shares[layer, slots] = (w if e % 2 == 0 else w[::-1]) / w.sum()
    return Placement(p2l, num_experts, 1, shares=shares)


def _hot_p2l(L: int, N: int, P: int, seed: int) -> np.ndarray:
    """Experts 0, 1, 2, 2, ... take the redundant slots, slots shuffled per layer."""
    rng = np.random.default_rng(seed)  # same on every rank
    extra = np.array([0, 1, 2, 2, 3, 3, 3][:P - N])
    return np.stack([rng.permutation(np.concatenate([np.arange(N), extra])) for _ in range(L)])


def _on(placement: Placement, num_gpus: int) -> Placement:
    return Placement(placement.physical_to_logical, placement.num_logical_experts, num_gpus,
                     shares=placement.shares)


def _realised_fractions(load: np.ndarray, p2l: np.ndarray, num_experts: int) -> np.ndarray:
    """Per-slot load [L, P] -> each slot's fraction of its expert's load [L, P]."""
    totals = np.zeros((load.shape[0], num_experts))
    np.add.at(totals, (np.repeat(np.arange(load.shape[0]), load.shape[1]), p2l.ravel()),
              load.ravel())
    return load / np.take_along_axis(totals, p2l, 1)


def _map_ptrs(runtime):
    return [t.data_ptr() for t in (runtime.expert_load_pass, runtime.physical_to_logical,
                                   runtime.logical_to_physical_map, runtime.logical_replica_count,
                                   runtime.logical_replica_cdf)]


# ---- the tensor's content ------------------------------------------------------------

def test_replica_cdf_content():
    p2l = np.array([[0, 1, 2, 3, 0, 2, 2, 0]])  # counts 3, 1, 3, 1; R = 8 - 4 + 1 = 5
    shares = np.array([[0.5, 1, 0.2, 1, 0.3, 0.0, 0.8, 0.2]])
    placement = Placement(p2l, 4, 2, shares=shares)
    cdf = replica_cdf(placement.replica_shares(5), placement.replica_count())  # [1, 4, 5]
    assert cdf.dtype == np.float32 and cdf.shape == (1, 4, 5)
    np.testing.assert_allclose(cdf[0], [[0.5, 0.8, 1, 1, 1],  # slots 0, 4, 7
                                        [1, 1, 1, 1, 1],
                                        [0.2, 0.2, 1, 1, 1],  # slots 2, 5, 6: a zero share
                                        [1, 1, 1, 1, 1]], rtol=0, atol=1e-7)
    # the last valid entry and the padding are exactly 1.0
    count = placement.replica_count()[0]
    for e in range(4):
        assert (cdf[0, e, count[e] - 1:] == 1.0).all()
    # no shares: the even split (r + 1) / count
    even = Placement(p2l, 4, 2)
    cdf = replica_cdf(even.replica_shares(5), even.replica_count())
    np.testing.assert_allclose(cdf[0, 0], [1 / 3, 2 / 3, 1, 1, 1], rtol=0, atol=1e-7)


def test_protocol_extension_is_optional():
    from moe import MoEModel

    model = MoEModel(_args())
    assert isinstance(model, SupportsReplicaWeights) and supports_replica_weights(model)
    assert isinstance(_EvenSplitModel(MoEModel(_args())), MixtureOfExperts)
    assert not supports_replica_weights(_EvenSplitModel(MoEModel(_args())))
    assert "set_eplb_replica_weights" not in MixtureOfExperts.__dict__


# ---- (d) even shares: bitwise the old replica choice ---------------------------------

def test_even_cdf_picks_bitwise_the_hash_replica():
    from moe import eplb_state_for, map_to_physical, replica_cdf_for, weighted_replica

    device = device_for(0)
    N, P = 8, 20
    rng = np.random.default_rng(0)
    placements = [Placement(np.concatenate([np.arange(N), rng.integers(0, N, P - N)])[None], N, 1)
                  for _ in range(4)]
    placements.append(Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7] + [0] * 12]), N, 1))  # 13 replicas
    # explicit even shares (as a weighted planner may return): the same as none
    p2l = placements[0].physical_to_logical
    placements.append(Placement(p2l, N, 1, shares=placements[0].slot_shares()))
    topk = torch.from_numpy(rng.integers(0, N, (1 << 16, 8))).to(device)  # 2^19 choices
    for placement in placements:
        _, l2p, count = eplb_state_for(placement, device)
        cdf = replica_cdf_for(placement, device)
        assert torch.equal(map_to_physical(topk, l2p[0], count[0], cdf[0]),
                           map_to_physical(topk, l2p[0], count[0]))
        # hashes right at, just below and just above every replica boundary j * 2^32 / c
        for e in range(N):
            c = int(count[0, e])
            h = [max(0, min(2 ** 32 - 1, (j << 32) // c + d))
                 for j in range(c + 1) for d in (-2, -1, 0, 1, 2)]
            index = torch.tensor([(x * KNUTH_INV) % 2 ** 32 for x in h], device=device)[:, None]
            ids = torch.full_like(index, e)
            want = torch.tensor([(x * c) >> 32 for x in h], device=device)[:, None]
            assert torch.equal(weighted_replica(index, ids, count[0], cdf[0]), want)


def test_even_runtime_routes_like_the_model_alone():
    """An even placement through the runtime (cdf registered) records bitwise the same
    per-slot load and gives bitwise the same output as the model on its own maps."""
    from moe import MoEModel, sample_tokens

    device = device_for(0)
    args = _args()
    alone, managed = MoEModel(args, device=device), MoEModel(args, device=device)
    runtime = EplbRuntime(managed, EplbConfig(num_redundant_experts=4, rebalance_interval=0))
    # an even placement is routed without the cdf (ShareRouting.update); register it anyway:
    # the cdf path must pick bitwise the even path's replicas
    managed.set_eplb_replica_weights(runtime.logical_replica_cdf)
    assert managed.moe_layers[0].logical_replica_cdf is not None
    x = sample_tokens(args, 2048, seed=1, device=device)
    assert torch.equal(managed(x), alone(x))
    assert torch.equal(runtime.expert_load_pass, alone.expert_load_view)


def test_cdf_is_registered_only_while_shares_may_be_uneven():
    """The runtime routes through the cdf (about 20 kernels per layer) only when a
    placement with uneven shares is in force or coming, or weighted planning is on;
    an even placement goes through the few-kernel even split."""
    from moe import MoEModel, sample_tokens

    device = device_for(0)
    args = _args()
    model = MoEModel(args, device=device)
    registered = lambda: model.moe_layers[0].logical_replica_cdf is not None  # noqa: E731
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0))
    assert not registered()
    p2l = runtime.placement.physical_to_logical.copy()  # [L, P] start-up: p holds p mod N
    N = runtime.placement.num_logical_experts
    shares = np.ones(p2l.shape)  # experts 0..3 have two replicas: split them 3:1
    for e in range(4):
        shares[:, [e, N + e]] = [0.75, 0.25]
    uneven = Placement(p2l, N, runtime.placement.num_gpus, shares=shares)
    seen = []
    original = model.set_eplb_replica_weights
    model.set_eplb_replica_weights = lambda cdf: (seen.append(
        (cdf is not None, float(runtime.logical_replica_cdf[0, 0, 0]))), original(cdf))[1]
    runtime.apply_placement(uneven)
    # registered before the maps switched: expert 0's cdf still the even 0.5, not 0.75
    assert seen == [(True, 0.5)] and registered()
    assert float(runtime.logical_replica_cdf[0, 0, 0]) == 0.75
    model(sample_tokens(args, 64, seed=2, device=device))
    runtime.apply_placement(Placement(p2l, N, runtime.placement.num_gpus))  # even again
    assert seen[-1][0] is False and not registered()
    runtime.close()
    weighted = EplbRuntime(MoEModel(args, device=device), EplbConfig(
        num_redundant_experts=4, rebalance_interval=0, weighted_replicas=True))
    assert weighted.model.moe_layers[0].logical_replica_cdf is not None
    weighted.close()


# ---- (a) one process: uneven shares ---------------------------------------------------

def test_uneven_shares_single_process():
    from moe import (DenseMoEModel, MoEModel, eplb_state_for, map_to_physical, sample_tokens,
                     write_expert_slots)

    device = device_for(0)
    args = _args(num_layers=3, num_redundant_experts=5)  # P = 13, R = 6
    L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
    model, reference = MoEModel(args, device=device), DenseMoEModel(args, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=5, rebalance_interval=0))
    ptrs = _map_ptrs(runtime)
    weight_ptrs = [w.data_ptr() for ws in runtime.expert_weights for w in ws]
    placement = _uneven(_hot_p2l(L, N, P, seed=1), N)
    event = runtime.apply_placement(placement, trigger="test")
    np.testing.assert_allclose(runtime.logical_replica_cdf.cpu().numpy(),
                               replica_cdf(placement.replica_shares(6), placement.replica_count()))
    np.testing.assert_allclose(event.balancedness_after, placement.balancedness(np.ones((L, N))))

    x = sample_tokens(args, 8192, seed=2, device=device)
    torch.testing.assert_close(model(x), reference(x), **TOL)  # shares change the replica, not the math
    load = runtime.expert_load_pass.cpu().numpy()  # [L, P]
    p2l = placement.physical_to_logical
    assert (load.sum(1) == 8192 * args.top_k).all()
    # the recorded per-slot load follows the shares
    replicated = np.take_along_axis(placement.replica_count(), p2l, 1) > 1  # [L, P]
    got = _realised_fractions(load, p2l, N)
    assert np.abs(got - placement.shares)[replicated].max() < SHARE_TOL, (got, placement.shares)
    # ... and is truthful: layer 0's choices counted directly land on the same slots
    layer0 = model.moe_layers[0]
    ids, _ = layer0.router(model.layers[0].norm(x))
    phys = map_to_physical(ids, layer0.logical_to_physical_map, layer0.logical_replica_count,
                           layer0.logical_replica_cdf)
    assert torch.equal(runtime.expert_load_pass[0], torch.bincount(phys.reshape(-1), minlength=P))
    # logical load (what the planner sees) is unchanged by the shares
    logical = np.zeros((L, N))
    np.add.at(logical, (np.repeat(np.arange(L), P), p2l.ravel()), load.ravel())
    np.testing.assert_array_equal(logical, reference.logical_load.cpu().numpy())

    # a replica with share 0 gets nothing; back to an even placement: the old routing
    shares = placement.shares.copy()
    e0 = np.flatnonzero(p2l[0] == 0)
    shares[0, e0] = [1.0, 0.0]
    runtime.apply_placement(placement.with_physical_to_logical(p2l, "test", shares))
    runtime.expert_load_pass.zero_()
    model(x)
    assert runtime.expert_load_pass[0, e0[1]] == 0 and runtime.expert_load_pass[0, e0[0]] > 0
    for i, layer in enumerate(model.moe_layers):  # uneven shares: views of the runtime's cdf
        assert layer.logical_replica_cdf.data_ptr() == runtime.logical_replica_cdf[i].data_ptr()
    runtime.apply_placement(placement.with_physical_to_logical(p2l, "test"))
    runtime.expert_load_pass.zero_()
    torch.testing.assert_close(model(x), reference(x), **TOL)
    alone = MoEModel(args, device=device)
    alone.set_eplb_state(*eplb_state_for(placement, device))
    for i, (w13, w2) in enumerate(alone.expert_weights):
        write_expert_slots(w13, w2, args, i, p2l[i])
    alone(x)
    assert torch.equal(runtime.expert_load_pass, alone.expert_load_view)

    # nothing was reallocated; an even placement again routes without the cdf
    assert _map_ptrs(runtime) == ptrs
    assert [w.data_ptr() for ws in runtime.expert_weights for w in ws] == weight_ptrs
    assert all(layer.logical_replica_cdf is None for layer in model.moe_layers)


def test_layer_replica_weights_checks_and_reset():
    from moe import MoEModel, eplb_state_for, replica_cdf_for, sample_tokens

    args = _args()
    model = MoEModel(args)
    placement = Placement.initial(2, 8, 12, 1)
    load, l2p, count = eplb_state_for(placement)
    cdf = replica_cdf_for(placement)
    with pytest.raises(ValueError, match="num_moe_layers"):
        model.set_eplb_replica_weights(cdf[:1])
    with pytest.raises(ValueError, match="R=5"):
        model.set_eplb_replica_weights(replica_cdf_for(placement, max_replicas=6))
    with pytest.raises(ValueError, match="floating"):
        model.set_eplb_replica_weights(l2p)
    model.set_eplb_replica_weights(cdf)
    assert all(layer.logical_replica_cdf is not None for layer in model.moe_layers)
    model.set_eplb_state(load, l2p, count)  # new maps drop the weights of the old ones
    assert all(layer.logical_replica_cdf is None for layer in model.moe_layers)
    model.set_eplb_replica_weights(cdf)
    model.set_eplb_replica_weights(None)  # back to the even split
    assert model.logical_replica_cdf is None
    model(sample_tokens(args, 4))


# ---- (c) a model without the extension ------------------------------------------------

class _EvenSplitModel:
    """A vLLM-style model: the MixtureOfExperts members only, no set_eplb_replica_weights."""

    def __init__(self, inner):
        self.inner = inner
        for name in ("expert_weights", "num_moe_layers", "num_expert_groups",
                     "num_logical_experts", "num_physical_experts", "num_local_physical_experts",
                     "num_routed_experts", "num_shared_experts", "num_redundant_experts",
                     "moe_layers"):
            setattr(self, name, getattr(inner, name))

    def set_eplb_state(self, expert_load_view, logical_to_physical_map, logical_replica_count):
        self.inner.set_eplb_state(expert_load_view, logical_to_physical_map, logical_replica_count)

    def update_physical_experts_metadata(self, num_physical_experts, num_local_physical_experts):
        self.inner.update_physical_experts_metadata(num_physical_experts, num_local_physical_experts)

    def __call__(self, x):
        return self.inner(x)


def test_model_without_extension_warns_once_and_splits_evenly(caplog):
    from moe import DenseMoEModel, MoEModel, sample_tokens

    device = device_for(0)
    args = _args()
    L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
    model = _EvenSplitModel(MoEModel(args, device=device))
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0))
    assert not runtime.routing.supported
    assert model.moe_layers[0].logical_replica_cdf is None
    placement = _uneven(_hot_p2l(L, N, P, seed=3), N)
    even = placement.with_physical_to_logical(placement.physical_to_logical, "test")
    with caplog.at_level(logging.WARNING, logger="eplb.runtime"):
        runtime.apply_placement(even)  # even shares: nothing to warn about
        assert caplog.records == []
        event = runtime.apply_placement(placement)
        runtime.apply_placement(placement)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "evenly" in warnings[0].getMessage()
    assert "realised balance is the even-split one" in warnings[0].getMessage()
    # the event predicts what the model really does: the even split
    ones = np.ones((L, N))
    np.testing.assert_allclose(event.balancedness_after, even.balancedness(ones))
    x = sample_tokens(args, 2048, seed=4, device=device)
    torch.testing.assert_close(model(x), DenseMoEModel(args, device=device)(x), **TOL)
    # the runtime still keeps the cdf current (a model may register it later)
    np.testing.assert_allclose(runtime.logical_replica_cdf.cpu().numpy(),
                               replica_cdf(placement.replica_shares(5), placement.replica_count()))
    # routed exactly as the even placement through a model with the extension
    twin = MoEModel(args, device=device)
    twin_runtime = EplbRuntime(twin, EplbConfig(num_redundant_experts=4, rebalance_interval=0))
    twin_runtime.apply_placement(even)
    twin(x)
    assert torch.equal(runtime.expert_load_pass, twin_runtime.expert_load_pass)


# ---- (b) 2 and 4 ranks ----------------------------------------------------------------

def _distributed_body(rank, world):
    from moe import DenseMoEModel, MoEModel, sample_tokens

    device = device_for(rank)
    args = _args(num_redundant_experts=world)  # P = 8 + W
    L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, rebalance_interval=0))
    reference = DenseMoEModel(args, device=device)
    ptrs = _map_ptrs(runtime)
    placement = _on(_uneven(_hot_p2l(L, N, P, seed=11), N), world)
    runtime.apply_placement(placement, trigger="test")
    # replicas of one expert sit on different ranks, so shares move tokens between ranks
    S = P // world
    for layer in range(L):
        ranks = [set(np.flatnonzero(placement.physical_to_logical[layer] == e) // S) for e in range(3)]
        assert any(len(r) > 1 for r in ranks)
    for batch in range(2):
        x = sample_tokens(args, 2048, seed=100 * batch + rank, device=device)
        torch.testing.assert_close(model(x), reference(x), **TOL)
    load = runtime.expert_load_pass.clone()
    dist.all_reduce(load)
    load = load.cpu().numpy()
    assert (load.sum(1) == world * 2 * 2048 * args.top_k).all()
    p2l = placement.physical_to_logical
    replicated = np.take_along_axis(placement.replica_count(), p2l, 1) > 1
    got = _realised_fractions(load, p2l, N)
    assert np.abs(got - placement.shares)[replicated].max() < SHARE_TOL, (got, placement.shares)
    # all ranks together routed what the oracle saw, logically
    logical = torch.zeros(L, N, dtype=torch.int64, device=device)
    logical.scatter_add_(1, torch.from_numpy(p2l.copy()).to(device), runtime.expert_load_pass)
    ref_load = reference.logical_load.clone()
    dist.all_reduce(logical)
    dist.all_reduce(ref_load)
    assert torch.equal(logical, ref_load)
    assert _map_ptrs(runtime) == ptrs
    assert_same_on_every_rank(runtime.logical_replica_cdf)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_uneven_shares_distributed(world):
    run_distributed(_distributed_body, world)


# ---- shares planned by a policy travel through rebalance() to every rank ---------------
def _fixed_weighted_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options):
    """A policy returning a fixed uneven placement (with shares only when asked)."""
    placement = _uneven(_hot_p2l(load.shape[0], load.shape[1], num_slots, seed=3), load.shape[1])
    if options.weighted:
        return placement.physical_to_logical, placement.shares
    return placement.physical_to_logical


def _rebalance_shares_body(rank, world):
    import eplb.core.policy.registry
    from moe import DenseMoEModel, MoEModel, sample_tokens

    eplb.core.policy.registry.register_policy("_test_weighted")(_fixed_weighted_policy)
    device = device_for(rank)
    args = _args()
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0,
                                            policy="_test_weighted", weighted_replicas=True,
                                            min_gain=0.0))
    reference = DenseMoEModel(args, device=device)
    x = sample_tokens(args, 16, seed=rank, device=device)
    model(x)
    runtime.step()
    event = runtime.rebalance()
    want = _uneven(_hot_p2l(2, 8, 12, seed=3), 8)
    assert np.array_equal(runtime.placement.physical_to_logical, want.physical_to_logical)
    np.testing.assert_allclose(runtime.placement.shares, want.shares)
    cdf = replica_cdf(want.replica_shares(runtime.max_replicas), want.replica_count())
    np.testing.assert_allclose(runtime.logical_replica_cdf.cpu().numpy(), cdf, atol=1e-7)
    assert event.placement.shares is not None
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_rebalance_broadcasts_planned_shares(world):
    if world == 1:
        import eplb.core.policy.registry

        eplb.core.policy.registry.register_policy("_test_weighted")(_fixed_weighted_policy)
        try:
            from moe import MoEModel, sample_tokens

            args = _args()
            model = MoEModel(args)
            runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0,
                                                    policy="_test_weighted", weighted_replicas=True,
                                                    min_gain=0.0))
            model(sample_tokens(args, 16))
            runtime.step()
            runtime.rebalance()
            assert runtime.placement.shares is not None
        finally:
            eplb.core.policy.registry._REGISTRY.pop("_test_weighted", None)
    else:
        run_distributed(_rebalance_shares_body, world)


def test_weighted_plan_with_one_expert_hotter_than_three_gpus_keeps_every_expert():
    """Found by the cost replay (tests/test_scale.py): one expert with 80% of a layer's load
    on 4 GPUs x 6 slots made the wrap-around chain leave 4 experts without a slot, and
    `plan` raised 'expert 2 has no replica'."""
    from eplb.core.planning import plan
    load = np.array([  # two steps of tests/test_scale.py's skewed_trace, summed
        [106.3653499239603, 8067.422671580791, 313.9889481599838, 234.49113312232146,
         37.46674842998636, 49.93244744242675, 139.2238881863452, 113.62862125208166,
         58.88902820889965, 197.5750859086701, 13.20067238163645, 64.03020937319012,
         85.27479150283298, 105.12975147012669, 135.23022700832436, 50.238031877095175],
        [12.496283926732055, 8180.243583117912, 204.8471145672049, 68.14772880893305,
         28.547638384894405, 77.49802613210366, 33.90223267052844, 90.8222974328995,
         201.05076551606464, 56.52054981341877, 23.56159022695989, 512.8529260046507,
         138.53166121697876, 194.5587379825181, 50.26113224306347, 340.8783258204132]])
    for nodes in (1, 2):
        p = plan(load, 4, 24, num_nodes=nodes, weighted=True)
        for layer in range(2):
            assert set(p.physical_to_logical[layer].tolist()) == set(range(16))
            per_expert = np.zeros(16)
            np.add.at(per_expert, p.physical_to_logical[layer], p.slot_shares()[layer])
            assert np.allclose(per_expert, 1.0)


# ---- property: weighted plans of random Zipf loads ---------------------------------------

def _zipf_case(case: int) -> tuple[np.ndarray, int, int, int]:
    """(load [5, N], GPUs M, slots P, nodes): 5 layers of token counts drawn from Zipf
    popularity with a random exponent in [0, 3) and a random token count (0 to 1e5, so
    some experts get no tokens), over random N, M, P = M x (ceil(N / M) + 0..3)."""
    rng = np.random.default_rng([28, case])
    N = int(rng.choice([4, 6, 8, 12, 16, 24, 32]))
    M = int(rng.choice([1, 2, 3, 4, 6, 8]))
    P = M * (-(-N // M) + int(rng.integers(0, 4)))
    rows = []
    for _ in range(5):
        p = 1.0 / np.arange(1, N + 1) ** rng.uniform(0.0, 3.0)
        tokens = int(rng.choice([0, 10, 100, 1000, 100_000]))
        rows.append(rng.permutation(rng.multinomial(tokens, p / p.sum())))
    nodes = int(rng.choice([n for n in (1, 2) if M % n == 0]))
    return np.stack(rows).astype(np.float64), M, P, nodes


@pytest.mark.parametrize("block", range(3))
def test_weighted_plans_of_random_zipf_loads_have_normalised_shares(block):
    """300 random Zipf loads (60 (N, M, P, nodes) draws x 5 layers, in 3 blocks) plan with
    weighted=True, and every expert's shares are >= 0 and sum to 1, and its cdf row (what
    the model routes by) rises to exactly 1.0 at its last replica; all checked here from
    physical_to_logical and the shares, not by Placement's own validation. (Planted: the
    wrap-around chain's shares divided by the expert's load instead of their own per-expert
    sum made 7 of the 60 draws fail to plan.)"""
    from eplb.core.planning import plan

    for case in range(20 * block, 20 * (block + 1)):
        load, M, P, nodes = _zipf_case(case)
        L, N = load.shape
        what = f"case {case}: N={N} M={M} P={P} nodes={nodes} load={load.tolist()}"
        placement = plan(load, M, P, num_nodes=nodes, weighted=True)  # raises if invalid
        p2l = np.asarray(placement.physical_to_logical)
        assert p2l.shape == (L, P), what
        assert placement.shares is not None, what
        shares = np.asarray(placement.shares, dtype=np.float64)
        assert shares.shape == (L, P) and np.isfinite(shares).all() and (shares >= 0).all(), what
        _, _, count, cdf = placement.maps()  # [L, N], [L, N, R]
        for layer in range(L):
            for e in range(N):
                slots = [p for p in range(P) if p2l[layer, p] == e]  # ascending slot order
                assert slots, f"{what}: layer {layer} expert {e} has no slot"
                assert count[layer, e] == len(slots), what
                mine = shares[layer, slots]
                assert abs(sum(mine.tolist()) - 1.0) <= 1e-9, (what, layer, e, mine)
                row = cdf[layer, e]
                assert (row[len(slots) - 1:] == 1.0).all(), (what, layer, e, row)
                assert (np.diff(row) >= 0).all(), (what, layer, e, row)
                np.testing.assert_allclose(row[:len(slots)], np.cumsum(mine), rtol=0, atol=1e-6,
                                           err_msg=f"{what} layer {layer} expert {e}")
