"""Policies and plan(): DeepSeek reference vectors, registry, validity, input checks."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import eplb.core.policy.registry
from eplb.core.placement import Placement
from eplb.core.planning import plan
from eplb.core.policy.registry import available_policies, get_policy, register_policy
from eplb.core.policy.deepseek import balanced_packing, rebalance_experts, replicate_experts

DATA = Path(__file__).parent / "data"

# deepseek-ai/EPLB README example
WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]  # [2, 12]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]  # [2, 16]
README_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                 [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]  # [2, 12]
README_LOG2PHY = [  # [2, 12, 2]; order inside an expert depends on sort ties
    [[12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2], [1, -1], [3, -1], [4, -1], [9, -1], [8, 10], [14, -1]],
    [[13, -1], [15, 11], [8, -1], [14, -1], [9, -1], [10, 12], [2, 4], [0, -1], [6, 3], [7, -1], [1, -1], [5, -1]],
]
# same weights, num_groups=3 (3 % 2 != 0 -> global policy)
GLOBAL_PHY2LOG = [[10, 6, 10, 7, 0, 2, 11, 4, 5, 9, 5, 4, 8, 3, 1, 1],
                  [1, 10, 2, 4, 5, 11, 5, 0, 6, 7, 6, 3, 8, 8, 9, 7]]  # [2, 16]


def max_over_mean(placement: Placement, load: np.ndarray) -> np.ndarray:  # [L]
    return 1.0 / placement.balancedness(load)


# ---- DeepSeek reference vectors -----------------------------------------------------
def test_readme_vector_exact():
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor(WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == README_LOGCNT
    assert log2phy.shape == (2, 12, 2)
    for layer in range(2):
        for e in range(12):
            got = set(log2phy[layer, e, : logcnt[layer, e]].tolist())
            want = {p for p in README_LOG2PHY[layer][e] if p >= 0}
            assert got == want == {p for p in range(16) if README_PHY2LOG[layer][p] == e}
            assert (log2phy[layer, e, logcnt[layer, e]:] == -1).all()


def test_readme_vector_gpu_loads():
    p = plan(np.array(WEIGHT), num_gpus=8, num_slots=16, num_nodes=2, num_groups=4, policy="deepseek")
    assert p.physical_to_logical.tolist() == README_PHY2LOG
    assert np.allclose(p.gpu_loads(WEIGHT), [[121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152],
                                             [173, 179.5, 120.5, 172, 123, 152, 118.5, 117.5]])


def test_global_vector_exact():
    phy2log, _, logcnt = rebalance_experts(torch.tensor(WEIGHT), 16, 3, 2, 8)
    assert phy2log.tolist() == GLOBAL_PHY2LOG
    p = plan(np.array(WEIGHT), 8, 16, num_nodes=2, num_groups=3, policy="deepseek")
    assert np.allclose(max_over_mean(p, np.array(WEIGHT)), [1.073, 1.190], atol=1e-3)
    # the faithful baseline keeps DeepSeek's flaw: two replicas of one expert on one GPU
    assert p.num_duplicates_on_gpu() == 2


def test_flashlb_vector():
    """8 experts on 8 GPUs x 2 slots: DeepSeek's max GPU load is 232."""
    w = np.array([[600, 560, 120, 120, 20, 10, 10, 10]], dtype=float)
    p = plan(w, 8, 16, policy="deepseek")
    assert p.replica_count().tolist() == [[5, 5, 1, 1, 1, 1, 1, 1]]
    assert p.gpu_loads(w).max() == pytest.approx(232)


def test_real_trace_esft_ep8():
    """Published figure for DeepSeek's code on the ESFT trace: mean max/mean = 1.0067."""
    w = np.load(DATA / "esft_dsv2lite_alltasks.npy")  # [26, 64]
    p = plan(w, num_gpus=8, num_slots=72, policy="deepseek")
    assert max_over_mean(p, w).mean() == pytest.approx(1.0067, abs=1e-3)


def test_real_trace_olmoe():
    w = np.load(DATA / "olmoe_olmoe_arxiv_L0-7-15.npy")  # [3, 64]
    identity = Placement.initial(3, 64, 64, 8)
    p = plan(w, num_gpus=8, num_slots=72, policy="deepseek")
    assert (max_over_mean(p, w) < max_over_mean(identity, w)).all()


# ---- building blocks ----------------------------------------------------------------
def _packing_row_by_row(weight: torch.Tensor, num_packs: int):
    """DeepSeek's original per-row loop, kept as the reference for the vectorised one."""
    rows, n = weight.shape
    per = n // num_packs
    order = weight.sort(-1, descending=True).indices
    pack_index = torch.full((rows, n), -1, dtype=torch.int64)
    rank = torch.full((rows, n), -1, dtype=torch.int64)
    for i in range(rows):
        pw, cnt = [0] * num_packs, [0] * num_packs
        for item in order[i].tolist():
            pack = min((j for j in range(num_packs) if cnt[j] < per), key=pw.__getitem__)
            pack_index[i, item], rank[i, item] = pack, cnt[pack]
            pw[pack] += weight[i, item]
            cnt[pack] += 1
    return pack_index, rank


