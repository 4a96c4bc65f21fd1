"""Checks on the runtime's tensors a model registers (`set_eplb_state`,
`set_eplb_replica_weights`), shared by the reference `MoELayer` and `moe.hf`'s
`ExpertParallelExperts`, so both refuse the same mistakes with the same words."""
from __future__ import annotations

import torch
import torch.distributed as dist


def check_num_layers(num_moe_layers: int, **tensors: torch.Tensor | None) -> None:
    """Every given tensor's dim 0 is L = num_moe_layers (None: not registered)."""
    for name, t in tensors.items():
        if t is not None and t.shape[0] != num_moe_layers:
            raise ValueError(f"{name}: first dim {t.shape[0]} != num_moe_layers ({num_moe_layers})")


def check_state_rows(moe_layer_idx: int, expert_load_view: torch.Tensor,
                     logical_to_physical_map: torch.Tensor, logical_replica_count: torch.Tensor,
                     num_slots: int, num_experts: int, device: torch.device, owner: str) -> None:
    """expert_load_view [L, P], logical_to_physical_map [L, N, R], logical_replica_count
    [L, N]: right shapes for layer `moe_layer_idx`, on `device` (where `owner`'s expert
    weights are), integer dtypes."""
    P, N = num_slots, num_experts
    for name, t, ndim, width in (("expert_load_view", expert_load_view, 2, P),
                                 ("logical_to_physical_map", logical_to_physical_map, 3, N),
                                 ("logical_replica_count", logical_replica_count, 2, N)):
        if t.dim() != ndim or t.shape[1] != width or not 0 <= moe_layer_idx < t.shape[0]:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not fit layer "
                             f"{moe_layer_idx} with P={P}, N={N}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, the weights of {owner} on {device}")
        if t.dtype.is_floating_point:
            raise ValueError(f"{name}: needs an integer dtype, got {t.dtype}")


def check_replica_cdf(moe_layer_idx: int, logical_replica_cdf: torch.Tensor, num_experts: int,
                      max_replicas: int, device: torch.device) -> None:
    """logical_replica_cdf [L, N, R]: right shape for layer `moe_layer_idx`, on `device`,
    a floating dtype."""
    t, N, R = logical_replica_cdf, num_experts, max_replicas
    if t.dim() != 3 or t.shape[1:] != (N, R) or not 0 <= moe_layer_idx < t.shape[0]:
        raise ValueError(f"logical_replica_cdf: shape {tuple(t.shape)} does not fit layer "
                         f"{moe_layer_idx} with N={N}, R={R}")
    if t.device != device:
        raise ValueError(f"logical_replica_cdf: on {t.device}, the layer's weights on {device}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"logical_replica_cdf: needs a floating dtype, got {t.dtype}")


def default_group(group):
    """The EP group a model uses for `group`: torch's convention, None means the default
    process group (`dist.group.WORLD`) when torch.distributed is initialised, and one
    process (no communication) when it is not. For one process inside an initialised
    job, pass a group of one rank (`dist.new_group([rank], use_local_synchronization=True)`)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group
