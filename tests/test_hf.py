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

import pytest
import torch
import torch.distributed as dist

from _hf import require_transformers

require_transformers()

from _dist import run_distributed  # noqa: E402

from eplb import EplbConfig, EplbRuntime  # noqa: E402
from moe.hf import expert_parallel, from_pretrained  # noqa: E402
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