@pytest.mark.parametrize("n,packs", [(12, 4), (16, 8), (30, 5)])
def test_balanced_packing_matches_row_loop(n, packs):
    g = torch.Generator().manual_seed(n)
    w = torch.randint(0, 6, (7, n), generator=g).float()  # many ties on purpose
    got = balanced_packing(w, packs)
    want = _packing_row_by_row(w, packs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    counts = torch.zeros(7, packs, dtype=torch.int64).scatter_add_(1, got[0], torch.ones_like(got[0]))
    assert (counts == n // packs).all()


def test_replicate_experts_counts():
    w = torch.tensor([[10.0, 1.0, 4.0]])  # [1, 3]
    phy2log, rank, cnt = replicate_experts(w, 6)
    assert cnt.tolist() == [[3, 1, 2]]
    assert phy2log[0, :3].tolist() == [0, 1, 2]
    assert sorted(phy2log[0].tolist()) == [0, 0, 0, 1, 2, 2]
    assert phy2log[0, 3:].tolist() == [0, 0, 2] and rank[0, 3:].tolist() == [1, 2, 1]


# ---- registry -----------------------------------------------------------------------
def test_registry():
    assert {"balanced", "deepseek", "default"} <= set(available_policies())
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; available: balanced, deepseek, default"):
        get_policy("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy("deepseek")(lambda *a: None)
    # default is the balanced planner; deepseek stays the faithful baseline
    assert "balanced" in get_policy("default").__doc__


def test_custom_policy_output_is_checked():
    @register_policy("_test_bad")
    def bad(load, num_slots, num_gpus, num_nodes, num_groups, previous, options):
        return np.zeros((load.shape[0], num_slots), dtype=np.int64)  # only expert 0

    @register_policy("_test_shape")
    def wrong_shape(load, num_slots, num_gpus, num_nodes, num_groups, previous, options):
        return np.zeros((1, 1), dtype=np.int64)

    try:
        with pytest.raises(ValueError, match="policy '_test_bad' returned an invalid placement.*no replica"):
            plan(np.ones((2, 4)), 2, 4, policy="_test_bad")
        with pytest.raises(ValueError, match="policy '_test_shape' returned shape"):
            plan(np.ones((2, 4)), 2, 4, policy="_test_shape")
    finally:
        eplb.core.policy.registry._REGISTRY.pop("_test_bad")
        eplb.core.policy.registry._REGISTRY.pop("_test_shape")


# ---- validity on random loads -------------------------------------------------------
@pytest.mark.parametrize("policy", ["deepseek", "default"])
@pytest.mark.parametrize(
    "L,N,P,M,nodes,groups",
    [(3, 16, 16, 4, 1, 1), (4, 16, 24, 8, 2, 4), (5, 64, 72, 8, 1, 8),
     (2, 64, 80, 16, 4, 8), (3, 12, 18, 6, 2, 3), (2, 8, 64, 8, 1, 1)],
)
def test_valid_on_random_loads(policy, L, N, P, M, nodes, groups):
    rng = np.random.default_rng(L * 1000 + P)
    load = rng.pareto(1.2, size=(L, N)) * 100  # skewed
    load[0, :2] = 0  # experts without load still need a replica
    p = plan(load, M, P, nodes, groups, policy=policy)
    assert p.physical_to_logical.shape == (L, P) and p.physical_to_logical.dtype == np.int64
    assert p.policy == policy and p.num_gpus == M and p.num_nodes == nodes
    assert (p.replica_count() >= 1).all() and (p.replica_count().sum(1) == P).all()
    assert p.slots_per_gpu * M == P
    assert np.isclose(p.gpu_loads(load).sum(), load.sum())
    # deterministic: same inputs, same placement
    assert plan(load.copy(), M, P, nodes, groups, policy=policy) == p


def test_zero_load():
    p = plan(np.zeros((2, 8)), 4, 12, policy="deepseek")
    assert (p.replica_count() >= 1).all()
    assert (p.balancedness(np.zeros((2, 8))) == 1).all()


def test_hierarchical_keeps_replicas_in_node():
    """Hierarchical policy: every node holds exactly the experts of its groups."""
    rng = np.random.default_rng(1)
    load = rng.integers(0, 1000, (4, 32)).astype(float)
    p = plan(load, num_gpus=8, num_slots=48, num_nodes=2, num_groups=8, policy="deepseek")
    for layer in p.physical_to_logical:
        node_experts = [set(layer[:24].tolist()), set(layer[24:].tolist())]
        assert not (node_experts[0] & node_experts[1])
        for s in node_experts:
            assert len(s) == 16 and {e // 4 for e in s}.__len__() == 4  # 4 whole groups


def test_deepseek_v3_shape_is_fast():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 10_000, (58, 256)).astype(float)
    for nodes, groups in [(1, 1), (4, 8)]:
        t = time.perf_counter()
        p = plan(load, 32, 288, nodes, groups, policy="deepseek")
        assert time.perf_counter() - t < 2.0
        assert p.physical_to_logical.shape == (58, 288)


# ---- plan() inputs ------------------------------------------------------------------
def test_plan_accepts_torch_and_time_series():
    rng = np.random.default_rng(2)
    series = rng.integers(0, 50, (5, 3, 16))  # [T, L, N]
    want = plan(series.sum(0).astype(float), 4, 20)
    assert plan(series, 4, 20) == want
    assert plan(torch.from_numpy(series), 4, 20) == want
    assert plan(torch.from_numpy(series.sum(0)).to(torch.bfloat16), 4, 20).num_slots == 20
    assert plan(series.sum(0).tolist(), 4, 20) == want


def test_plan_does_not_modify_input():
    load = np.arange(32, dtype=float).reshape(2, 16)
    before = load.copy()
    plan(load, 4, 20)
    assert np.array_equal(load, before) and load.flags.writeable


@pytest.mark.parametrize(
    "load,kwargs,match",
    [
        (np.ones(8), {}, r"load must be \[L, N\] or \[T, L, N\], got 1-D"),
        (np.ones((1, 2, 2, 8)), {}, "got 4-D"),
        (np.ones((0, 8)), {}, "load is empty"),
        (np.array([[1.0, np.nan] * 4]), {}, "NaN or inf"),
        (np.array([[1.0, np.inf] * 4]), {}, "NaN or inf"),
        (np.array([[1.0, -1.0] * 4]), {}, "negative"),
        ([["a"] * 8], {}, "numeric"),
        (np.ones((2, 8), dtype=bool), {}, "numeric"),
        (np.ones((2, 8)), {"num_slots": 4}, r"num_slots \(4\) must be >= the number of experts N \(8\)"),
        (np.ones((2, 8)), {"num_slots": 10}, r"multiple of num_gpus \(4\).*try 8 or 12"),
        (np.ones((2, 8)), {"num_slots": 9, "num_gpus": 2}, r"try 8 or 10"),
        (np.ones((2, 8)), {"num_slots": 7, "num_gpus": 4}, r"must be >= the number of experts"),
        (np.ones((2, 8)), {"num_nodes": 3}, r"num_gpus \(4\) must be divisible by num_nodes \(3\)"),
        (np.ones((2, 8)), {"num_groups": 3}, r"N \(8\) must be divisible by num_groups \(3\)"),
        (np.ones((2, 8)), {"num_gpus": 0}, "num_gpus must be >= 1"),
        (np.ones((2, 8)), {"num_gpus": 2.5}, "num_gpus must be an integer"),
        (np.ones((2, 8)), {"policy": "bogus"}, r"unknown policy 'bogus'; available: .*deepseek"),
    ],
)
def test_plan_validation(load, kwargs, match):
    args = {"num_gpus": 4, "num_slots": 12} | kwargs
    with pytest.raises(ValueError, match=match):
        plan(load, **args)


def test_plan_slot_hint_skips_too_small_multiple():
    with pytest.raises(ValueError, match=r"try 16$"):
        plan(np.ones((1, 10)), num_gpus=8, num_slots=12)


def test_previous_mismatch():
    load = np.ones((2, 8))
    prev = plan(load, 4, 12)
    assert plan(load * 2, 4, 12, previous=prev).num_slots == 12
    cases = [
        (np.ones((3, 8)), 4, 12, r"L 2 vs 3"),
        (np.ones((2, 16)), 4, 16, r"N 8 vs 16"),
        (load, 2, 12, r"num_gpus 4 vs 2"),
        (load, 4, 16, r"num_slots 12 vs 16"),
    ]
    for new_load, m, p, match in cases:
        with pytest.raises(ValueError, match="previous placement does not match.*" + match):
            plan(new_load, m, p, previous=prev)
    with pytest.raises(ValueError, match="previous must be a Placement"):
        plan(load, 4, 12, previous=prev.physical_to_logical)


def test_move_tolerance_default_is_the_same_everywhere():
    """EplbConfig, plan() and PolicyOptions share one default move_tolerance."""
    import inspect

    from eplb.core.config import EplbConfig
    from eplb.core.planning import plan as plan_fn
    from eplb.core.policy.base import DEFAULT_MOVE_TOLERANCE, PolicyOptions

    assert EplbConfig().move_tolerance == DEFAULT_MOVE_TOLERANCE == PolicyOptions().move_tolerance
    assert inspect.signature(plan_fn).parameters["move_tolerance"].default == DEFAULT_MOVE_TOLERANCE
