"""Reference MoE model for the EPLB runtime: router, dispatch, grouped experts, and a
dense single-process oracle. Depends on `eplb.protocol` / `eplb.core.placement` only."""
from .args import MoEArgs
from .dispatch import (combine, dispatch, hash_replica, map_to_physical, record_load,
                       weighted_replica, weighted_sum)
from .experts import GroupedExperts, SharedExperts, swiglu
from .layer import MoEBlock, MoELayer, RMSNorm
from .model import MoEModel, eplb_state_for, replica_cdf_for
from .reference import DenseMoEModel
from .router import Router
from .weights import (expert_weights_for, norm_weight_for, router_weight_for, sample_tokens,
                      shared_expert_weights_for, write_expert_slots)

__all__ = [
    "MoEArgs", "MoEModel", "DenseMoEModel", "MoELayer", "MoEBlock", "RMSNorm", "Router",
    "GroupedExperts", "SharedExperts", "swiglu", "dispatch", "combine", "map_to_physical",
    "record_load", "hash_replica", "weighted_replica", "weighted_sum", "eplb_state_for",
    "replica_cdf_for", "expert_weights_for",
    "router_weight_for", "shared_expert_weights_for", "norm_weight_for", "sample_tokens",
    "write_expert_slots",
]
