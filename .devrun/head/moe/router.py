"""Router: token -> top-k logical experts and their gate weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import MoEArgs
from .weights import router_weight_for


class Router(nn.Module):
    """Token-choice top-k router with optional group-limited selection (DeepSeek-V3).

    Scores are softmax or sigmoid of `x @ weight.T`, computed in float32.
    `selection_bias [N]` is added to the scores for *choosing* experts only (like
    DeepSeek-V3's `e_score_correction_bias`); gate weights always come from the
    unbiased scores. The buffer is written in place (demo workloads use it to skew
    or drift the routing; see `MoEModel.set_routing_bias`).

    Group-limited top-k (num_expert_groups G > 1): the N experts form G groups of N/G;
    a group's score is the sum of its top-2 biased scores (its best score when a group
    holds one expert); only the `topk_groups` best groups stay eligible per token.
    """

    def __init__(self, args: MoEArgs, layer: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.num_groups = args.num_expert_groups
        self.topk_groups = args.topk_groups
        self.score_func = args.score_func
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = nn.Parameter(router_weight_for(args, layer, device), requires_grad=False)  # [N, H]
        self.register_buffer(
            "selection_bias", torch.zeros(args.num_experts, dtype=torch.float32, device=device)
        )  # [N]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> unbiased routing scores [T, N] float32."""
        logits = F.linear(x.float(), self.weight)  # [T, N]
        if self.score_func == "softmax":
            return logits.softmax(dim=-1)
        return logits.sigmoid()

    def _mask_to_top_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """biased scores [T, N] -> same with experts outside the kept groups at -inf."""
        T = biased.shape[0]
        grouped = biased.view(T, self.num_groups, -1)  # [T, G, N/G]
        per_group = min(2, grouped.shape[-1])
        group_scores = grouped.topk(per_group, dim=-1).values.sum(-1)  # [T, G]
        keep = group_scores.topk(self.topk_groups, dim=-1).indices  # [T, topk_groups]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
        return grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(T, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, K] int64 logical expert ids,
                        topk_weights [T, K] float32 gate weights)."""
        scores = self.scores(x)  # [T, N]
        biased = scores + self.selection_bias  # [T, N] for selection only
        if self.num_groups > 1:
            biased = self._mask_to_top_groups(biased)
        topk_ids = biased.topk(self.top_k, dim=-1).indices  # [T, K]
        topk_weights = scores.gather(1, topk_ids)  # [T, K]
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights
