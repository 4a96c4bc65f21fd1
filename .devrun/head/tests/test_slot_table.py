"""`moe.dispatch.SlotTable`: the even-split replica choice as one gather per forward
(issue 28, eager decode), bitwise `map_to_physical`, and never stale: every in-place
rewrite of the maps (what a placement change does between forwards) is followed."""
from __future__ import annotations

import copy

import pytest
import torch

from moe.dispatch import SlotTable, map_to_physical


def _maps(N: int, R: int, P: int, seed: int):
    """Random valid maps: expert e has count[e] in [1, R] distinct slots of P, -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    count = torch.randint(1, R + 1, (N,), generator=gen)  # [N]
    l2p = torch.full((N, R), -1, dtype=torch.int64)  # [N, R]
    for e in range(N):
        l2p[e, :count[e]] = torch.randperm(P, generator=gen)[:int(count[e])]
    return l2p, count


@pytest.mark.parametrize("T,K,N,R", [(1, 1, 4, 1), (7, 2, 8, 3), (64, 8, 128, 4), (5, 6, 60, 2)])
def test_bitwise_map_to_physical(T, K, N, R):
    l2p, count = _maps(N, R, N + 16, seed=T)
    ids = torch.randint(0, N, (T, K), generator=torch.Generator().manual_seed(K))  # [T, K]
    table = SlotTable()
    for _ in range(2):  # built, then served from the table
        assert torch.equal(table(ids, l2p, count), map_to_physical(ids, l2p, count))
    assert table._table is not None  # the table path ran, not the fallback


def test_follows_every_in_place_rewrite_of_the_maps():
    """The runtime's maps are rows of [L, N, R] / [L, N] tensors rewritten in place by a
    placement change; the table must follow each kind of write, also of another row."""
    L, N, R, P = 3, 16, 3, 24
    l2p_all = torch.stack([_maps(N, R, P, seed=s)[0] for s in range(L)])  # [L, N, R]
    count_all = torch.stack([_maps(N, R, P, seed=s)[1] for s in range(L)])  # [L, N]
    l2p, count = l2p_all[1], count_all[1]  # the layer's views
    ids = torch.randint(0, N, (32, 2), generator=torch.Generator().manual_seed(0))  # [T, K]
    table = SlotTable()

    def check():
        got = table(ids, l2p, count)
        assert torch.equal(got, map_to_physical(ids, l2p, count))
        return got

    before = check()
    new_l2p, new_count = _maps(N, R, P, seed=99)
    l2p_all[1].copy_(new_l2p)  # a switch: maps written with copy_ ...
    count_all[1].copy_(new_count)
    after = check()
    assert not torch.equal(before, after)  # the rewrite changed the routing
    l2p_all[1, :, 0] = l2p_all[1, :, 0].flip(0)  # ... index assignment ...
    flipped = check()
    assert not torch.equal(after, flipped)
    with torch.inference_mode():  # ... under inference mode (serving loops)
        count_all[1].fill_(1)
    assert torch.equal(check(), l2p[ids, 0])  # one replica each: always slot column 0


def test_falls_back_to_map_to_physical_where_a_table_cannot_serve():
    N, R = 8, 3
    l2p, count = _maps(N, R, 12, seed=1)
    ids = torch.randint(0, N, (9, 2), generator=torch.Generator().manual_seed(2))
    cdf = torch.tensor([[0.25, 1.0, 1.0]] * N)  # [N, R] uneven shares
    table = SlotTable()
    assert torch.equal(table(ids, l2p, count, cdf), map_to_physical(ids, l2p, count, cdf))
    with torch.inference_mode():  # inference tensors keep no version counter
        il2p, icount = l2p.clone(), count.clone()
    assert torch.equal(table(ids, il2p, icount), map_to_physical(ids, l2p, count))
    assert table._table is None  # neither case built a table


def test_an_hf_decode_forward_routes_with_one_gather_per_layer_and_no_index():
    """The wrapped model's extra ops over the original's in a decode-size forward: one
    `gather` (the table) and one `scatter_add_` (the load) per MoE layer, no `index`."""
    from _hf import require_transformers
    require_transformers()
    from test_hf_fast_path import SIZES, CountOps

    from moe.hf import expert_parallel
    from moe.hf.configs import tiny_model

    ref = tiny_model("qwen3_moe", seed=0, **SIZES)
    ep = expert_parallel(copy.deepcopy(ref), 2)
    from eplb.core.config import EplbConfig
    from eplb.runtime import EplbRuntime
    runtime = EplbRuntime(ep, EplbConfig(rebalance_interval=0, control_interval=0))
    try:
        ids = torch.randint(3, 200, (4, 1), generator=torch.Generator().manual_seed(1))
        counts = {}
        for name, model in (("ref", ref), ("ep", ep)):
            with torch.no_grad():
                model(ids)  # the first forward builds the tables
                with CountOps() as ops:
                    model(ids)
            counts[name] = ops.counts
        L = SIZES["num_layers"]
        extra = {k: counts["ep"].get(k, 0) - counts["ref"].get(k, 0)
                 for k in set(counts["ep"]) | set(counts["ref"])}
        assert extra.get("index", 0) == 0, extra
        assert extra.get("gather", 0) == L and extra.get("scatter_add_", 0) == L, extra
    finally:
        runtime.close()
