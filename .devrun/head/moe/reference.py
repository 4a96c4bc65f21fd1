"""DenseMoEModel: the single-process oracle. Same function as MoEModel, no placement,
no dispatch: every logical expert's weights [N, ...] held at once, tokens grouped by
logical expert directly."""
from __future__ import annotations

import torch
from torch import nn

from .args import MoEArgs
from .dispatch import weighted_sum
from .experts import SharedExperts, swiglu
from .layer import MoEBlock, RMSNorm
from .router import Router
from .weights import expert_weights_for


class DenseExperts(nn.Module):
    """All N logical experts of a layer: w13 [N, 2I, H], w2 [N, H, I]."""

    def __init__(self, args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        pairs = [expert_weights_for(args, layer, e, device) for e in range(args.num_experts)]
        self.w13 = nn.Parameter(torch.stack([p[0] for p in pairs]), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack([p[1] for p in pairs]), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, K] logical -> expert outputs [T, K, H]."""
        T, K = topk_ids.shape
        flat = topk_ids.reshape(-1)  # [T*K]
        out = x.new_zeros(T * K, x.shape[1])  # [T*K, H]
        for e in range(self.w13.shape[0]):
            pos = (flat == e).nonzero().squeeze(1)  # [n_e] positions that chose e
            if pos.numel():
                out[pos] = swiglu(x[pos // K], self.w13[e], self.w2[e])
        return out.view(T, K, -1)


class DenseMoELayer(nn.Module):
    """Router + dense routed experts + shared experts; counts logical load [N]."""

    def __init__(self, args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.router = Router(args, layer, device)
        self.experts = DenseExperts(args, layer, device)
        self.shared_experts = (SharedExperts(args, layer, device)
                               if args.num_shared_experts > 0 else None)
        self.logical_load = torch.zeros(args.num_experts, dtype=torch.int64, device=device)  # [N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]."""
        topk_ids, topk_weights = self.router(x)  # [T, K], [T, K]
        self.logical_load += torch.bincount(topk_ids.reshape(-1),
                                            minlength=self.logical_load.shape[0])
        out = weighted_sum(self.experts(x, topk_ids), topk_weights)  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DenseMoEModel(nn.Module):
    """Oracle for MoEModel: same args -> same parameters and the same function.

    `logical_load [L, N]` accumulates the tokens each logical expert received over all
    forwards (`reset_load()` zeroes it), for comparison with the EP model's physical load.
    """

    def __init__(self, args: MoEArgs, device: torch.device | str = "cpu") -> None:
        super().__init__()
        args.validate(1)
        self.args = args
        self.layers = nn.ModuleList(
            MoEBlock(RMSNorm(args, i, device), DenseMoELayer(args, i, device))
            for i in range(args.num_layers)
        )

    @property
    def logical_load(self) -> torch.Tensor:  # [L, N]
        return torch.stack([block.moe.logical_load for block in self.layers])

    def reset_load(self) -> None:
        for block in self.layers:
            block.moe.logical_load.zero_()

    @torch.no_grad()
    def set_routing_bias(self, bias: torch.Tensor) -> None:
        """Write bias [L, N] into every router's `selection_bias` in place."""
        for i, block in enumerate(self.layers):
            block.moe.router.selection_bias.copy_(bias[i])

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        h = x
        for block in self.layers:
            h = block(h)
        return h
