"""The transport contract is declared, and every transport keeps it (issue 31): each class
behind an `EplbConfig.transport` value (`transport_choice.TRANSPORT_CLASSES`) and the
tests' fault-injecting wrapper derives from `TransportBase`, defines the required members
itself, and every member of `Transport` it has takes the protocol's parameters."""
from __future__ import annotations

import inspect

import pytest
import torch

from eplb.core.config import TRANSPORTS
from eplb.runtime.transport_base import REQUIRED, Transport, TransportBase
from eplb.runtime.transport_choice import TRANSPORT_CLASSES, resolve_transport

from _faults import FaultyTransport, p2p_transport

CLASSES = {**TRANSPORT_CLASSES, "faulty (tests)": FaultyTransport}


def _protocol_members() -> list[str]:
    members = set(getattr(Transport, "__protocol_attrs__", ()))
    if not members:  # older Pythons: the protocol's own namespace
        members = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    return sorted(members)


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_every_configured_transport_has_a_class():
    assert set(TRANSPORT_CLASSES) == set(TRANSPORTS) - {"auto"}


def test_the_protocol_lists_every_member_the_runtime_calls():
    assert _protocol_members() == sorted(["name", "exchange_launches_no_kernels", "hold", "exchange",
                                          "settle", "write", "can_move", "move", "close"])


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_transport_class_implements_the_protocol(kind):
    cls = CLASSES[kind]
    assert issubclass(cls, TransportBase), f"{cls.__name__} must derive from TransportBase"
    assert not inspect.isabstract(cls), f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
    own = {n for c in cls.__mro__ if c not in (TransportBase, object) for n in vars(c)}
    missing = [n for n in REQUIRED if n not in own]
    assert not missing, f"{cls.__name__} must define {missing} itself"
    for name in _protocol_members():
        assert hasattr(cls, name), f"{cls.__name__} has no {name}"
        want = getattr(Transport, name, None)
        if callable(want):
            got = getattr(cls, name)
            assert callable(got), f"{cls.__name__}.{name} is not a method"
            assert _params(got) == _params(want), (
                f"{cls.__name__}.{name}{inspect.signature(got)} differs from "
                f"Transport.{name}{inspect.signature(want)}")
    if isinstance(vars(cls).get("name"), str):
        assert vars(cls)["name"] in TRANSPORTS


def test_objects_pass_the_runtime_checkable_protocol():
    p2p = resolve_transport("nccl")
    assert isinstance(p2p, Transport) and p2p.name == "nccl"
    faulty = p2p_transport()
    assert isinstance(faulty, Transport) and resolve_transport(faulty) is faulty
    assert (faulty.name, faulty.exchange_launches_no_kernels, faulty.hold) == ("nccl", False, None)
    assert not faulty.can_move([torch.zeros(2, 3)])


def test_an_incomplete_transport_is_refused():
    class Half:  # exchange and settle only: the pre-protocol duck type
        name = "nccl"

        def exchange(self, plan, weights, group, staging):
            return 0

        def settle(self, plan, group):
            pass

    with pytest.raises(ValueError, match="Transport"):
        resolve_transport(Half())

    class NoSettle(TransportBase):
        name = "nccl"

        def exchange(self, plan, weights, group, staging):
            return 0

    with pytest.raises(TypeError, match="settle"):
        NoSettle()
