"""moe.hf against the unmodified transformers model (the oracle: code this project did
not write), for every tested architecture on 2 and 4 gloo ranks, fp32:

* logits equal the original's (max abs diff <= 1e-5) before and after three rebalances
  planned on skewed inputs (each rank routes mostly to its own few hot experts);
* greedy generate() gives identical tokens;
* the load each rank records equals the histogram of the original router's top-k choices
  (taken by hooks on the original model's experts modules);
* the weights' storage (data_ptr) is unchanged by rebalances, and rebalances move weights.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _hf import require_transformers

require_transformers()

from _dist import run_distributed  # noqa: E402

from eplb import EplbConfig, EplbRuntime  # noqa: E402
from moe.hf import expert_parallel  # noqa: E402
from moe.hf.configs import ARCHITECTURES, tiny_model  # noqa: E402

ATOL = 1e-5
SIZES = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, num_layers=2)


def router_histogram(model, ids: torch.Tensor) -> torch.Tensor:  # [L, N]
    """Per-layer histogram of the top-k expert choices the original model makes on `ids`,
    read at the input of each of its experts modules."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    N = found[0].num_experts
    counts = torch.zeros(len(found), N, dtype=torch.int64)

    def hook(i):
        def pre(module, args, kwargs):
            top_k_index = args[1] if len(args) > 1 else next(
                v for k, v in kwargs.items() if k in ("top_k_index", "router_indices"))
            counts[i] += torch.bincount(top_k_index.reshape(-1), minlength=N)
        return pre

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(found)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return counts


