"""MoEModel: a stack of expert-parallel MoE blocks implementing the MixtureOfExperts protocol."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from eplb.core.placement import Placement
from eplb.protocol import replica_cdf

from .args import MoEArgs
from .ep_guard import set_forward_counter
from .layer import MoEBlock, MoELayer, RMSNorm
from .state import check_num_layers, default_group
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


class MoEModel(nn.Module):
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
    num_redundant_experts, moe_layers, set_eplb_state, update_physical_experts_metadata.
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
        self.group = group
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.device = torch.device(device)
        L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
        S = P // ep_size

        self.num_moe_layers = L
        self.num_expert_groups = args.num_expert_groups
        self.num_logical_experts = N
        self.num_routed_experts = N
        self.num_shared_experts = args.num_shared_experts
        self.num_physical_experts = P
        self.num_local_physical_experts = S
        self.num_redundant_experts = P - N

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

        self.expert_weights: list[list[torch.Tensor]] = []
        self.expert_load_view: torch.Tensor  # [L, P] the tensors the layers hold rows of
        self.logical_to_physical_map: torch.Tensor  # [L, N, R]
        self.logical_replica_count: torch.Tensor  # [L, N]
        self.logical_replica_cdf: torch.Tensor | None = None  # [L, N, R] float32, None = even
        self.set_eplb_state(*eplb_state_for(placement, self.device))

    # ---- MixtureOfExperts --------------------------------------------------------
    def set_eplb_state(self, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        """Register row views of the runtime's tensors with every layer and refill
        `expert_weights` (same list object) with each layer's [w13, w2].

        expert_load_view [L, P], logical_to_physical_map [L, N, R] (-1 padded, any R),
        logical_replica_count [L, N]; integer tensors on the model's device. Drops any
        registered replica weights (the layers split evenly until the next
        `set_eplb_replica_weights`).
        """
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
        self.expert_weights[:] = [list(layer.get_expert_weights()) for layer in self.moe_layers]

    # ---- optional extension: weighted replicas (eplb.protocol.SupportsReplicaWeights) ----
    def set_eplb_replica_weights(self, logical_replica_cdf: torch.Tensor | None) -> None:
        """Register row views of the runtime's `logical_replica_cdf [L, N, R]` (float32,
        R as the registered `logical_to_physical_map`) with every layer: each expert's
        tokens then split over its replicas by the shares it encodes. None: split evenly.
        Call after `set_eplb_state`; the runtime rewrites the tensor in place."""
        if logical_replica_cdf is not None and logical_replica_cdf.shape[0] != self.num_moe_layers:
            raise ValueError(f"logical_replica_cdf: first dim {logical_replica_cdf.shape[0]} != "
                             f"num_moe_layers ({self.num_moe_layers})")
        for i, layer in enumerate(self.moe_layers):
            layer.set_eplb_replica_weights(i, logical_replica_cdf)
        self.logical_replica_cdf = logical_replica_cdf

    def update_physical_experts_metadata(self, num_physical_experts: int,
                                         num_local_physical_experts: int, *,
                                         reallocate: bool = False) -> None:
        """Record a new slot count P / slots per rank S (elastic resize, `eplb.runtime.resize`).

        When S differs from the slots allocated, or `reallocate` is set, every layer gets
        fresh zero slot tensors `w13 [S, 2I, H]`, `w2 [S, H, I]` (new storage: views of the
        old ones, and CUDA graphs captured over them, are stale and must be re-created) and
        `expert_weights` lists them; the caller fills them before the next forward. The old
        tensors stay alive as long as the caller holds references (a resize reads them while
        it fills the new ones). Otherwise the slot tensors are kept as they are.

        When P or the storage changes, the layers drop their routing state: the caller must
        fill the slots, call `set_expert_parallel_group` with a group of P / S ranks and
        `set_eplb_state` with [L, P] tensors (a fresh EplbRuntime does) before the next forward.
        """
        for name, value in (("num_physical_experts", num_physical_experts),
                            ("num_local_physical_experts", num_local_physical_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        P, S = num_physical_experts, num_local_physical_experts
        if P < self.num_logical_experts or P % S:
            raise ValueError(f"num_physical_experts: {P} must be a multiple of "
                             f"num_local_physical_experts ({S}) and >= num_logical_experts "
                             f"({self.num_logical_experts})")
        allocated = self.moe_layers[0].experts.num_slots
        reallocate = bool(reallocate) or S != allocated
        changed = reallocate or P != self.num_physical_experts
        if reallocate:
            for layer in self.moe_layers:
                experts = layer.experts
                w13, w2 = experts.w13, experts.w2  # [S_old, 2I, H], [S_old, H, I]
                experts.w13 = nn.Parameter(w13.new_zeros((S, *w13.shape[1:])), requires_grad=False)
                experts.w2 = nn.Parameter(w2.new_zeros((S, *w2.shape[1:])), requires_grad=False)
            self.expert_weights[:] = [list(layer.get_expert_weights()) for layer in self.moe_layers]
        self.num_physical_experts = P
        self.num_local_physical_experts = S
        self.num_redundant_experts = P - self.num_logical_experts
        for layer in self.moe_layers:
            layer.num_physical_experts = P
            layer.num_local_physical_experts = S
            if changed:
                layer.expert_load_view = None
                layer.logical_to_physical_map = None
                layer.logical_replica_count = None
                layer.logical_replica_cdf = None

    def set_expert_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """Make `group` the EP group (after `update_physical_experts_metadata`, in a resize):
        rank r of it holds slots [r*S, (r+1)*S). None: one process holding all P slots.
        Every layer communicates over it from the next forward on."""
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if rank < 0:
            raise ValueError("group: this process is not a member of it")
        if size * self.num_local_physical_experts != self.num_physical_experts:
            raise ValueError(f"group: {size} ranks x {self.num_local_physical_experts} local slots "
                             f"!= num_physical_experts ({self.num_physical_experts})")
        self.group, self.ep_size, self.ep_rank = group, size, rank
        for layer in self.moe_layers:
            layer.group = group

    def release_expert_slots(self) -> None:
        """Leave expert parallelism (a rank a resize shrinks away): every layer's slot
        tensors become empty `[0, ...]` (their memory is freed once nothing else holds
        them), the group and the routing state are dropped, so forward raises until
        `update_physical_experts_metadata` and a resize give this rank slots again."""
        for layer in self.moe_layers:
            experts = layer.experts
            experts.w13 = nn.Parameter(experts.w13.new_zeros((0, *experts.w13.shape[1:])),
                                       requires_grad=False)
            experts.w2 = nn.Parameter(experts.w2.new_zeros((0, *experts.w2.shape[1:])),
                                      requires_grad=False)
            layer.group = None
            layer.num_local_physical_experts = 0
            layer.expert_load_view = None
            layer.logical_to_physical_map = None
            layer.logical_replica_count = None
            layer.logical_replica_cdf = None
        self.expert_weights[:] = [list(layer.get_expert_weights()) for layer in self.moe_layers]
        self.group, self.ep_size, self.ep_rank = None, 1, 0
        self.num_local_physical_experts = 0

    def set_eplb_forward_counter(self, counter) -> None:
        """Optional extension: count forwards into the runtime's
        `eplb.protocol.ForwardCounter` (the first MoE layer calls `counter.forward`)."""
        set_forward_counter(self.moe_layers, counter)

    # ---- workload knobs ----------------------------------------------------------
    @torch.no_grad()
    def set_routing_bias(self, bias: torch.Tensor) -> None:
        """Write bias [L, N] into every router's `selection_bias` in place."""
        if tuple(bias.shape) != (self.num_moe_layers, self.num_logical_experts):
            raise ValueError(f"bias: shape {tuple(bias.shape)} != "
                             f"({self.num_moe_layers}, {self.num_logical_experts})")
        for i, layer in enumerate(self.moe_layers):
            layer.router.selection_bias.copy_(bias[i])

    def set_record_load(self, enabled: bool) -> None:
        """Turn load counting on or off in every layer (e.g. off for warm-up batches)."""
        for layer in self.moe_layers:
            layer.record_load = enabled

    # ---- forward -----------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] in args.dtype -> [T, H]. Every EP rank must call it (collectives)."""
        h = x
        for block in self.layers:
            h = block(h)
        return h
