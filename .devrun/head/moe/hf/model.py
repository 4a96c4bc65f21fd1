"""`expert_parallel(model, ...)`: a loaded transformers MoE model made expert-parallel in
place, wrapped in an object that implements `MixtureOfExperts` and calls like the model."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from eplb.core.placement import Placement

from ..model import eplb_state_for
from ..state import EplbModelState, default_group
from .experts import (LOCAL_EXPERTS_ATTR, NUM_LOGICAL_ATTR, ExpertParallelExperts, find_experts_modules,
                      keep_local_slots, slot_experts, stacked_names)


def _config_value(config, *names, default=None):
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return value
    return default


def _num_shared_experts(config) -> int:
    """Shared experts per MoE layer, from the config (informational for the runtime)."""
    shared = _config_value(config, "n_shared_experts", "num_shared_experts")
    if shared is not None:
        return int(shared)
    return 1 if _config_value(config, "shared_expert_intermediate_size", default=0) else 0


class ExpertParallelModel(EplbModelState, nn.Module):
    """A transformers MoE model whose routed experts run over expert parallelism.

    Calls like the wrapped model (`forward`, `generate` and any other attribute are the
    model's), and implements `MixtureOfExperts` (vLLM's names) for `eplb.EplbRuntime`:
    `moe_layers` are the `ExpertParallelExperts` of every `*Experts` module, in model
    order, and `expert_weights[l]` lists layer l's stacked tensors, each [S, ...].
    At construction it registers maps of the start-up placement that it owns, so it runs
    on its own; a runtime replaces them through `set_eplb_state`. The MixtureOfExperts
    methods and their checks are `moe.state.EplbModelState`, shared with `moe.MoEModel`.
    Every rank of `group` must make the same calls (forwards exchange tokens).
    `group` None means torch's default group (`dist.group.WORLD`) when torch.distributed
    is initialised, else one process (`moe.state.default_group`).
    """

    def __init__(self, model: nn.Module, num_redundant_experts: int,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if isinstance(num_redundant_experts, bool) or not isinstance(num_redundant_experts, int) \
                or num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts: must be an int >= 0, got "
                             f"{num_redundant_experts!r}")
        self.model = model
        group = default_group(group)
        W = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        found = find_experts_modules(model)
        specs = [(name, module, *stacked_names(name, module)) for name, module in found]
        N = self._logical_experts(specs)
        P = N + num_redundant_experts
        if P % W:
            raise ValueError(f"num_redundant_experts: {N} experts + {num_redundant_experts} "
                             f"redundant = {P} slots do not split over {W} ranks; choose a "
                             f"count that makes N + redundant a multiple of {W}")
        S = P // W
        experts = slot_experts(N, P, rank, S)
        self.moe_layers: list[ExpertParallelExperts] = []
        for name, module, _, names in specs:
            done = getattr(module, LOCAL_EXPERTS_ATTR, None)
            if done is None:
                keep_local_slots(module, names, experts)
            elif list(done) != experts:
                raise ValueError(f"{name}: holds experts {done}, but rank {rank} of {W} with "
                                 f"{P} slots holds {experts} (slot p holds expert p mod N)")
            self.moe_layers.append(ExpertParallelExperts(name, module, names, N, P, group))

        text_config = model.config.get_text_config() if hasattr(model, "config") else None
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = int(_config_value(text_config, "n_group", default=1))
        self.num_logical_experts = N
        self.num_routed_experts = N
        self.num_shared_experts = _num_shared_experts(text_config)
        self.init_model_state(P, S, group)
        device = self.moe_layers[0].get_expert_weights()[0].device
        placement = Placement.initial(self.num_moe_layers, N, P, W)
        self.set_eplb_state(*eplb_state_for(placement, device))

    @staticmethod
    def _logical_experts(specs) -> int:
        """N, the same in every layer (a module already cut to its slots knows it from
        the experts it holds: its `num_experts` is then S)."""
        counts = set()
        for name, module, n, _ in specs:
            local = getattr(module, LOCAL_EXPERTS_ATTR, None)
            counts.add(getattr(module, NUM_LOGICAL_ATTR) if local is not None else n)
        if len(counts) != 1:
            raise ValueError(f"the *Experts modules have different expert counts {sorted(counts)}; "
                             "moe.hf needs the same count in every MoE layer")
        return counts.pop()

    # ---- calls like the wrapped model ------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

def expert_parallel(model: nn.Module, num_redundant_experts: int,
                    group: dist.ProcessGroup | None = None) -> ExpertParallelModel:
    """Make a loaded transformers MoE model expert-parallel over `group` in place.

    Every rank calls it on the same model. `group` None: torch's default group when
    torch.distributed is initialised, else one process (no communication). Each `*Experts` module keeps only this rank's
    S = (N + num_redundant_experts) / W slots of every stacked tensor (the full tensors
    are freed); slot p holds expert p mod N at start-up. Returns the
    `ExpertParallelModel` to call instead of `model` and to hand to `eplb.EplbRuntime`.
    """
    return ExpertParallelModel(model, num_redundant_experts, group)
