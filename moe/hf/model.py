"""`expert_parallel(model, ...)`: a loaded transformers MoE model made expert-parallel in
place, wrapped in an object that implements `MixtureOfExperts` and calls like the model."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from eplb.core.placement import Placement

from ..ep_guard import set_forward_counter
from ..model import eplb_state_for
from ..state import check_num_layers, default_group
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


class ExpertParallelModel(nn.Module):
    """A transformers MoE model whose routed experts run over expert parallelism.

    Calls like the wrapped model (`forward`, `generate` and any other attribute are the
    model's), and implements `MixtureOfExperts` (vLLM's names) for `eplb.EplbRuntime`:
    `moe_layers` are the `ExpertParallelExperts` of every `*Experts` module, in model
    order, and `expert_weights[l]` lists layer l's stacked tensors, each [S, ...].
    At construction it registers maps of the start-up placement that it owns, so it runs
    on its own; a runtime replaces them through `set_eplb_state`.
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
        self.group = group = default_group(group)
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
        self.num_physical_experts = P
        self.num_local_physical_experts = S
        self.num_redundant_experts = num_redundant_experts
        self.ep_size, self.ep_rank = W, rank
        self.expert_weights: list[list[torch.Tensor]] = []
        self.expert_load_view: torch.Tensor  # [L, P]
        self.logical_to_physical_map: torch.Tensor  # [L, N, R]
        self.logical_replica_count: torch.Tensor  # [L, N]
        self.logical_replica_cdf: torch.Tensor | None = None  # [L, N, R] float32
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

    # ---- MixtureOfExperts --------------------------------------------------------
    def set_eplb_state(self, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        """Register row views of the runtime's expert_load_view [L, P],
        logical_to_physical_map [L, N, R] and logical_replica_count [L, N] with every
        layer and refill `expert_weights` (same list object)."""
        check_num_layers(self.num_moe_layers, expert_load_view=expert_load_view,
                         logical_to_physical_map=logical_to_physical_map,
                         logical_replica_count=logical_replica_count)
        for i, layer in enumerate(self.moe_layers):
            layer.set_eplb_state(i, expert_load_view, logical_to_physical_map,
                                 logical_replica_count)
        self.expert_load_view = expert_load_view
        self.logical_to_physical_map = logical_to_physical_map
        self.logical_replica_count = logical_replica_count
        self.logical_replica_cdf = None
        self.expert_weights[:] = [layer.get_expert_weights() for layer in self.moe_layers]

    def set_eplb_replica_weights(self, logical_replica_cdf: torch.Tensor | None) -> None:
        """Register row views of `logical_replica_cdf [L, N, R]` (weighted replicas);
        None: split every expert's tokens evenly over its replicas."""
        for i, layer in enumerate(self.moe_layers):
            layer.set_eplb_replica_weights(i, logical_replica_cdf)
        self.logical_replica_cdf = logical_replica_cdf

    def update_physical_experts_metadata(self, num_physical_experts: int,
                                         num_local_physical_experts: int, *,
                                         reallocate: bool = False) -> None:
        """Elastic resize (`eplb.runtime.resize`): when S changes (or `reallocate`), every layer
        gets fresh zero [S, ...] stacked tensors for the caller to fill; when P or the
        storage changes the layers drop their routing state until `set_eplb_state`."""
        P, S = num_physical_experts, num_local_physical_experts
        if P < self.num_logical_experts or S < 1 or P % S:
            raise ValueError(f"num_physical_experts: {P} must be a multiple of "
                             f"num_local_physical_experts ({S}) and >= num_logical_experts "
                             f"({self.num_logical_experts})")
        reallocate = bool(reallocate) or S != self.num_local_physical_experts
        changed = reallocate or P != self.num_physical_experts
        for layer in self.moe_layers:
            module = layer.module
            if reallocate:
                for n, t in zip(layer.names, layer.get_expert_weights()):
                    fresh = t.new_zeros((S, *t.shape[1:]))
                    if n in module._parameters:
                        module._parameters[n] = nn.Parameter(fresh, requires_grad=False)
                    else:
                        module._buffers[n] = fresh
                module.num_experts = S
            layer.num_physical_experts = P
            layer.num_local_physical_experts = S
            if changed:
                layer.expert_load_view = layer.logical_to_physical_map = None
                layer.logical_replica_count = layer.logical_replica_cdf = None
        self.num_physical_experts = P
        self.num_local_physical_experts = S
        self.num_redundant_experts = P - self.num_logical_experts
        self.expert_weights[:] = [layer.get_expert_weights() for layer in self.moe_layers]

    def set_expert_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """Make `group` the EP group (after `update_physical_experts_metadata`)."""
        size = dist.get_world_size(group) if group is not None else 1
        if size * self.num_local_physical_experts != self.num_physical_experts:
            raise ValueError(f"group: {size} ranks x {self.num_local_physical_experts} local "
                             f"slots != num_physical_experts ({self.num_physical_experts})")
        self.group, self.ep_size = group, size
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        for layer in self.moe_layers:
            layer.group = group

    def release_expert_slots(self) -> None:
        """Leave expert parallelism (a rank a resize shrinks away): every layer's stacked
        tensors become empty [0, ...], the group and routing state are dropped, so a
        forward raises until a resize gives this rank slots again."""
        for layer in self.moe_layers:
            module = layer.module
            for n, t in zip(layer.names, layer.get_expert_weights()):
                empty = t.new_zeros((0, *t.shape[1:]))
                if n in module._parameters:
                    module._parameters[n] = nn.Parameter(empty, requires_grad=False)
                else:
                    module._buffers[n] = empty
            module.num_experts = 0
            layer.group = None
            layer.num_local_physical_experts = 0
            layer.expert_load_view = layer.logical_to_physical_map = None
            layer.logical_replica_count = layer.logical_replica_cdf = None
        self.expert_weights[:] = [layer.get_expert_weights() for layer in self.moe_layers]
        self.group, self.ep_size, self.ep_rank = None, 1, 0
        self.num_local_physical_experts = 0

    def set_eplb_forward_counter(self, counter) -> None:
        """Optional extension: count forwards into the runtime's
        `eplb.protocol.ForwardCounter` (the first MoE layer calls `counter.forward`)."""
        set_forward_counter(self.moe_layers, counter)

    # ---- knobs -------------------------------------------------------------------
    def set_record_load(self, enabled: bool) -> None:
        """Turn load counting on or off in every layer (e.g. off for warm-up batches)."""
        for layer in self.moe_layers:
            layer.record_load = enabled

    def set_dispatch_mode(self, mode: str) -> None:
        """How tokens cross ranks (W > 1; see `moe.dispatch`): "exact" (the default) sends
        exactly the rows each rank needs and reads the split sizes on the host once per
        layer; "fixed" exchanges equal blocks of T*K rows, with no host sync, for decode
        (every rank must then pass the same number of tokens: checked with one
        all-reduce whenever T changes). Every rank must set the same mode."""
        if mode not in ("exact", "fixed"):
            raise ValueError(f"mode: {mode!r} is not 'exact' or 'fixed'")
        for layer in self.moe_layers:
            layer.dispatch_mode = mode


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
