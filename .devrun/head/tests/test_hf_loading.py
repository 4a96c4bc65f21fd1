"""moe.hf.from_pretrained on checkpoints the tests save (tiny random models,
`save_pretrained`), and the errors of moe.hf.expert_parallel on models it cannot handle.

from_pretrained on 2 gloo ranks: logits equal the model loaded whole by transformers,
and the expert-weight bytes each rank reads from the safetensors files (counted by a
wrapper around `safe_open`, not by the loader) and holds are at most its slots' share.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from _hf import require_transformers

require_transformers()

from _dist import run_distributed  # noqa: E402

import moe.hf.loading as loading  # noqa: E402
from moe.hf import expert_parallel, from_pretrained  # noqa: E402
from moe.hf.configs import tiny_config, tiny_model  # noqa: E402


class CountingSafeOpen:
    """`safe_open` that adds up the bytes of every tensor read, by key."""

    def __init__(self, real):
        self.real = real
        self.bytes: dict[str, int] = {}

    def __call__(self, *args, **kwargs):
        counter = self

        class Handle:
            def __init__(self):
                self.inner = counter.real(*args, **kwargs)

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, key):
                t = self.f.get_tensor(key)
                counter.bytes[key] = counter.bytes.get(key, 0) + t.numel() * t.element_size()
                return t

            def get_slice(self, key):
                sliced = self.f.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return sliced.get_shape()

                    def __getitem__(self, index):
                        t = sliced[index]
                        counter.bytes[key] = counter.bytes.get(key, 0) + t.numel() * t.element_size()
                        return t

                return Slice()

        return Handle()


def _load(rank: int, world: int, arch: str, path: str, R: int, sizes: dict) -> None:
    from transformers import AutoModelForCausalLM

    group = dist.group.WORLD
    if rank == 0:
        tiny_model(arch, seed=3, **sizes).save_pretrained(path)
    dist.barrier()
    whole = AutoModelForCausalLM.from_pretrained(path).eval()
    experts = [m for m in whole.modules() if type(m).__name__.endswith("Experts")]
    N = experts[0].num_experts
    # bytes of one logical expert in all layers, from the model loaded whole
    per_expert = sum(t.numel() * t.element_size() // N for m in experts
                     for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
    S = (N + R) // world

    counter = CountingSafeOpen(loading.safe_open)
    loading.safe_open = counter
    try:
        ep = from_pretrained(path, R, group)
    finally:
        loading.safe_open = counter.real
    expert_read = sum(b for k, b in counter.bytes.items() if ".experts." in k)
    distinct = len(set((rank * S + j) % N for j in range(S)))
    assert expert_read == distinct * per_expert <= S * per_expert, (expert_read, per_expert, S)
    assert ep.expert_bytes_read == expert_read
    held = sum(t.numel() * t.element_size() for ws in ep.expert_weights for t in ws)
    assert held == S * per_expert, (held, S, per_expert)

    vocab = whole.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        assert (ep(ids).logits - whole(ids).logits).abs().max().item() <= 1e-5
    # the same slots hold the same experts as expert_parallel() on the model loaded whole
    cut = expert_parallel(copy.deepcopy(whole), R, group)
    for a, b in zip(ep.expert_weights, cut.expert_weights):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if (N + 1) % world:
        with pytest.raises(ValueError, match="do not split over"):
            expert_parallel(copy.deepcopy(whole), 1, group)


@pytest.mark.parametrize("arch, R, sizes", [
    ("qwen3_moe", 2, dict(num_experts=8, num_layers=2)),       # per-expert keys, replicas
    ("qwen3_moe", 6, dict(num_experts=16, num_layers=1)),      # S = 11: slots 10 and 2 sort apart
    ("mixtral", 2, dict(num_experts=8, num_layers=2)),         # renamed per-expert keys
    ("gpt_oss", 2, dict(num_experts=8, num_layers=2)),         # stacked keys with biases
])
def test_from_pretrained_reads_only_own_slots(tmp_path, arch, R, sizes):
    run_distributed(_load, 2, arch, str(tmp_path / arch), R, sizes, timeout=240)


def test_model_without_experts_modules_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: no transformers `\*Experts` module"):
        expert_parallel(model, 0)


def test_experts_module_without_num_experts_is_refused():
    model = tiny_model("qwen3_moe", num_layers=1)
    del model.model.layers[0].mlp.experts.num_experts
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts \(Qwen3MoeExperts\): "
                                         r"has no integer `num_experts`"):
        expert_parallel(model, 0)


def test_experts_tensor_not_stacked_is_refused():
    model = tiny_model("qwen3_moe", num_layers=1)
    experts = model.model.layers[0].mlp.experts
    experts.scale = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"tensors scale \(3,\) are not stacked on dim 0"):
        expert_parallel(model, 0)


def test_unknown_architecture_name():
    with pytest.raises(ValueError, match="not one of qwen3_moe, qwen2_moe"):
        tiny_config("llama")


def test_redundant_count_must_be_an_int():
    with pytest.raises(ValueError, match="num_redundant_experts"):
        expert_parallel(tiny_model("qwen3_moe", num_layers=1), -1)


def test_full_expert_tensors_are_freed():
    """expert_parallel keeps [S, ...] copies of the local rows; nothing holds the full
    [N, ...] tensors afterwards (biases included), so their memory goes back."""
    import gc
    import weakref

    model = tiny_model("gpt_oss", num_layers=1)
    experts = model.model.layers[0].mlp.experts
    full = {n: weakref.ref(p) for n, p in experts.named_parameters(recurse=False)}
    assert set(full) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    ep = expert_parallel(model, 0)
    gc.collect()
    assert [n for n, ref in full.items() if ref() is not None] == []
    assert [t.shape[0] for t in ep.expert_weights[0]] == [8, 8, 8, 8]
