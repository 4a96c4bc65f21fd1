"""Expert MLPs: the SwiGLU function, the dense shared experts and the stacked routed slots."""
from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .args import MoEArgs
from .weights import shared_expert_weights_for

log = logging.getLogger(__name__)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: x [T, H], w13 [2I, H] (gate rows then up rows), w2 [H, I] -> [T, H].

    down(silu(gate(x)) * up(x)).
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [T, I] each
    return F.linear(F.silu(gate) * up, w2)  # [T, H]


class SharedExperts(nn.Module):
    """The layer's shared experts, fused into one dense SwiGLU MLP every token passes."""

    def __init__(self, args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        w13, w2 = shared_expert_weights_for(args, layer, device)
        self.w13 = nn.Parameter(w13, requires_grad=False)  # [2Is, H]
        self.w2 = nn.Parameter(w2, requires_grad=False)  # [H, Is]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return swiglu(x, self.w13, self.w2)


class GroupedExperts(nn.Module):
    """The S physical expert slots this rank holds, stacked: w13 [S, 2I, H], w2 [S, H, I].

    These two parameters are what the runtime sees (`get_expert_weights`) and rewrites
    in place when it moves experts; nothing here caches anything derived from them.
    Inputs arrive sorted by local slot with `counts [S]` tokens per slot.

    Two paths compute the same function:
      * a per-slot loop (readable reference; needs the counts on the host),
      * `torch._grouped_mm` on CUDA with bf16 weights when the op exists and the sizes
        suit it; no host sync. If the op refuses the inputs it is switched off for this
        module with a warning and the loop runs instead.
    """

    def __init__(self, num_slots: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        S, H, I = num_slots, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.zeros(S, 2 * I, H, dtype=dtype, device=device),
                                requires_grad=False)  # [S, 2I, H]
        self.w2 = nn.Parameter(torch.zeros(S, H, I, dtype=dtype, device=device),
                               requires_grad=False)  # [S, H, I]
        self.use_grouped_mm = True  # set False to force the loop path

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]

    def grouped_mm_applies(self, x: torch.Tensor) -> bool:
        H, I = self.w2.shape[1], self.w2.shape[2]
        return (self.use_grouped_mm and hasattr(torch, "_grouped_mm") and x.is_cuda
                and x.dtype == torch.bfloat16 and self.w13.dtype == torch.bfloat16
                and H % 8 == 0 and I % 8 == 0)

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                counts_host: Sequence[int] | None = None) -> torch.Tensor:
        """x [T', H] sorted by slot, counts [S] int64 tokens per slot (on x's device),
        counts_host: the same counts as ints if already known -> [T', H]."""
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if self.grouped_mm_applies(x):
            try:
                return self.forward_grouped_mm(x, counts)
            except RuntimeError as e:  # unsupported GPU / sizes: fall back for good
                log.warning("torch._grouped_mm unavailable (%s); using the per-slot loop", e)
                self.use_grouped_mm = False
        if counts_host is None:
            counts_host = counts.tolist()  # host sync, loop path only
        return self.forward_loop(x, counts_host)

    def forward_loop(self, x: torch.Tensor, counts_host: Sequence[int]) -> torch.Tensor:
        """Reference path: x [T', H] sorted by slot, counts_host [S] ints -> [T', H]."""
        out = torch.empty_like(x)  # [T', H]
        start = 0
        for s, n in enumerate(counts_host):
            if n:
                out[start:start + n] = swiglu(x[start:start + n], self.w13[s], self.w2[s])
            start += n
        return out

    def forward_grouped_mm(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Fast path: x [T', H] bf16 on CUDA sorted by slot, counts [S] -> [T', H]."""
        offs = counts.cumsum(0).to(torch.int32)  # [S] end offset of each slot's rows
        gate_up = torch._grouped_mm(x, self.w13.transpose(-2, -1), offs=offs)  # [T', 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up  # [T', I]
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)  # [T', H]
