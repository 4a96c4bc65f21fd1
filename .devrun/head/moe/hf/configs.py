"""Small random configs of the transformers MoE architectures moe.hf is tested on, for
tests, `eplb demo --model NAME` and benchmarks (no checkpoint or download needed)."""
from __future__ import annotations

ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")


def tiny_config(name: str, *, hidden_size: int = 64, num_layers: int = 2, num_experts: int = 8,
                top_k: int = 2, intermediate_size: int = 32, vocab_size: int = 256,
                num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, **extra):
    """A transformers config of architecture `name` (one of ARCHITECTURES) with the given
    sizes; `intermediate_size` is each routed expert's. `extra` overrides config fields."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  num_experts_per_tok=top_k, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_experts=num_experts, head_dim=head_dim,
                                moe_intermediate_size=intermediate_size,
                                intermediate_size=2 * intermediate_size, norm_topk_prob=True)
    elif name == "qwen2_moe":  # a shared expert with its sigmoid gate
        cfg = tf.Qwen2MoeConfig(**common, num_experts=num_experts,
                                moe_intermediate_size=intermediate_size,
                                shared_expert_intermediate_size=2 * intermediate_size,
                                intermediate_size=2 * intermediate_size)
    elif name == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=num_experts, head_dim=head_dim,
                               intermediate_size=intermediate_size)
    elif name == "olmoe":
        cfg = tf.OlmoeConfig(**common, num_experts=num_experts,
                             intermediate_size=intermediate_size)
    elif name == "deepseek_v3":  # group-limited routing, sigmoid scores with bias, shared
        groups = 4 if num_experts % 4 == 0 else 1
        cfg = tf.DeepseekV3Config(
            **common, n_routed_experts=num_experts, moe_intermediate_size=intermediate_size,
            intermediate_size=2 * intermediate_size, n_shared_experts=1, n_group=groups,
            topk_group=max(1, groups // 2), first_k_dense_replace=0, kv_lora_rank=32,
            q_lora_rank=32, qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2,
            v_head_dim=head_dim, routed_scaling_factor=2.5, norm_topk_prob=True)
    elif name == "gpt_oss":  # biases, transposed [E, in, out] layout, clamped swiglu
        cfg = tf.GptOssConfig(**common, num_local_experts=num_experts, head_dim=head_dim,
                              intermediate_size=intermediate_size,
                              layer_types=["full_attention"] * num_layers)
    else:
        raise ValueError(f"model: {name!r} is not one of {', '.join(ARCHITECTURES)}")
    for key, value in extra.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(name: str, seed: int = 0, dtype=None, **sizes):
    """A randomly initialised `AutoModelForCausalLM` of `tiny_config(name, **sizes)`, the
    same on every rank for the same seed; eval mode. Router weights (zeros at init in
    some architectures) and DeepSeek's score bias get random values, so routing is not
    degenerate."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **sizes))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if "router" in type(module).__name__.lower():
                for p in module.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * p.shape[-1] ** -0.5)
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn(bias.shape, generator=gen, device="cpu") * 0.01)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
