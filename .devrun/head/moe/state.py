"""The EPLB state every expert-parallel model keeps, written once for both model
families (the reference `moe.MoEModel` and `moe.hf.ExpertParallelModel`):

* `EplbLayerState`, mixed into a layer (`MoELayer`, `ExpertParallelExperts`): the row
  views of the runtime's tensors, their checks, the group size, the replica choice and
  the guards every EP forward starts with;
* `EplbModelState`, mixed into a model: the `MixtureOfExperts` members that only
  forward to the layers (`set_eplb_state`, resize, group changes, knobs), with every
  argument check once, so both families refuse the same mistakes with the same words.

A family supplies the expert math and, per layer, `get_expert_weights()` and
`replace_slots(S)` (fresh zero slot tensors); nothing else about its state.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .args import DISPATCH_MODES
from .dispatch import SlotTable, check_same_tokens
from .ep_guard import enter_forward, set_forward_counter


def check_num_layers(num_moe_layers: int, **tensors: torch.Tensor | None) -> None:
    """Every given tensor's dim 0 is L = num_moe_layers (None: not registered)."""
    for name, t in tensors.items():
        if t is not None and t.shape[0] != num_moe_layers:
            raise ValueError(f"{name}: first dim {t.shape[0]} != num_moe_layers ({num_moe_layers})")


def check_state_rows(moe_layer_idx: int, expert_load_view: torch.Tensor,
                     logical_to_physical_map: torch.Tensor, logical_replica_count: torch.Tensor,
                     num_slots: int, num_experts: int, device: torch.device, owner: str) -> None:
    """expert_load_view [L, P], logical_to_physical_map [L, N, R], logical_replica_count
    [L, N]: right shapes for layer `moe_layer_idx`, on `device` (where `owner`'s expert
    weights are), integer dtypes."""
    P, N = num_slots, num_experts
    for name, t, ndim, width in (("expert_load_view", expert_load_view, 2, P),
                                 ("logical_to_physical_map", logical_to_physical_map, 3, N),
                                 ("logical_replica_count", logical_replica_count, 2, N)):
        if t.dim() != ndim or t.shape[1] != width or not 0 <= moe_layer_idx < t.shape[0]:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not fit layer "
                             f"{moe_layer_idx} with P={P}, N={N}")
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, the weights of {owner} on {device}")
        if t.dtype.is_floating_point:
            raise ValueError(f"{name}: needs an integer dtype, got {t.dtype}")


