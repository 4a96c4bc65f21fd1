"""One transformers `*Experts` module made expert-parallel: its stacked parameters cut
down to this rank's slots, its forward routed through this project's dispatch.

transformers (5.x) MoE models keep a layer's routed experts in one module whose
parameters are stacked on dim 0 (the expert) and which is called as
`experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`.
The router, gating, shared experts and activation stay the model's own: only that call
changes. `ExpertParallelExperts` replaces it with

    logical ids -> replica slots (`map_to_physical`) -> count load into the load view
    -> all-to-all to the owning ranks (`dispatch`) -> the experts on the local slots'
    rows, already sorted by slot (`SortedExperts`, the module's "grouped_mm" math without
    a second sort; any other experts implementation: the module's own forward, one
    (token, k) copy per row with weight 1) -> all-to-all back (`combine`) -> gate-weighted
    sum over k, computed as transformers' own forward does (same dtype promotion).

One process: no exchange; the module's own forward runs on the replica slot ids.

Start-up layout (as `eplb.Placement.initial`): slot p holds expert p mod N and rank r
holds slots [r*S, (r+1)*S), so the same slots hold the same experts in every layer.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..dispatch import combine, count_slots, dispatch, record_load
from ..state import EplbLayerState
from .grouped import SortedExperts, _slot_of_rows, sorted_rows_apply

LOCAL_EXPERTS_ATTR = "_eplb_local_experts"  # set on a module whose slots are already cut:
NUM_LOGICAL_ATTR = "_eplb_num_logical_experts"  # its logical experts (slot order) and N


def is_experts_module(module: nn.Module) -> bool:
    """A transformers routed-experts module: class name ending in "Experts" (the naming
    transformers 5 uses for its stacked-expert modules, e.g. `Qwen3MoeExperts`), except
    "SharedExperts" (always-on experts every token passes through, not routed)."""
    name = type(module).__name__
    return name.endswith("Experts") and not name.endswith("SharedExperts")


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every `*Experts` module, in model order (outermost
    only). Raises ValueError when there is none."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if is_experts_module(module) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if not found:
        raise ValueError(f"{type(model).__name__}: no transformers `*Experts` module found; "
                         "moe.hf needs the transformers 5 MoE layout (one module per layer "
                         "with parameters stacked on dim 0, called as "
                         "experts(hidden_states, top_k_index, top_k_weights))")
    return found


def stacked_names(name: str, module: nn.Module) -> tuple[int, list[str]]:
    """(N, names of the module's stacked tensors): its parameters and buffers whose dim 0
    is `module.num_experts`. Raises ValueError naming the module and what is missing."""
    kind = type(module).__name__
    N = getattr(module, "num_experts", None)
    if not isinstance(N, int) or N < 1:
        raise ValueError(f"{name} ({kind}): has no integer `num_experts` attribute; "
                         "moe.hf needs it to know the stacked expert dimension")
    params = inspect.signature(type(module).forward).parameters
    if len(params) < 4:  # self, hidden_states, top_k_index, top_k_weights
        raise ValueError(f"{name} ({kind}): forward takes {list(params)[1:]}; moe.hf needs "
                         "forward(hidden_states, top_k_index, top_k_weights)")
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    stacked = [n for n, t in tensors if t is not None and t.dim() >= 1 and t.shape[0] == N]
    other = [f"{n} {tuple(t.shape)}" for n, t in tensors if t is not None and n not in stacked]
    if not stacked:
        raise ValueError(f"{name} ({kind}): no parameter has dim 0 = num_experts ({N}); "
                         "moe.hf needs the experts' weights stacked on dim 0")
    if other:
        raise ValueError(f"{name} ({kind}): tensors {', '.join(other)} are not stacked on "
                         f"dim 0 = num_experts ({N}); moe.hf cannot split them over ranks")
    return N, stacked


def slot_experts(num_experts: int, num_slots: int, rank: int, num_local_slots: int) -> list[int]:
    """Logical expert of each of rank `rank`'s slots in the start-up layout: slot p holds
    expert p mod N, rank r holds slots [r*S, (r+1)*S)."""
    first = rank * num_local_slots
    return [p % num_experts for p in range(first, first + num_local_slots)]


@torch.no_grad()
def keep_local_slots(module: nn.Module, names: Sequence[str], experts: Sequence[int]) -> None:
    """Replace each stacked tensor [N, ...] by a fresh [S, ...] tensor holding rows
    `experts` (the full tensor is dropped, so its memory is freed once nothing else holds
    it) and set `module.num_experts = S`, so the module's own forward indexes local slots."""
    index = torch.tensor(list(experts), dtype=torch.long)
    for n in names:
        if n in module._parameters:
            old = module._parameters[n]
            module._parameters[n] = nn.Parameter(old.data[index.to(old.device)].clone(),
                                                 requires_grad=False)
        else:
            old = module._buffers[n]
            module._buffers[n] = old[index.to(old.device)].clone()
    setattr(module, NUM_LOGICAL_ATTR, module.num_experts)
    setattr(module, LOCAL_EXPERTS_ATTR, list(experts))
    module.num_experts = len(experts)


class ExpertParallelExperts(EplbLayerState):
    """The runtime's view of one MoE layer (`eplb.protocol.MoELayerProtocol`) and the
    expert-parallel forward installed on the transformers `*Experts` module.

    `module`'s stacked tensors hold S = num_local_physical_experts slots; slot p of the
    layer lives on rank p // S of `group`. Routing state (row views of the runtime's
    tensors, weighted replicas) is `moe.state.EplbLayerState`.
    """

    def __init__(self, name: str, module: nn.Module, names: Sequence[str], num_experts: int,
                 num_slots: int, group: dist.ProcessGroup | None) -> None:
        self.module = module
        self.names = list(names)
        self.init_eplb_state(name, num_experts, num_slots, module.num_experts, group)
        self._expert_forward = type(module).forward  # the model's own expert math
        # transformers' grouped_mm experts: run on our sorted rows, no second sort
        self._sorted = SortedExperts(module, name) if sorted_rows_apply(module) else None
        module.forward = self.forward  # the module now dispatches over expert parallelism

    # ---- EplbLayerState ----------------------------------------------------------
    def get_expert_weights(self) -> list[torch.Tensor]:
        """The module's stacked tensors, each [S, ...] (the parameters themselves)."""
        tensors = dict(self.module.named_parameters(recurse=False))
        tensors.update(self.module.named_buffers(recurse=False))
        return [tensors[n].data if isinstance(tensors[n], nn.Parameter) else tensors[n]
                for n in self.names]

    def replace_slots(self, num_local_slots: int) -> None:
        """Fresh zero [S, ...] stacked tensors, S = num_local_slots (the module's
        `num_experts` follows, so its own forward indexes S slots)."""
        module = self.module
        for n, t in zip(self.names, self.get_expert_weights()):
            fresh = t.new_zeros((num_local_slots, *t.shape[1:]))
            if n in module._parameters:
                module._parameters[n] = nn.Parameter(fresh, requires_grad=False)
            else:
                module._buffers[n] = fresh
        module.num_experts = num_local_slots

    # ---- forward -----------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], top_k_index [T, K] logical ids, top_k_weights [T, K]
        -> routed expert output [T, H]. Every rank of the group must call it.

        One process (W = 1): the replica choice, one load `scatter_add_`, then the
        module's own forward on slot ids; no host sync (none either in "grouped_mm" or
        "batched_mm"). W > 1: `dispatch` ("exact": one host sync for the split sizes;
        "fixed": none), the experts on the received rows, already sorted by local slot
        (`SortedExperts`: no second sort), `combine`.
        """
        W = self.begin_forward(hidden_states.shape[0], hidden_states.device)
        physical = self.route(top_k_index)  # [T, K]
        if W == 1:
            # nothing to exchange: the module's own forward on the slot ids (its
            # num_experts is S = P), so the rows are sorted once, by its own sort, and
            # whatever experts implementation the model runs now (transformers switches
            # to "batched_mm" for decode on GPUs) is the one that runs
            if self.record_load:
                record_load(self.expert_load_view, physical)
            return self._expert_forward(self.module, hidden_states, physical, top_k_weights)
        S, P = self.num_local_physical_experts, self.num_physical_experts
        slot_counts = count_slots(physical, P)  # [P]
        if self.record_load:
            self.expert_load_view.add_(slot_counts.to(self.expert_load_view.dtype))
        x_local, counts, _, state = dispatch(hidden_states, physical, S, self.group,
                                             slot_counts, self.dispatch_mode)  # [T_r, H], [S]
        offsets = counts.cumsum(0, dtype=torch.int32)  # [S] end row of each local slot
        y_local = self._experts(x_local, offsets)  # [T_r, H]
        out = combine(y_local, state, self.group)  # [T, K, H]
        # the gate weights as transformers' own experts forward applies them (same dtype
        # promotion), then the sum over k
        return (out * top_k_weights.unsqueeze(-1)).sum(1).to(hidden_states.dtype)  # [T, H]

    def _experts(self, x_local: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The module's expert math on rows sorted by local slot: x_local [T', H],
        offsets [S] int32 end rows -> [T', H] (rows past offsets[-1] are padding)."""
        rows = x_local.shape[0]
        if rows == 0:
            return x_local.new_zeros(x_local.shape)  # [0, H]
        if self._sorted is not None:
            return self._sorted(x_local, offsets)
        # another experts implementation: the module's own forward, one (token, k) copy
        # per row with weight 1 (its own sort then finds the rows already in order)
        slot = _slot_of_rows(offsets, rows)  # [T']
        ones = torch.ones(rows, 1, dtype=x_local.dtype, device=x_local.device)  # [T', 1]
        return self._expert_forward(self.module, x_local, slot.unsqueeze(1), ones)  # [T', H]
