"""MoEModel: a stack of expert-parallel MoE blocks implementing the MixtureOfExperts protocol."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from eplb.core.placement import Placement
from eplb.protocol import replica_cdf

from .args import MoEArgs
from .layer import MoEBlock, MoELayer, RMSNorm
from .state import EplbModelState, default_group
from .weights import write_expert_slots


def eplb_state_for(
    placement: Placement, device: torch.device | str = "cpu", max_replicas: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh protocol tensors for a placement: (expert_load_view [L, P] int64 zeros,
    logical_to_physical_map [L, N, R] int64 -1 padded, logical_replica_count [L, N] int64)."""
    load = torch.zeros(placement.num_layers, placement.num_slots, dtype=torch.int64, device=device)
    l2p = torch.from_numpy(placement.logical_to_physical(max_replicas)).to(device)
    count = torch.from_numpy(placement.replica_count()).to(device)
    return load, l2p, count


def replica_cdf_for(
    placement: Placement, device: torch.device | str = "cpu", max_replicas: int | None = None
) -> torch.Tensor:
    """`logical_replica_cdf [L, N, R]` float32 of a placement (its shares; even when it
    has none), R as `eplb_state_for(placement, max_replicas)`."""
    R = placement.max_replicas if max_replicas is None else max_replicas
    cdf = replica_cdf(placement.replica_shares(R), placement.replica_count())
    return torch.from_numpy(cdf).to(device)


class MoEModel(EplbModelState, nn.Module):
    """L pre-norm residual MoE blocks, h = h + moe(rmsnorm(h)), over expert parallelism.

    `group` is the EP process group; None means torch's default group
    (`dist.group.WORLD`) when torch.distributed is initialised, else a single process
    holding all P slots (no communication; `moe.state.default_group`). Rank r of the
    group holds slots [r*S, (r+1)*S) of every layer, S = P / group size. At construction
    each rank fills its slots according to `Placement.initial` (slot p holds expert
    p % N) and registers maps of that placement that the model owns, so it runs on its
    own; a runtime replaces them through `set_eplb_state`. Everything runs without
    autograd (the parameters need no grad).

    MixtureOfExperts members (vLLM's names): expert_weights, num_moe_layers,
    num_expert_groups, num_logical_experts, num_physical_experts,
    num_local_physical_experts, num_routed_experts, num_shared_experts,
    num_redundant_experts, moe_layers, set_eplb_state, update_physical_experts_metadata
    (the methods and their checks are `moe.state.EplbModelState`, shared with moe.hf).
    Optional extension (weighted replicas): set_eplb_replica_weights.
    """

    def __init__(self, args: MoEArgs, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        group = default_group(group)
        ep_size = dist.get_world_size(group) if group is not None else 1
        ep_rank = dist.get_rank(group) if group is not None else 0
        args.validate(ep_size)
        self.args = args
        self.device = torch.device(device)
        L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
        S = P // ep_size

        self.num_moe_layers = L
        self.num_expert_groups = args.num_expert_groups
        self.num_logical_experts = N
        self.num_routed_experts = N
        self.num_shared_experts = args.num_shared_experts
        self.init_model_state(P, S, group)

        self.layers = nn.ModuleList(
            MoEBlock(RMSNorm(args, i, device), MoELayer(args, i, S, group, device))
            for i in range(L)
        )
        self.moe_layers: list[MoELayer] = [block.moe for block in self.layers]

        placement = Placement.initial(L, N, P, ep_size)
        first = ep_rank * S
        for i, layer in enumerate(self.moe_layers):
            w13, w2 = layer.get_expert_weights()
            write_expert_slots(w13, w2, args, i, placement.physical_to_logical[i, first:first + S])

        self.set_eplb_state(*eplb_state_for(placement, self.device))

    # ---- workload knobs ----------------------------------------------------------
    @torch.no_grad()
    def set_routing_bias(self, bias: torch.Tensor) -> None:
        """Write bias [L, N] into every router's `selection_bias` in place."""
        if tuple(bias.shape) != (self.num_moe_layers, self.num_logical_experts):
            raise ValueError(f"bias: shape {tuple(bias.shape)} != "
                             f"({self.num_moe_layers}, {self.num_logical_experts})")
        for i, layer in enumerate(self.moe_layers):
            layer.router.selection_bias.copy_(bias[i])

    # ---- forward -----------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] in args.dtype -> [T, H]. Every EP rank must call it (collectives)."""
        h = x
        for block in self.layers:
            h = block(h)
        return h
