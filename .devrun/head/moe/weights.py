"""Deterministic weights: every parameter is a pure function of (seed, module, layer[, expert]).

Any rank can therefore build any logical expert's weights without holding the others,
every rank builds identical router / shared-expert / norm parameters, and tests can
check a slot bitwise against `expert_weights_for`. Values are drawn on the CPU in
float32 by a `torch.Generator` seeded from a stable hash, then cast and moved, so they
do not depend on the device.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from .args import MoEArgs


def _generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded from a stable (process-independent) hash of `parts`."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def expert_weights_for(
    args: MoEArgs, layer: int, expert: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of logical routed expert `expert` of MoE layer `layer`.

    Returns (w13 [2I, H], w2 [H, I]) in `args.dtype` on `device`; rows [0, I) of w13
    are the gate projection, rows [I, 2I) the up projection.
    """
    if not 0 <= expert < args.num_experts:
        raise ValueError(f"expert {expert} outside [0, {args.num_experts})")
    H, I = args.hidden_size, args.intermediate_size
    gen = _generator("expert", args.seed, layer, expert)
    w13 = _randn(gen, 2 * I, H, std=H ** -0.5)  # [2I, H]
    w2 = _randn(gen, H, I, std=I ** -0.5)  # [H, I]
    return (w13.to(device=device, dtype=args.dtype), w2.to(device=device, dtype=args.dtype))


def router_weight_for(args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gate weight [N, H], always float32 (routing runs in float32)."""
    gen = _generator("router", args.seed, layer)
    return _randn(gen, args.num_experts, args.hidden_size,
                  std=args.hidden_size ** -0.5).to(device)


def shared_expert_weights_for(
    args: MoEArgs, layer: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared experts of a layer fused into one SwiGLU MLP of intermediate size
    Is = num_shared_experts * I (DeepSeek style). Returns (w13 [2Is, H], w2 [H, Is])."""
    H, Is = args.hidden_size, args.num_shared_experts * args.intermediate_size
    if Is == 0:
        raise ValueError("num_shared_experts is 0: the model has no shared experts")
    gen = _generator("shared", args.seed, layer)
    w13 = _randn(gen, 2 * Is, H, std=H ** -0.5)
    w2 = _randn(gen, H, Is, std=Is ** -0.5)
    return (w13.to(device=device, dtype=args.dtype), w2.to(device=device, dtype=args.dtype))


def norm_weight_for(args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RMSNorm scale [H] near 1."""
    gen = _generator("norm", args.seed, layer)
    return (1.0 + _randn(gen, args.hidden_size, std=0.1)).to(device=device, dtype=args.dtype)


def sample_tokens(
    args: MoEArgs, num_tokens: int, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A reproducible batch of hidden states [T, H] (for tests and demos)."""
    gen = _generator("tokens", args.seed, seed)
    return _randn(gen, num_tokens, args.hidden_size, std=1.0).to(device=device, dtype=args.dtype)


@torch.no_grad()
def write_expert_slots(
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    args: MoEArgs,
    layer: int,
    logical_ids: Sequence[int],  # [S] logical expert held by each local slot
) -> None:
    """Fill slot s of the stacked tensors, in place, with logical expert `logical_ids[s]`."""
    if len(logical_ids) != w13.shape[0] or w2.shape[0] != w13.shape[0]:
        raise ValueError(f"{len(logical_ids)} logical ids for {w13.shape[0]} slots")
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for s, e in enumerate(int(e) for e in logical_ids):
        if e not in cache:
            cache[e] = expert_weights_for(args, layer, e, device=w13.device)
        w13[s].copy_(cache[e][0])
        w2[s].copy_(cache[e][1])