def skewed_ids(rank: int, round_: int, vocab: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    """[batch, length] token ids: each rank and round draws from its own 3 tokens, so each
    rank's routing concentrates on a few experts and the hot set changes per round."""
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    pool = torch.randperm(vocab - 3, generator=gen)[:3] + 3
    return pool[torch.randint(0, 3, (batch, length), generator=gen)]


def max_diff(ep, ref, ids) -> float:
    with torch.no_grad():
        return (ep(ids).logits - ref(ids).logits).abs().max().item()


def _against_original(rank: int, world: int, arch: str) -> None:
    group = dist.group.WORLD
    ref = tiny_model(arch, seed=0, **SIZES)
    vocab = ref.config.get_text_config().vocab_size
    R = world  # one redundant slot per rank
    ep = expert_parallel(copy.deepcopy(ref), R, group)
    runtime = EplbRuntime(ep, EplbConfig(num_redundant_experts=R, min_gain=0.0, move_tolerance=0.0), group)
    try:
        ptrs = [t.data_ptr() for ws in ep.expert_weights for t in ws]
        ids = skewed_ids(rank, 0, vocab)
        assert max_diff(ep, ref, ids) <= ATOL
        # the load recorded by that forward, folded to logical experts, is the oracle's histogram
        ep.expert_load_view.zero_()
        with torch.no_grad():
            ep(ids)
        p2l = torch.from_numpy(runtime.placement.physical_to_logical)  # [L, P]
        recorded = torch.zeros(ep.num_moe_layers, ep.num_logical_experts, dtype=torch.int64)
        recorded.scatter_add_(1, p2l, ep.expert_load_view.cpu())
        assert torch.equal(recorded, router_histogram(ref, ids)), (recorded, router_histogram(ref, ids))
        runtime.step()
        moved = 0
        for round_ in range(1, 4):
            for _ in range(3):
                with torch.no_grad():
                    ep(skewed_ids(rank, round_, vocab))
                runtime.step()
            event = runtime.rebalance()
            assert event is not None and not event.skipped, event
            moved += event.experts_moved + event.local_copies
            assert [t.data_ptr() for ws in ep.expert_weights for t in ws] == ptrs
            # maps changed: replicas of hot experts now serve; outputs are still the original's
            assert max_diff(ep, ref, skewed_ids(rank, round_, vocab)) <= ATOL
            assert max_diff(ep, ref, skewed_ids(rank + 7, round_, vocab)) <= ATOL
        assert moved > 0, "three rebalances on skewed load moved no weights"
        assert runtime.placement.replica_count().max() >= 2
        prompt = skewed_ids(rank, 9, vocab, batch=1, length=5)
        with torch.no_grad():
            out = ep.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            want = ref.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert torch.equal(out, want), (out, want)
    finally:
        runtime.close()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_original_model(arch, world):
    run_distributed(_against_original, world, arch, timeout=240)


def _resize_round_trip(rank: int, world: int, arch: str) -> None:
    """An HF model through eplb.runtime.resize: 4 ranks -> 2 (planned on the window) -> 4; the
    members' logits stay the original's, the released ranks hold no expert weights."""
    from eplb.runtime.resize import resize_expert_parallel

    group = dist.group.WORLD
    ref = tiny_model(arch, seed=0, **SIZES)
    vocab = ref.config.get_text_config().vocab_size
    ep = expert_parallel(copy.deepcopy(ref), 4, group)  # P = 12
    cfg = EplbConfig(num_redundant_experts=4, min_gain=0.0)
    runtime = EplbRuntime(ep, cfg, group)
    for round_ in range(3):
        with torch.no_grad():
            ep(skewed_ids(rank, round_, vocab))
        runtime.step()
    everyone, half = list(range(world)), list(range(world // 2))
    res = resize_expert_parallel(ep, everyone, half, runtime=runtime, load="window")
    if rank in half:
        assert ep.num_local_physical_experts == 6 and res.runtime.world_size == 2
        assert ep.num_redundant_experts == 12 - SIZES["num_experts"]  # P unchanged: 12
        assert max_diff(ep, ref, skewed_ids(rank, 5, vocab)) <= ATOL
        runtime = res.runtime
    else:
        assert res.runtime is None and ep.num_local_physical_experts == 0
        assert all(t.numel() == 0 for ws in ep.expert_weights for t in ws)
        runtime = None
    res = resize_expert_parallel(ep, half, everyone, runtime=runtime,
                                 config=None if rank in half else cfg)
    assert ep.num_local_physical_experts == 3 and res.runtime.world_size == world
    assert ep.num_redundant_experts == 12 - SIZES["num_experts"]
    assert max_diff(ep, ref, skewed_ids(rank, 6, vocab)) <= ATOL
    res.runtime.close()


def test_update_physical_experts_metadata_sets_every_size():
    """One process: the sizes an elastic resize sets, against the P and S asked for
    (N = 8 experts): P, S and num_redundant_experts = P - N, on the model and its layers."""
    N = SIZES["num_experts"]
    ep = expert_parallel(tiny_model("qwen3_moe", seed=0, **SIZES), 2)  # P = 10, S = 10
    assert (ep.num_physical_experts, ep.num_redundant_experts) == (10, 2)
    for P, S, reallocate in ((16, 16, False), (16, 8, True), (8, 8, False), (12, 4, True)):
        ep.update_physical_experts_metadata(P, S, reallocate=reallocate)
        assert (ep.num_physical_experts, ep.num_local_physical_experts) == (P, S)
        assert ep.num_redundant_experts == P - N, (P, S, ep.num_redundant_experts)
        assert ep.num_logical_experts == N
        for layer in ep.moe_layers:
            assert (layer.num_physical_experts, layer.num_local_physical_experts) == (P, S)
        assert all(w.shape[0] == S for ws in ep.expert_weights for w in ws)


def _resize_changes_slots(rank: int, world: int) -> None:
    """2 ranks, P = 10 -> rank 0 alone with P = 9 (planned on the window) -> both
    ranks with P = 12: the sizes follow the P asked for (num_redundant_experts = P - N),
    and the members' logits stay the original's."""
    from eplb.runtime.resize import resize_expert_parallel

    group = dist.group.WORLD
    N = SIZES["num_experts"]
    ref = tiny_model("qwen3_moe", seed=0, **SIZES)
    vocab = ref.config.get_text_config().vocab_size
    ep = expert_parallel(copy.deepcopy(ref), 2, group)  # P = 10, S = 5
    cfg = EplbConfig(num_redundant_experts=2, min_gain=0.0)
    runtime = EplbRuntime(ep, cfg, group)
    with torch.no_grad():
        ep(skewed_ids(rank, 0, vocab))
    runtime.step()
    res = resize_expert_parallel(ep, [0, 1], [0], runtime=runtime, num_physical_experts=9,
                                 load="window")
    if rank == 0:
        assert (ep.num_physical_experts, ep.num_local_physical_experts) == (9, 9)
        assert ep.num_redundant_experts == 9 - N
        assert res.runtime.config.num_redundant_experts == 9 - N
        assert max_diff(ep, ref, skewed_ids(rank, 1, vocab)) <= ATOL
    else:
        assert res.runtime is None and ep.num_local_physical_experts == 0
    res = resize_expert_parallel(ep, [0], [0, 1], runtime=res.runtime, num_physical_experts=12,
                                 config=None if rank == 0 else cfg)
    assert (ep.num_physical_experts, ep.num_local_physical_experts) == (12, 6)
    assert ep.num_redundant_experts == 12 - N
    assert res.runtime.config.num_redundant_experts == 12 - N
    assert max_diff(ep, ref, skewed_ids(rank, 2, vocab)) <= ATOL
    res.runtime.close()


def test_resize_changes_slots_and_redundant_count():
    run_distributed(_resize_changes_slots, 2, timeout=240)


@pytest.mark.slow
def test_resize_round_trip():
    run_distributed(_resize_round_trip, 4, "qwen3_moe", timeout=240)


def _other_configs():
    """Architectures moe.hf has no code or config for: they fit the generic path."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {
        "glm4_moe": tf.Glm4MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32,
                                     num_key_value_heads=2, n_routed_experts=8,
                                     num_experts_per_tok=2, n_group=1, topk_group=1,
                                     first_k_dense_replace=0, n_shared_experts=1, head_dim=16),
        "deepseek_v2": tf.DeepseekV2Config(**common, intermediate_size=64, moe_intermediate_size=32,
                                           num_key_value_heads=4, n_routed_experts=8,
                                           num_experts_per_tok=2, first_k_dense_replace=0,
                                           n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
                                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
        "ernie4_5_moe": tf.Ernie4_5_MoeConfig(**common, intermediate_size=64,
                                              moe_intermediate_size=32, num_key_value_heads=2,
                                              moe_num_experts=8, moe_k=2, moe_layer_start_index=0,
                                              moe_num_shared_experts=1),
        "hunyuan_v1_moe": tf.HunYuanMoEV1Config(**common, intermediate_size=32,
                                                num_key_value_heads=2, num_experts=8, moe_topk=2,
                                                head_dim=16),
        "dots1": tf.Dots1Config(**common, intermediate_size=64, moe_intermediate_size=32,
                                num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                                first_k_dense_replace=0, n_shared_experts=1, head_dim=16),
    }


def _others(rank: int, world: int) -> None:
    from transformers import AutoModelForCausalLM

    group = dist.group.WORLD
    for name, config in _other_configs().items():
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # routers are zero at init in some: give them random rows
            gen = torch.Generator().manual_seed(1)
            for module in ref.modules():
                kind = type(module).__name__
                if "router" in kind.lower() or kind.endswith("Gate"):
                    for p in module.parameters(recurse=False):
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        ep = expert_parallel(copy.deepcopy(ref), 2, group)
        runtime = EplbRuntime(ep, EplbConfig(num_redundant_experts=2, min_gain=0.0,
                                             move_tolerance=0.0), group)
        try:
            assert max_diff(ep, ref, skewed_ids(rank, 0, 128)) <= ATOL, name
            for _ in range(3):
                with torch.no_grad():
                    ep(skewed_ids(rank, 1, 128))
                runtime.step()
            event = runtime.rebalance()
            assert event is not None and not event.skipped and event.experts_moved > 0, (name, event)
            assert max_diff(ep, ref, skewed_ids(rank, 1, 128)) <= ATOL, name
        finally:
            runtime.close()


def test_other_architectures_work_without_code():
    run_distributed(_others, 2, timeout=240)


# ---- per-slot load against the replica rule, computed here --------------------------------

KNUTH = 2654435769  # moe/dispatch.py: h = (flat_index * KNUTH) mod 2^32


def expected_slots(top_k_index: np.ndarray, p2l: np.ndarray, shares: np.ndarray | None = None
                   ) -> np.ndarray:
    """[T, K] slot of every (token, k) by the documented replica rule, in numpy: the
    replicas of expert e are its slots in ascending order (p2l [P]); h = (t*K + k) * KNUTH
    mod 2^32; without shares (or with an even split) replica = (h * count) >> 32; with
    uneven shares [P] the first replica whose float32 cumulative share exceeds
    u = (h >> 8) / 2^24 (the last replica's cumulative share is 1.0), at most count - 1."""
    T, K = top_k_index.shape
    h = (np.arange(T * K, dtype=np.uint64).reshape(T, K) * np.uint64(KNUTH)) % np.uint64(2 ** 32)
    out = np.empty((T, K), dtype=np.int64)
    for t in range(T):
        for k in range(K):
            e = int(top_k_index[t, k])
            slots = np.flatnonzero(p2l == e)
            count = len(slots)
            hv = int(h[t, k])
            sh = None if shares is None else shares[slots]
            if sh is None or np.allclose(sh, 1.0 / count, rtol=0, atol=1e-6):
                replica = (hv * count) >> 32
            else:
                cdf = np.cumsum(sh).astype(np.float32)
                cdf[-1] = 1.0
                u = (hv >> 8) * 2.0 ** -24
                replica = min(int((cdf.astype(np.float64) <= u).sum()), count - 1)
            out[t, k] = slots[replica]
    return out


class TopKCapture:
    """The top-k logical ids every `*Experts` module of `ep` receives, per forward: a
    forward pre-hook on the module (the wrapper's input)."""

    def __init__(self, ep) -> None:
        self.calls: list[list[np.ndarray]] = [[] for _ in ep.moe_layers]

        def hook(i):
            def pre(module, args, kwargs):
                top_k_index = args[1] if len(args) > 1 else next(
                    v for k, v in kwargs.items() if k in ("top_k_index", "router_indices"))
                self.calls[i].append(top_k_index.detach().cpu().numpy().astype(np.int64))
            return pre

        self.handles = [layer.module.register_forward_pre_hook(hook(i), with_kwargs=True)
                        for i, layer in enumerate(ep.moe_layers)]

    def expected_load(self, p2l: np.ndarray, num_slots: int,
                      shares: np.ndarray | None = None) -> np.ndarray:  # [L, P]
        """Per-slot load of every captured forward under placement p2l [L, P]."""
        load = np.zeros((len(self.calls), num_slots), dtype=np.int64)
        for i, calls in enumerate(self.calls):
            for ids in calls:
                slots = expected_slots(ids, p2l[i], None if shares is None else shares[i])
                load[i] += np.bincount(slots.reshape(-1), minlength=num_slots)
        return load

    def reset(self) -> None:
        for calls in self.calls:
            calls.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _check_slot_load(ep, ids_list, capture, p2l, shares=None, where="") -> None:
    """Zero the load view, run forwards on ids_list, compare the per-slot load each layer
    recorded with the replica rule applied here to the captured top-k ids; every replica
    of an expert with 2+ replicas (share > 0) received tokens."""
    P = ep.num_physical_experts
    ep.expert_load_view.zero_()
    capture.reset()
    with torch.no_grad():
        for ids in ids_list:
            ep(ids)
    got = ep.expert_load_view.cpu().numpy().astype(np.int64)  # [L, P]
    want = capture.expected_load(p2l, P, shares)
    assert np.array_equal(got, want), (where, got.tolist(), want.tolist())
    for layer, row in enumerate(p2l):
        counts = np.bincount(row, minlength=ep.num_logical_experts)
        for p in range(P):
            if counts[row[p]] >= 2 and (shares is None or shares[layer, p] > 0):
                assert got[layer, p] > 0, (where, layer, p, got[layer].tolist(), row.tolist())


# the chosen placements: experts with 3 and 2 replicas, spread over both halves of the slots
CHOSEN = np.array([[3, 0, 5, 1, 2, 6, 3, 4, 7, 5, 0, 3],
                   [7, 6, 5, 4, 3, 2, 1, 0, 7, 1, 1, 2]])


def _uneven_shares(p2l: np.ndarray, N: int) -> np.ndarray:
    """Shares proportional to 3^-r over each expert's replicas in slot order."""
    shares = np.zeros(p2l.shape)
    for layer, row in enumerate(p2l):
        for e in range(N):
            slots = np.flatnonzero(row == e)
            w = 3.0 ** -np.arange(len(slots))
            shares[layer, slots] = w / w.sum()
    return shares


def _slot_load(rank: int, world: int) -> None:
    """Per-slot load, checked against the replica rule computed in the test, with 4
    redundant slots (P = 12): the model alone on its start-up placement, under the
    runtime after a rebalance on skewed load, on a chosen placement with experts of 2 and
    3 replicas, and on that placement with uneven replica shares. Each rank checks the
    load its own forwards recorded."""
    from eplb.core.placement import Placement

    group = dist.group.WORLD if world > 1 else None
    ref = tiny_model("qwen3_moe", seed=0, **SIZES)
    vocab = ref.config.get_text_config().vocab_size
    N, R = SIZES["num_experts"], 4
    P = N + R
    ep = expert_parallel(ref, R, group)
    capture = TopKCapture(ep)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = [torch.randint(3, vocab, (4, 32), generator=gen) for _ in range(2)]  # 256 tokens
    startup = np.tile(np.arange(P) % N, (ep.num_moe_layers, 1))  # slot p holds p mod N
    _check_slot_load(ep, ids, capture, startup, where="start-up, no runtime")
    runtime = EplbRuntime(ep, EplbConfig(num_redundant_experts=R, min_gain=0.0,
                                         move_tolerance=0.0), group)
    try:
        for round_ in range(3):
            with torch.no_grad():
                ep(skewed_ids(rank, round_, vocab))
            runtime.step()
        event = runtime.rebalance()
        assert event is not None and not event.skipped, event
        planned = np.array(runtime.placement.physical_to_logical)
        assert max(np.bincount(row).max() for row in planned) >= 2
        assert not np.array_equal(planned, startup)
        _check_slot_load(ep, ids, capture, planned, where="after a rebalance")
        runtime.apply_placement(Placement(CHOSEN, N, world), trigger="test")
        _check_slot_load(ep, ids, capture, CHOSEN, where="chosen placement")
        shares = _uneven_shares(CHOSEN, N)
        runtime.apply_placement(Placement(CHOSEN, N, world, shares=shares), trigger="test")
        _check_slot_load(ep, ids, capture, CHOSEN, shares, where="chosen placement, uneven shares")
    finally:
        capture.close()
        runtime.close()


def test_slot_load_follows_the_replica_rule_one_process():
    _slot_load(0, 1)


def test_slot_load_follows_the_replica_rule_two_ranks():
    run_distributed(_slot_load, 2, timeout=240)
