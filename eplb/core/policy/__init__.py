"""Placement policies: pure functions of (load, topology, previous) -> physical_to_logical.

A policy is registered under a name and looked up by it (`EplbConfig.policy`, the CLI,
`eplb.core.planning.plan`). Every policy has the `PolicyFn` signature below; `plan()` checks
its inputs before the call and validates its output after, so a policy does neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import numpy as np
import torch

from eplb.core.placement import Placement
from eplb.core.policy import balanced, deepseek


DEFAULT_MOVE_TOLERANCE = 0.03  # the same default as EplbConfig.move_tolerance (see there)


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs every policy receives (a policy may ignore what it does not support)."""

    move_tolerance: float = DEFAULT_MOVE_TOLERANCE  # extra relative imbalance accepted to keep experts in place
    weighted: bool = False  # return (physical_to_logical, shares) with per-slot shares
    read_tokens: float = 0.0  # decode-aware packing: a weight read costs this many tokens (0 = off)
    step_choices: float = 0.0  # token-expert choices per step and layer (what read_tokens is set against)


class PolicyFn(Protocol):
    def __call__(
        self,
        load: np.ndarray,  # [L, N] float64, finite, >= 0
        num_slots: int,  # P, a multiple of num_gpus, >= N
        num_gpus: int,  # M, a multiple of num_nodes
        num_nodes: int,
        num_groups: int,  # N % num_groups == 0
        previous: Optional[Placement],  # current placement, same L, N, P, M; or None
        options: PolicyOptions,
    ) -> Union[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        # [L, P] int64 physical_to_logical, or (that, shares [L, P] float64)
        ...


_REGISTRY: dict[str, PolicyFn] = {}


def register_policy(name: str) -> Callable[[PolicyFn], PolicyFn]:
    """Decorator: make `fn` available as policy `name`; a name can be taken only once."""

    def add(fn: PolicyFn) -> PolicyFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"policy {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return add


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str) -> PolicyFn:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {name!r}; available: {', '.join(available_policies())}"
        ) from None


@register_policy("deepseek")
def deepseek_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    """DeepSeek EPLB as published (see `eplb.core.policy.deepseek`); ignores `previous`."""
    phy2log, _, _ = deepseek.rebalance_experts(
        torch.tensor(load, dtype=torch.float64), num_slots, num_groups, num_nodes, num_gpus
    )  # [L, P]
    return phy2log.numpy().astype(np.int64)


register_policy("balanced")(balanced.balanced_policy)


@register_policy("default")
def default_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    """The `balanced` policy (see `eplb.core.policy.balanced.balanced_policy`): better balance
    than `deepseek`, no two replicas of one expert on one GPU, node locality kept in the
    hierarchical case, few moves when `previous` is given (`options.move_tolerance`), and
    per-slot shares when `options.weighted`. `deepseek` stays as the faithful baseline."""
    return balanced.balanced_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)


__all__ = ["DEFAULT_MOVE_TOLERANCE", "PolicyFn", "PolicyOptions", "register_policy", "get_policy", "available_policies"]
