"""The model-side interface of the runtime, kept name for name with vLLM's
`MixtureOfExperts` so that a vLLM-style model plugs in unchanged.

A model exposes, per MoE layer, the stacked tensors of its local expert weights
(`expert_weights[layer][i]` has shape `[num_local_physical_experts, ...]`) and
receives three runtime-owned tensors whose *storage never changes*: the runtime
updates them with `copy_`, so views a layer holds (and CUDA graphs) stay valid.
"""
from __future__ import annotations

from typing import Iterable, MutableSequence, Protocol, Sequence, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class MoELayerProtocol(Protocol):
    """One MoE layer as the runtime sees it."""

    def get_expert_weights(self) -> Sequence[torch.Tensor]:
        """Stacked local expert tensors, each `[num_local_physical_experts, ...]`."""
        ...

    def set_eplb_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,  # [L, P] int64 (the layer keeps row moe_layer_idx)
        logical_to_physical_map: torch.Tensor,  # [L, N, R] int64, -1 padded
        logical_replica_count: torch.Tensor,  # [L, N] int64
    ) -> None:
        ...


@runtime_checkable
class MixtureOfExperts(Protocol):
    """vLLM's `MixtureOfExperts` interface (`vllm/model_executor/models/interfaces.py`)."""

    expert_weights: MutableSequence[Sequence[torch.Tensor]]
    num_moe_layers: int
    num_expert_groups: int
    num_logical_experts: int
    num_physical_experts: int
    num_local_physical_experts: int
    num_routed_experts: int
    num_shared_experts: int
    num_redundant_experts: int
    moe_layers: Iterable[nn.Module]

    def set_eplb_state(
        self,
        expert_load_view: torch.Tensor,  # [L, P]
        logical_to_physical_map: torch.Tensor,  # [L, N, R]
        logical_replica_count: torch.Tensor,  # [L, N]
    ) -> None:
        """Register the runtime's tensors with every MoE layer and fill
        `expert_weights` with each layer's stacked local expert tensors."""
        ...

    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        """Tell the model that the number of slots changed (elastic resize)."""
        ...


def is_mixture_of_experts(model: object) -> bool:
    """True when `model` implements the protocol and has at least one MoE layer."""
    return isinstance(model, MixtureOfExperts) and model.num_moe_layers > 0


MOE_MEMBERS = (
    "expert_weights", "num_moe_layers", "num_expert_groups", "num_logical_experts",
    "num_physical_experts", "num_local_physical_experts", "num_routed_experts",
    "num_shared_experts", "num_redundant_experts", "moe_layers", "set_eplb_state",
    "update_physical_experts_metadata",
)


def missing_members(model: object) -> list[str]:
    """Names of protocol members `model` lacks (for a clear error message)."""
    return [m for m in MOE_MEMBERS if not hasattr(model, m)]
