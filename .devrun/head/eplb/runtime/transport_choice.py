"""Which transport moves the weights: `make_transport` builds one by name ("nccl",
"ipc", "auto") and `resolve_transport` accepts what callers pass. Above both transports
(`eplb.runtime.transports.P2PTransport`, `eplb.runtime.ipc.IpcTransport`), so neither
imports the other's module back."""
from __future__ import annotations

from typing import Sequence

import torch

from eplb.core.config import TRANSPORTS
from eplb.runtime.ipc import IpcTransport
from eplb.runtime.transport_base import Transport, TransportBase
from eplb.runtime.transports import DEFAULT_CHUNK_BYTES, P2PTransport

TRANSPORT_CLASSES: dict[str, type[TransportBase]] = {"nccl": P2PTransport, "ipc": IpcTransport}
"""The class behind each `EplbConfig.transport` value but "auto" (which picks one of them);
each implements `Transport` (tests/test_transport_protocol.py checks it)."""

AUTO_PREFERS_IPC = True
"""`make_transport("auto")` picks CUDA IPC when every rank is on one host with CUDA weights
and an NCCL group (measured faster there on 2 x H200 for whole-layer and partial swaps and
for the synchronous move in place: benchmarks/README.md, "Transfers, recording, asynchronous
rebalance" sections 5-6); otherwise NCCL (or gloo) point-to-point."""


def make_transport(kind: str = "auto", expert_weights: Sequence[Sequence[torch.Tensor]] | None = None,
                   group=None, *, chunk_bytes: int | None = None, timeout: float | None = None,
                   cpu_group=None):
    """A transport for `exchange_layer(..., transport=...)`.

    `kind`: "nccl" (point-to-point over the group's backend: NCCL on GPUs, gloo on CPU,
    `P2PTransport(chunk_bytes)`), "ipc" (`IpcTransport`, raises where it cannot work) or
    "auto" (IPC when every rank is on one host with CUDA weights and an NCCL group and
    `AUTO_PREFERS_IPC`, else "nccl"). "ipc" and "auto" are collective over `group`
    (call on every rank, once, with every layer's weights: the weights are registered).
    `timeout`: seconds the IPC transport's CPU tokens may wait for a peer (None: the default
    of torch.distributed). `cpu_group`: the gloo group (same ranks as `group`) the IPC
    transport sends its tokens on (None: it makes one, collective over `group`).
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
    p2p = TRANSPORT_CLASSES["nccl"](DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    if kind == "nccl":
        return p2p
    if expert_weights is None:
        raise ValueError(f"expert_weights is required for transport {kind!r}")
    import torch.distributed as dist

    if kind == "auto":
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return p2p
        mine = AUTO_PREFERS_IPC and dist.get_backend(group) == "nccl" and all(
            w.device.type == "cuda" for ws in expert_weights for w in ws)
        votes: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, bool(mine), group=group)
        if not all(votes):
            return p2p
        try:
            return TRANSPORT_CLASSES["ipc"](expert_weights, group, timeout, cpu_group=cpu_group)
        except RuntimeError as e:  # raised on every rank alike
            import logging

            logging.getLogger("eplb.runtime.transfer").info("auto transport: NCCL (%s)", e)
            return p2p
    return TRANSPORT_CLASSES["ipc"](expert_weights, group, timeout, cpu_group=cpu_group)


def resolve_transport(transport) -> Transport:
    """`transport` as a `Transport`: None or "nccl" make a `P2PTransport`; an object must
    implement every member of `Transport` (derive from `TransportBase` for the defaults)."""
    if transport is None or transport == "nccl":
        return P2PTransport()
    if isinstance(transport, str):
        raise ValueError(f"transport {transport!r} needs set-up: pass the object from "
                         f"make_transport({transport!r}, expert_weights, group) (collective)")
    # TransportBase first: the protocol's structural check costs ~80 us (per layer here)
    if not isinstance(transport, TransportBase) and not isinstance(transport, Transport):
        raise ValueError(f"transport must be None, 'nccl' or a Transport (see "
                         f"eplb.runtime.transport_base), got {transport!r}")
    return transport
