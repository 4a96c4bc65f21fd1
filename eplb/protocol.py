"""The model-side interface of the runtime, kept name for name with vLLM's
`MixtureOfExperts` so that a vLLM-style model plugs in unchanged.

A model exposes, per MoE layer, the stacked tensors of its local expert weights
(`expert_weights[layer][i]` has shape `[num_local_physical_experts, ...]`) and
receives three runtime-owned tensors whose *storage never changes*: the runtime
updates them with `copy_`, so views a layer holds (and CUDA graphs) stay valid.

Optional extension, weighted replicas (`SupportsReplicaWeights`): a model that also has
`set_eplb_replica_weights(logical_replica_cdf)` receives a fourth runtime-owned tensor,
`logical_replica_cdf [L, N, R]` float32, and splits each expert's tokens over its
replicas by those weights instead of evenly. It is not a member of `MixtureOfExperts`:
a vLLM-style model without it plugs in unchanged and keeps splitting evenly.
"""
from __future__ import annotations

import logging
from typing import Iterable, MutableSequence, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from eplb.core.placement import replica_cdf  # noqa: F401 - part of the protocol's vocabulary


@runtime_checkable
class MoELayerProtocol(Protocol):
    """One MoE layer as the runtime sees it."""

    def get_expert_weights(self) -> Sequence[torch.Tensor]:
        """Stacked local expert tensors, each `[num_local_physical_experts, ...]`."""
        ...

    def set_eplb_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,  # [L, P] int64 (the layer keeps row moe_layer_idx)
        logical_to_physical_map: torch.Tensor,  # [L, N, R] int64, -1 padded
        logical_replica_count: torch.Tensor,  # [L, N] int64
    ) -> None:
        ...


@runtime_checkable
class MixtureOfExperts(Protocol):
    """vLLM's `MixtureOfExperts` interface (`vllm/model_executor/models/interfaces.py`)."""

    expert_weights: MutableSequence[Sequence[torch.Tensor]]
    num_moe_layers: int
    num_expert_groups: int
    num_logical_experts: int
    num_physical_experts: int
    num_local_physical_experts: int
    num_routed_experts: int
    num_shared_experts: int
    num_redundant_experts: int
    moe_layers: Iterable[nn.Module]

    def set_eplb_state(
        self,
        expert_load_view: torch.Tensor,  # [L, P]
        logical_to_physical_map: torch.Tensor,  # [L, N, R]
        logical_replica_count: torch.Tensor,  # [L, N]
    ) -> None:
        """Register the runtime's tensors with every MoE layer and fill
        `expert_weights` with each layer's stacked local expert tensors."""
        ...

    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        """Tell the model that the number of slots changed (elastic resize).

        `eplb.runtime.resize` calls it as `(P, S, reallocate=True)` on every rank of the
        new group, so a model that resizes must accept that keyword (a model that never
        resizes may raise). With it the model records the new P, S and
        num_redundant_experts = P - N, gives every layer fresh `[S, ...]` slot tensors (new
        storage: the resize still reads the old ones while it fills the new) and lists them
        in `expert_weights` before it returns. A new runtime then calls `set_eplb_state`."""
        ...


@runtime_checkable
class SupportsReplicaWeights(Protocol):
    """Optional extension of `MixtureOfExperts`: weighted replicas.

    `logical_replica_cdf [L, N, R]` float32 holds, for every expert, the cumulative
    shares of its replicas in the order of `logical_to_physical_map[l, n, :]`: entry r
    is the fraction of the expert's tokens that replicas 0..r receive. The last valid
    entry (r = count - 1) is exactly 1.0 and the -1 padded entries are 1.0 too, so a row
    is non-decreasing and ends at 1.0. A model picks, for a choice with a uniform
    u in [0, 1), the first replica whose cdf exceeds u (clamped to count - 1); an even
    split is cdf[r] = (r + 1) / count.

    Like the other maps, the tensor is runtime-owned and only ever rewritten in place
    (`copy_`), and a model should keep (views of) the tensor, not a copy. The runtime
    passes it only while routing may need it (`EplbConfig.weighted_replicas`, or the
    placement in force or about to be applied has uneven shares), and passes None to
    switch it off: the model then splits every expert's tokens evenly. So the method
    must accept None. The runtime calls it only after `set_eplb_state`, which may drop
    the registration (a new runtime registers the tensor again when it needs it).

    A model without this method keeps splitting evenly; the runtime then warns once
    when it applies a placement with uneven shares, and the balance that placement
    achieves is the even-split one, not the one its planner predicted.
    """

    def set_eplb_replica_weights(
        self,
        logical_replica_cdf: torch.Tensor,  # [L, N, R] float32, R as logical_to_physical_map
    ) -> None:
        ...


def supports_replica_weights(model: object) -> bool:
    """True when `model` implements the optional weighted-replicas extension."""
    return callable(getattr(model, "set_eplb_replica_weights", None))


def is_mixture_of_experts(model: object) -> bool:
    """True when `model` implements the protocol and has at least one MoE layer."""
    return isinstance(model, MixtureOfExperts) and model.num_moe_layers > 0


MOE_MEMBERS = (
    "expert_weights", "num_moe_layers", "num_expert_groups", "num_logical_experts",
    "num_physical_experts", "num_local_physical_experts", "num_routed_experts",
    "num_shared_experts", "num_redundant_experts", "moe_layers", "set_eplb_state",
    "update_physical_experts_metadata",
)


def missing_members(model: object) -> list[str]:
    """Names of protocol members `model` lacks (for a clear error message)."""
    return [m for m in MOE_MEMBERS if not hasattr(model, m)]


def is_unwrapped_hf_model(model: object) -> bool:
    """True when `model` looks like a transformers MoE model itself rather than what
    `moe.hf.expert_parallel` returns: its class, or the class of one of its `*Experts`
    modules, comes from transformers. Imports nothing."""
    modules = getattr(model, "modules", None)
    found = [model, *(m for m in modules() if type(m).__name__.endswith("Experts"))] \
        if callable(modules) else [model]
    return any(type(m).__module__.startswith("transformers.") for m in found)


class ForwardCounter:
    """The model's forwards and the runtime's steps, as plain Python ints (no host sync).

    Optional extension of `MixtureOfExperts`: a model with
    `set_eplb_forward_counter(counter)` gets the runtime's counter at start-up and calls
    `counter.forward(record_load)` once per forward (e.g. from its first MoE layer); the
    runtime calls `step()` in every `EplbRuntime.step()`. When WARN_AFTER forwards record
    load and the runtime was never stepped, it warns once: nothing is ever rebalanced.
    (A job that steps after each `generate()`, many forwards apart, is not warned.)
    `forwards` lets the runtime check that every EP rank ran the same number of forwards.
    """

    WARN_AFTER = 100  # forwards recording load without a runtime.step() before the warning

    def __init__(self) -> None:
        self.forwards = 0  # forwards since the runtime registered the counter
        self.since_step = 0  # of them, forwards that recorded load since the last step()
        self.warned = False
        self.stepped = False  # step() was called at least once

    def forward(self, record_load: bool) -> None:
        self.forwards += 1
        if record_load:
            self.since_step += 1
            if self.since_step == self.WARN_AFTER and not (self.warned or self.stepped):
                self.warned = True
                logging.getLogger("eplb.runtime").warning(
                    "eplb: %d forwards recorded load but runtime.step() was never called "
                    "since: call runtime.step() after each forward (it records the load and "
                    "rebalances on schedule); nothing is rebalanced until then", self.since_step)

    def step(self) -> None:
        self.since_step = 0
        self.stepped = True
