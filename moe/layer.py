"""One MoE layer (router -> dispatch -> routed experts -> combine, plus shared experts),
the RMSNorm before it and the residual block around both."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .args import MoEArgs
from .dispatch import (SlotTable, check_same_tokens, combine, count_slots, dispatch,
                       weighted_sum)
from .ep_guard import enter_forward
from .experts import GroupedExperts, SharedExperts
from .router import Router
from .state import check_replica_cdf, check_state_rows
from .weights import norm_weight_for


class RMSNorm(nn.Module):
    """x [T, H] -> x / rms(x) * weight, the statistics in float32."""

    def __init__(self, args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = args.norm_eps
        self.weight = nn.Parameter(norm_weight_for(args, layer, device), requires_grad=False)  # [H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class MoELayer(nn.Module):
    """Routed experts over expert parallelism plus the shared experts.

    Holds S = num_local_physical_experts slots (`experts.w13 [S, 2I, H]`,
    `experts.w2 [S, H, I]`); slot p of the layer lives on EP rank p // S. Routing state
    comes from the runtime through `set_eplb_state` as row views:
    `expert_load_view [P]`, `logical_to_physical_map [N, R]`, `logical_replica_count [N]`.
    The layer only ever reads the maps and adds into the load view, so the runtime may
    rewrite all three (and the expert weights) in place between forwards.
    Weighted replicas (optional, `set_eplb_replica_weights`): a row view
    `logical_replica_cdf [N, R]` makes the replica choice follow the replica shares;
    without one, tokens split evenly over an expert's replicas.

    Load recording adds the per-slot histogram dispatch needs anyway into the load view
    (one [P] add, no host sync). With no EP group, or with `dispatch_mode="fixed"` once a
    batch size has been seen, the forward has no host sync and can be captured in a CUDA
    graph (bf16 on CUDA, where the experts run `torch._grouped_mm`); replays see in-place
    map and weight updates, since only the contents of the registered tensors change.
    """

    def __init__(self, args: MoEArgs, layer: int, num_local_slots: int,
                 group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.layer_idx = layer
        self.group = group
        self.num_logical_experts = args.num_experts
        self.num_local_physical_experts = num_local_slots
        self.num_physical_experts = args.num_physical_experts
        self.router = Router(args, layer, device)
        self.experts = GroupedExperts(num_local_slots, args.hidden_size, args.intermediate_size,
                                      args.dtype, device)
        self.shared_experts = (SharedExperts(args, layer, device)
                               if args.num_shared_experts > 0 else None)
        self.record_load = True  # False: route without counting (warm-up, dummy batches)
        self.dispatch_mode = args.dispatch_mode  # "exact" | "fixed" (moe.dispatch)
        self._fixed_checked: tuple | None = None  # "fixed": (T, group) checked equal on all ranks
        self.moe_layer_idx: int | None = None
        self.expert_load_view: torch.Tensor | None = None  # [P]
        self.logical_to_physical_map: torch.Tensor | None = None  # [N, R]
        self.logical_replica_count: torch.Tensor | None = None  # [N]
        self.logical_replica_cdf: torch.Tensor | None = None  # [N, R] float32, None = even
        self._slots = SlotTable()  # map_to_physical as one gather while the maps stand

    # ---- MoELayerProtocol --------------------------------------------------------
    def get_expert_weights(self) -> Sequence[torch.Tensor]:
        """[w13 [S, 2I, H], w2 [S, H, I]]: the parameters themselves (same storage)."""
        return [self.experts.w13, self.experts.w2]

    def set_eplb_state(self, moe_layer_idx: int, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        """Keep row `moe_layer_idx` of the runtime's [L, P], [L, N, R] and [L, N] tensors.
        Drops any registered replica weights: they belong to the maps they came with."""
        check_state_rows(moe_layer_idx, expert_load_view, logical_to_physical_map,
                         logical_replica_count, self.num_physical_experts,
                         self.num_logical_experts, self.experts.w13.device,
                         f"MoE layer {self.layer_idx}")
        self.moe_layer_idx = moe_layer_idx
        self.expert_load_view = expert_load_view[moe_layer_idx]
        self.logical_to_physical_map = logical_to_physical_map[moe_layer_idx]
        self.logical_replica_count = logical_replica_count[moe_layer_idx]
        self.logical_replica_cdf = None

    def set_eplb_replica_weights(self, moe_layer_idx: int,
                                 logical_replica_cdf: torch.Tensor | None) -> None:
        """Keep row `moe_layer_idx` of the runtime's `logical_replica_cdf [L, N, R]`
        (float, R as the registered `logical_to_physical_map`); None: split evenly again."""
        if logical_replica_cdf is None:
            self.logical_replica_cdf = None
            return
        if self.logical_to_physical_map is None or moe_layer_idx != self.moe_layer_idx:
            raise RuntimeError("MoELayer: call set_eplb_state before set_eplb_replica_weights "
                               "(with the same moe_layer_idx)")
        check_replica_cdf(moe_layer_idx, logical_replica_cdf, self.num_logical_experts,
                          self.logical_to_physical_map.shape[-1], self.experts.w13.device)
        self.logical_replica_cdf = logical_replica_cdf[moe_layer_idx]

    # ---- forward -----------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (already normed) -> routed + shared expert output [T, H]."""
        if self.logical_to_physical_map is None:
            raise RuntimeError("MoELayer: set_eplb_state was never called")
        S = self.num_local_physical_experts
        world = dist.get_world_size(self.group) if self.group is not None else 1
        if world * S != self.num_physical_experts:
            raise RuntimeError(f"{world} ranks x {S} local slots != {self.num_physical_experts} "
                               "physical experts; the runtime must resize the layer first")
        enter_forward(self)  # counts forwards, names this layer in a collective's error
        if self.dispatch_mode == "fixed" and world > 1:
            self._fixed_checked = check_same_tokens(x.shape[0], x.device, self.group,
                                                    self._fixed_checked)
        topk_ids, topk_weights = self.router(x)  # [T, K], [T, K]
        physical_ids = self._slots(topk_ids, self.logical_to_physical_map,
                                   self.logical_replica_count, self.logical_replica_cdf)  # [T, K]
        slot_counts = count_slots(physical_ids, self.num_physical_experts)  # [P]
        if self.record_load:
            self.expert_load_view.add_(slot_counts.to(self.expert_load_view.dtype))
        x_local, counts, counts_host, state = dispatch(x, physical_ids, S, self.group,
                                                       slot_counts, self.dispatch_mode)
        y_local = self.experts(x_local, counts, counts_host)  # [T_r, H]
        out = weighted_sum(combine(y_local, state, self.group), topk_weights)  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class MoEBlock(nn.Module):
    """Pre-norm residual block: h -> h + moe(norm(h))."""

    def __init__(self, norm: nn.Module, moe: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.moe = moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> [T, H]."""
        return h + self.moe(self.norm(h))
