"""One MoE layer (router -> dispatch -> routed experts -> combine, plus shared experts),
the RMSNorm before it and the residual block around both."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .args import MoEArgs
from .dispatch import combine, count_slots, dispatch, weighted_sum
from .experts import GroupedExperts, SharedExperts
from .router import Router
from .state import EplbLayerState
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


class MoELayer(EplbLayerState, nn.Module):
    """Routed experts over expert parallelism plus the shared experts.

    Holds S = num_local_physical_experts slots (`experts.w13 [S, 2I, H]`,
    `experts.w2 [S, H, I]`); slot p of the layer lives on EP rank p // S. Routing state
    (row views of the runtime's tensors, weighted replicas) is `moe.state.EplbLayerState`.

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
        self.router = Router(args, layer, device)
        self.experts = GroupedExperts(num_local_slots, args.hidden_size, args.intermediate_size,
                                      args.dtype, device)
        self.shared_experts = (SharedExperts(args, layer, device)
                               if args.num_shared_experts > 0 else None)
        self.init_eplb_state(f"MoE layer {layer}", args.num_experts, args.num_physical_experts,
                             num_local_slots, group, args.dispatch_mode)

    # ---- EplbLayerState ----------------------------------------------------------
    def get_expert_weights(self) -> Sequence[torch.Tensor]:
        """[w13 [S, 2I, H], w2 [S, H, I]]: the parameters themselves (same storage)."""
        return [self.experts.w13, self.experts.w2]

    def replace_slots(self, num_local_slots: int) -> None:
        """Fresh zero `w13 [S, 2I, H]`, `w2 [S, H, I]` for S = num_local_slots."""
        e = self.experts
        e.w13 = nn.Parameter(e.w13.new_zeros((num_local_slots, *e.w13.shape[1:])),
                             requires_grad=False)
        e.w2 = nn.Parameter(e.w2.new_zeros((num_local_slots, *e.w2.shape[1:])),
                            requires_grad=False)

    # ---- forward -----------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (already normed) -> routed + shared expert output [T, H]."""
        self.begin_forward(x.shape[0], x.device)
        topk_ids, topk_weights = self.router(x)  # [T, K], [T, K]
        physical_ids = self.route(topk_ids)  # [T, K]
        slot_counts = count_slots(physical_ids, self.num_physical_experts)  # [P]
        if self.record_load:
            self.expert_load_view.add_(slot_counts.to(self.expert_load_view.dtype))
        x_local, counts, counts_host, state = dispatch(x, physical_ids,
                                                       self.num_local_physical_experts,
                                                       self.group, slot_counts, self.dispatch_mode)
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