def check_replica_cdf(moe_layer_idx: int, logical_replica_cdf: torch.Tensor, num_experts: int,
                      max_replicas: int, device: torch.device) -> None:
    """logical_replica_cdf [L, N, R]: right shape for layer `moe_layer_idx`, on `device`,
    a floating dtype."""
    t, N, R = logical_replica_cdf, num_experts, max_replicas
    if t.dim() != 3 or t.shape[1:] != (N, R) or not 0 <= moe_layer_idx < t.shape[0]:
        raise ValueError(f"logical_replica_cdf: shape {tuple(t.shape)} does not fit layer "
                         f"{moe_layer_idx} with N={N}, R={R}")
    if t.device != device:
        raise ValueError(f"logical_replica_cdf: on {t.device}, the layer's weights on {device}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"logical_replica_cdf: needs a floating dtype, got {t.dtype}")


def default_group(group):
    """The EP group a model uses for `group`: torch's convention, None means the default
    process group (`dist.group.WORLD`) when torch.distributed is initialised, and one
    process (no communication) when it is not. For one process inside an initialised
    job, pass a group of one rank (`dist.new_group([rank], use_local_synchronization=True)`)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
    return value


class EplbLayerState:
    """Routing state of one EP MoE layer (`eplb.protocol.MoELayerProtocol`).

    Row views of the runtime's tensors (`set_eplb_state`): `expert_load_view [P]`,
    `logical_to_physical_map [N, R]`, `logical_replica_count [N]`, optionally
    `logical_replica_cdf [N, R]` (weighted replicas, `set_eplb_replica_weights`). The
    layer only reads the maps and adds into the load view, so the runtime may rewrite
    them, and the slot tensors, in place between forwards. Slot p lives on rank p // S of
    `group`. The subclass provides `get_expert_weights()` (its slot tensors, [S, ...]
    each) and `replace_slots(S)`, and calls `init_eplb_state` in its constructor.
    """

    def init_eplb_state(self, name: str, num_experts: int, num_slots: int, num_local_slots: int,
                        group: dist.ProcessGroup | None, dispatch_mode: str = "exact") -> None:
        self.name = name  # in error messages
        self.num_logical_experts = num_experts  # N
        self.num_physical_experts = num_slots  # P
        self.num_local_physical_experts = num_local_slots  # S
        self.group = group
        self.record_load = True  # False: route without counting (warm-up, dummy batches)
        self.dispatch_mode = dispatch_mode  # W > 1: "exact" | "fixed" (moe.dispatch)
        self.moe_layer_idx: int | None = None
        self._fixed_checked: tuple | None = None  # "fixed": (T, group) checked equal on all ranks
        self._world_of: tuple | None = None  # (group, W), cached by ep_world()
        self._slots = SlotTable()  # map_to_physical as one gather while the maps stand
        self.drop_eplb_state()

    def get_expert_weights(self) -> Sequence[torch.Tensor]:
        raise NotImplementedError

    def replace_slots(self, num_local_slots: int) -> None:
        """Fresh zero slot tensors [num_local_slots, ...] in place of the current ones."""
        raise NotImplementedError

    def drop_eplb_state(self) -> None:
        """Forget the routing state (a forward raises until `set_eplb_state`)."""
        self.expert_load_view: torch.Tensor | None = None  # [P]
        self.logical_to_physical_map: torch.Tensor | None = None  # [N, R]
        self.logical_replica_count: torch.Tensor | None = None  # [N]
        self.logical_replica_cdf: torch.Tensor | None = None  # [N, R] float32, None = even

    def set_eplb_state(self, moe_layer_idx: int, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        """Keep row `moe_layer_idx` of the runtime's [L, P], [L, N, R] and [L, N] tensors
        (views, not copies). Drops registered replica weights: they belong to the maps
        they came with."""
        check_state_rows(moe_layer_idx, expert_load_view, logical_to_physical_map,
                         logical_replica_count, self.num_physical_experts,
                         self.num_logical_experts, self.get_expert_weights()[0].device, self.name)
        self.moe_layer_idx = moe_layer_idx
        self.expert_load_view = expert_load_view[moe_layer_idx]
        self.logical_to_physical_map = logical_to_physical_map[moe_layer_idx]
        self.logical_replica_count = logical_replica_count[moe_layer_idx]
        self.logical_replica_cdf = None

    def set_eplb_replica_weights(self, moe_layer_idx: int,
                                 logical_replica_cdf: torch.Tensor | None) -> None:
        """Keep row `moe_layer_idx` of `logical_replica_cdf [L, N, R]` (float, R as the
        registered map); None: split every expert's tokens evenly again."""
        if logical_replica_cdf is None:
            self.logical_replica_cdf = None
            return
        if self.logical_to_physical_map is None or moe_layer_idx != self.moe_layer_idx:
            raise RuntimeError(f"{self.name}: call set_eplb_state before "
                               "set_eplb_replica_weights (with the same moe_layer_idx)")
        check_replica_cdf(moe_layer_idx, logical_replica_cdf, self.num_logical_experts,
                          self.logical_to_physical_map.shape[-1],
                          self.logical_to_physical_map.device)
        self.logical_replica_cdf = logical_replica_cdf[moe_layer_idx]

    def ep_world(self) -> int:
        """W, the size of `group` (cached per group object: no call per forward)."""
        if self._world_of is None or self._world_of[0] is not self.group:
            W = dist.get_world_size(self.group) if self.group is not None else 1
            self._world_of = (self.group, W)
        return self._world_of[1]

    def begin_forward(self, num_tokens: int, device: torch.device) -> int:
        """The checks and guards an EP forward starts with; returns W. Raises when no
        state is registered or W x S != P (a resize left half done); counts the forward
        (`moe.ep_guard`); in "fixed" dispatch checks once per T that every rank passes
        the same T (one all-reduce)."""
        if self.logical_to_physical_map is None:
            raise RuntimeError(f"{self.name}: set_eplb_state was never called")
        S, P = self.num_local_physical_experts, self.num_physical_experts
        W = self.ep_world()
        if W * S != P:
            raise RuntimeError(f"{self.name}: {W} ranks x {S} local slots != {P} physical "
                               "experts; the runtime must resize the layer first")
        enter_forward(self)
        if self.dispatch_mode == "fixed" and W > 1:
            self._fixed_checked = check_same_tokens(num_tokens, device, self.group,
                                                    self._fixed_checked)
        return W

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, K] logical -> [T, K] physical slots (even split or the cdf)."""
        return self._slots(topk_ids, self.logical_to_physical_map, self.logical_replica_count,
                           self.logical_replica_cdf)


class EplbModelState:
    """The `MixtureOfExperts` members of a model whose `moe_layers` are
    `EplbLayerState`s. The model sets `moe_layers`, `num_moe_layers`,
    `num_logical_experts`, `group` and calls `init_model_state` once they exist."""

    moe_layers: list

    def init_model_state(self, num_slots: int, num_local_slots: int,
                         group: dist.ProcessGroup | None) -> None:
        self.num_physical_experts = num_slots  # P
        self.num_local_physical_experts = num_local_slots  # S
        self.num_redundant_experts = num_slots - self.num_logical_experts
        self.group = group
        self.ep_size = dist.get_world_size(group) if group is not None else 1
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        self.expert_weights: list[list[torch.Tensor]] = []
        self.expert_load_view: torch.Tensor | None = None  # [L, P]
        self.logical_to_physical_map: torch.Tensor | None = None  # [L, N, R]
        self.logical_replica_count: torch.Tensor | None = None  # [L, N]
        self.logical_replica_cdf: torch.Tensor | None = None  # [L, N, R] float32, None = even

    def _refresh_expert_weights(self) -> None:
        """Refill `expert_weights` (the same list object the runtime holds)."""
        self.expert_weights[:] = [list(layer.get_expert_weights()) for layer in self.moe_layers]

    def set_eplb_state(self, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        """Register row views of the runtime's tensors with every layer and refill
        `expert_weights`. expert_load_view [L, P], logical_to_physical_map [L, N, R]
        (-1 padded, any R), logical_replica_count [L, N]: integer tensors on the experts'
        device. Drops registered replica weights (even split until the next
        `set_eplb_replica_weights`)."""
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
        self._refresh_expert_weights()

    def set_eplb_replica_weights(self, logical_replica_cdf: torch.Tensor | None) -> None:
        """Optional extension (weighted replicas, `eplb.protocol.SupportsReplicaWeights`):
        register row views of `logical_replica_cdf [L, N, R]` (float32, R as the
        registered map) with every layer; each expert's tokens then split over its
        replicas by the shares it encodes. None: split evenly. Call after
        `set_eplb_state`; the runtime rewrites the tensor in place."""
        check_num_layers(self.num_moe_layers, logical_replica_cdf=logical_replica_cdf)
        for i, layer in enumerate(self.moe_layers):
            layer.set_eplb_replica_weights(i, logical_replica_cdf)
        self.logical_replica_cdf = logical_replica_cdf

    def update_physical_experts_metadata(self, num_physical_experts: int,
                                         num_local_physical_experts: int, *,
                                         reallocate: bool = False) -> None:
        """Record a new slot count P / slots per rank S (elastic resize, `eplb.runtime.resize`).

        When S differs from the slots allocated, or `reallocate` is set, every layer gets
        fresh zero slot tensors [S, ...] (new storage: views of the old ones, and CUDA
        graphs captured over them, are stale) and `expert_weights` lists them; the caller
        fills them before the next forward. The old tensors live as long as the caller
        holds them (a resize reads them while it fills the new ones). When P or the
        storage changes, the layers drop their routing state: the caller must fill the
        slots, call `set_expert_parallel_group` with a group of P / S ranks and
        `set_eplb_state` with [L, P] tensors (a fresh EplbRuntime does) before a forward.
        """
        P = _positive_int("num_physical_experts", num_physical_experts)
        S = _positive_int("num_local_physical_experts", num_local_physical_experts)
        if P < self.num_logical_experts or P % S:
            raise ValueError(f"num_physical_experts: {P} must be a multiple of "
                             f"num_local_physical_experts ({S}) and >= num_logical_experts "
                             f"({self.num_logical_experts})")
        allocated = self.moe_layers[0].get_expert_weights()[0].shape[0]
        reallocate = bool(reallocate) or S != allocated
        changed = reallocate or P != self.num_physical_experts
        for layer in self.moe_layers:
            if reallocate:
                layer.replace_slots(S)
            layer.num_physical_experts = P
            layer.num_local_physical_experts = S
            if changed:
                layer.drop_eplb_state()
        self.num_physical_experts = P
        self.num_local_physical_experts = S
        self.num_redundant_experts = P - self.num_logical_experts
        if reallocate:
            self._refresh_expert_weights()

    def set_expert_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """Make `group` the EP group (after `update_physical_experts_metadata`, in a
        resize): rank r of it holds slots [r*S, (r+1)*S). None: one process holding all
        P slots. Every layer communicates over it from the next forward on."""
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if rank < 0:
            raise ValueError("group: this process is not a member of it")
        if size * self.num_local_physical_experts != self.num_physical_experts:
            raise ValueError(f"group: {size} ranks x {self.num_local_physical_experts} local "
                             f"slots != num_physical_experts ({self.num_physical_experts})")
        self.group, self.ep_size, self.ep_rank = group, size, rank
        for layer in self.moe_layers:
            layer.group = group

    def release_expert_slots(self) -> None:
        """Leave expert parallelism (a rank a resize shrinks away): every layer's slot
        tensors become empty [0, ...] (their memory is freed once nothing else holds
        them), the group and the routing state are dropped, so a forward raises until
        `update_physical_experts_metadata` and a resize give this rank slots again."""
        for layer in self.moe_layers:
            layer.replace_slots(0)
            layer.group = None
            layer.num_local_physical_experts = 0
            layer.drop_eplb_state()
        self._refresh_expert_weights()
        self.group, self.ep_size, self.ep_rank = None, 1, 0
        self.num_local_physical_experts = 0

    def set_eplb_forward_counter(self, counter) -> None:
        """Optional extension: count forwards into the runtime's
        `eplb.protocol.ForwardCounter` (the first MoE layer calls `counter.forward`)."""
        set_forward_counter(self.moe_layers, counter)

    def set_record_load(self, enabled: bool) -> None:
        """Turn load counting on or off in every layer (e.g. off for warm-up batches)."""
        for layer in self.moe_layers:
            layer.record_load = enabled

    def set_dispatch_mode(self, mode: str) -> None:
        """How tokens cross ranks (W > 1; see `moe.dispatch`): "exact" (the default)
        sends exactly the rows each rank needs and reads the split sizes on the host once
        per layer; "fixed" exchanges equal blocks of T*K rows with no host sync, for
        decode (every rank must then pass the same number of tokens: checked with one
        all-reduce whenever T changes). Every rank must set the same mode."""
        if mode not in DISPATCH_MODES:
            raise ValueError(f"mode: {mode!r} is not 'exact' or 'fixed'")
        for layer in self.moe_layers:
            layer.dispatch_mode = mode
