"""The policy registry: a policy is registered under a name and looked up by it
(`EplbConfig.policy`, the CLI, `eplb.core.planning.plan`). Built in: `deepseek` (the
published algorithm, the baseline), `balanced` and `default` (the same planner,
`eplb.core.policy.balanced`). `plan()` checks a policy's inputs before the call and
validates its output after, so a policy does neither."""
from __future__ import annotations

from typing import Callable

from eplb.core.policy.balanced import balanced_policy
from eplb.core.policy.base import PolicyFn
from eplb.core.policy.deepseek import deepseek_policy

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


register_policy("deepseek")(deepseek_policy)
register_policy("balanced")(balanced_policy)
register_policy("default")(balanced_policy)
