"""MoEArgs: every size and switch of the reference MoE model in one dataclass."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_FUNCS = ("softmax", "sigmoid")
DISPATCH_MODES = ("exact", "fixed")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class MoEArgs:
    hidden_size: int = 64  # H
    intermediate_size: int = 32  # I, per routed expert
    num_layers: int = 2  # L, MoE layers
    num_experts: int = 8  # N, routed (logical) experts per layer
    top_k: int = 2  # K
    num_redundant_experts: int = 0  # P - N extra physical slots per layer
    num_expert_groups: int = 1  # 1 = plain top-k; > 1 = group-limited top-k
    topk_groups: int = 1  # groups kept per token in group-limited top-k
    num_shared_experts: int = 0  # dense experts every token goes through
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True  # renormalize the K gate weights to sum to 1
    dtype: torch.dtype = torch.float32  # weights and activations (router runs in fp32)
    seed: int = 0  # all weights derive from (seed, layer, expert / module)
    norm_eps: float = 1e-6
    dispatch_mode: str = "exact"  # EP all-to-all, moe.dispatch: "exact" | "fixed" (same T per rank)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            name = self.dtype.removeprefix("torch.")
            if name not in DTYPES:
                raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
            self.dtype = DTYPES[name]

    # ---- derived sizes -----------------------------------------------------------
    @property
    def num_physical_experts(self) -> int:  # P
        return self.num_experts + self.num_redundant_experts

    def num_local_physical_experts(self, num_ranks: int) -> int:  # S = P / EP size
        return self.num_physical_experts // num_ranks

    # ---- validation --------------------------------------------------------------
    def validate(self, num_ranks: int = 1) -> "MoEArgs":
        """Raise ValueError naming the offending field; return self when all is well."""
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_experts",
                     "top_k", "num_expert_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        for name in ("num_redundant_experts", "num_shared_experts", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks: must be an int >= 1, got {num_ranks!r}")
        N, P = self.num_experts, self.num_physical_experts
        if self.top_k > N:
            raise ValueError(f"top_k: {self.top_k} exceeds num_experts ({N})")
        if P % num_ranks:
            raise ValueError(
                f"num_redundant_experts: num_experts ({N}) + num_redundant_experts "
                f"({self.num_redundant_experts}) = {P} must be divisible by the number of EP "
                f"ranks ({num_ranks}); e.g. num_redundant_experts="
                f"{self.num_redundant_experts + (-P) % num_ranks}"
            )
        G = self.num_expert_groups
        if N % G:
            raise ValueError(f"num_expert_groups: num_experts ({N}) must be divisible by "
                             f"num_expert_groups ({G})")
        if self.topk_groups > G:
            raise ValueError(f"topk_groups: {self.topk_groups} exceeds num_expert_groups ({G})")
        if self.topk_groups * (N // G) < self.top_k:
            raise ValueError(
                f"topk_groups: {self.topk_groups} groups of {N // G} experts hold fewer than "
                f"top_k ({self.top_k}) experts"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: {self.score_func!r} is not one of {list(SCORE_FUNCS)}")
        if self.dispatch_mode not in DISPATCH_MODES:
            raise ValueError(f"dispatch_mode: {self.dispatch_mode!r} is not one of "
                             f"{list(DISPATCH_MODES)}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype: {self.dtype} is not one of {sorted(DTYPES)}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps: must be > 0, got {self.norm_eps!r}")
        return self
