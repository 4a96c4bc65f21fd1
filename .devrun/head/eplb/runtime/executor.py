"""`TransferExecutor`: a whole placement moved synchronously, for tools and benchmarks
that have expert weights but no runtime. A thin front of the one layer mover
(`eplb.runtime.placement_change.PlacementChange`: plan, exchange, verify, agree, write),
so it sits above it: the mover never imports this module."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import TRANSPORTS
from eplb.core.placement import Placement
from eplb.core.transfer_plan import as_p2l
from eplb.runtime.groups import EplbGroups
from eplb.runtime.events import RebalanceError
from eplb.runtime.move_options import MoveOptions
from eplb.runtime.placement_change import PlacementChange
from eplb.runtime.staging import StagingCache
from eplb.runtime.transport_choice import make_transport
from eplb.runtime.transports import DEFAULT_CHUNK_BYTES, P2PTransport, weights_key
from eplb.runtime.verify import TransferVerificationError


@dataclass(frozen=True)
class TransferResult:
    """What one rank did in one `TransferExecutor.execute` call."""

    experts_received: int  # experts received over the network
    local_copies: int  # changed slots filled from an expert this rank already held
    slots_written: int  # changed local slots (each written once)
    bytes_received: int
    seconds: float
    bytes_sent: int = 0
    layers_changed: int = 0  # layers whose placement differs (on any rank)


class TransferExecutor:
    """Moves expert weights from one placement to another, synchronously, through the one
    layer mover (`PlacementChange`: plan, exchange, verify, agree, write), for tools and
    benchmarks that have weights but no runtime. Keeps its staging buffer and its groups
    across calls.

    `num_nodes`: node count for same-node sender preference; defaults to the Placement's
    `num_nodes`, else 1.
    `verify`: check every received expert against its pre-transfer checksum before it is
    written (`TransferVerificationError` on the rank that saw it, `RebalanceError` on the
    others; nothing of that layer is written, earlier layers stay moved).
    `transport`: "nccl" (default; point-to-point over the group's backend, gloo on CPU),
    "ipc", "auto" (see `make_transport`; set up collectively on the first `execute` and
    again whenever the weights or group change) or a transport object.
    `chunk_bytes`: message size of the point-to-point transport (default
    `DEFAULT_CHUNK_BYTES`).
    `timeout`: seconds a transfer may take before the move fails (its groups' timeout).
    """

    def __init__(self, num_nodes: int | None = None, verify: bool = False, transport="nccl",
                 chunk_bytes: int | None = None, timeout: float = 300.0) -> None:
        if isinstance(transport, str) and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or a transport object, got {transport!r}")
        if chunk_bytes is not None:
            P2PTransport(chunk_bytes)  # validates
        self.num_nodes = num_nodes
        self.verify = verify
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._staging = StagingCache(keep=True)
        self._made: tuple[tuple, object] | None = None  # (key, transport) made for ipc/auto
        self._groups: tuple[int, object] | None = None  # (id of the group, EplbGroups)

    def _groups_for(self, group):
        if self._groups is None or self._groups[0] != id(group):
            self._groups = (id(group), EplbGroups.create(group, self.timeout))
        return self._groups[1]

    def _transport_for(self, expert_weights, group):
        t = self.transport
        if not isinstance(t, str):
            return t
        if t == "nccl":
            return P2PTransport(DEFAULT_CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes)
        key = (id(group), tuple(weights_key(ws) for ws in expert_weights))
        if self._made is None or self._made[0] != key:
            self._made = (key, make_transport(t, expert_weights, group, chunk_bytes=self.chunk_bytes,
                                              timeout=self.timeout))
        return self._made[1]

    def release_staging(self) -> None:
        """Drop the cached staging buffer (it is reused across calls otherwise)."""
        self._staging.release()

    def close(self) -> None:
        """Drop staging and close a transport this executor made ('ipc'/'auto'); see
        `IpcTransport.close` for the shutdown order."""
        self._staging.release()
        if self._made is not None and hasattr(self._made[1], "close"):
            self._made[1].close()
        self._made = None

    def execute(self, old, new, expert_weights: Sequence[Sequence[torch.Tensor]],
                group=None, on_layer_done=None) -> TransferResult:
        """Rewrite `expert_weights[layer][i]` (`[S, ...]` local slots) from placement `old`
        to `new` (Placement or `[L, P]` array) over `group` (default: the world, or no
        communication at all when torch.distributed is not initialized). Collective.

        `on_layer_done(layer)` is called for every layer, in order, as soon as that
        layer's weights are final (on the current stream), so the caller can switch the
        layer's maps with its weights; if a later layer fails, earlier ones stay switched.
        """
        t0 = time.perf_counter()
        old_p2l, new_p2l = as_p2l(old), as_p2l(new)  # [L, P], [L, P]
        if old_p2l.shape != new_p2l.shape:
            raise ValueError(f"old {old_p2l.shape} and new {new_p2l.shape} differ in shape")
        L, P = old_p2l.shape
        if len(expert_weights) != L:
            raise ValueError(f"expert_weights has {len(expert_weights)} layers, placement {L}")
        distributed = dist.is_available() and dist.is_initialized()
        num_ranks = dist.get_world_size(group) if distributed else 1
        if distributed and dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the given group")
        for p in (old, new):
            if isinstance(p, Placement) and p.num_gpus != num_ranks:
                raise ValueError(f"placement is for {p.num_gpus} GPUs, the group has {num_ranks} ranks")
        num_nodes = self.num_nodes
        if num_nodes is None:
            num_nodes = new.num_nodes if isinstance(new, Placement) else 1
        changed = [l for l in range(L) if not np.array_equal(old_p2l[l], new_p2l[l])]
        done = []  # layers reported to on_layer_done, in order

        def report_up_to(layer: int) -> None:
            for l in range(len(done), layer + 1):
                done.append(l)
                if on_layer_done is not None:
                    on_layer_done(l)

        if not changed:
            report_up_to(L - 1)
            return TransferResult(0, 0, 0, 0, time.perf_counter() - t0)
        groups = self._groups_for(group if distributed else None)
        if num_ranks > 1 or not isinstance(self.transport, str):
            transport = self._transport_for(expert_weights, groups.transfer)
        else:  # one rank: local copies only
            transport = P2PTransport()
        weights = [list(ws) for ws in expert_weights]
        device = weights[changed[0]][0].device
        change = PlacementChange(
            _placement(old_p2l, num_ranks, num_nodes), lambda: _placement(new_p2l, num_ranks, num_nodes),
            weights, groups=groups, transport=transport, device=device,
            options=MoveOptions(verify=self.verify, timeout=self.timeout, launch="thread",
                                num_nodes=num_nodes),
            staging=self._staging, on_switch=report_up_to)
        try:
            change.run()
        except RebalanceError as e:
            if isinstance(change.error, TransferVerificationError):
                raise change.error from e
            raise
        report_up_to(L - 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        c = change.stats
        return TransferResult(
            experts_received=c.received, local_copies=c.local_copies,
            slots_written=c.written, bytes_received=c.bytes_received,
            seconds=time.perf_counter() - t0, bytes_sent=c.bytes_sent,
            layers_changed=len(changed))


def _placement(p2l: np.ndarray, num_gpus: int, num_nodes: int) -> Placement:
    """A Placement of the rows `p2l [L, P]` (its experts numbered 0 .. max)."""
    n = int(p2l.max()) + 1 if p2l.size else 1
    return Placement(np.asarray(p2l, dtype=np.int64), n, num_gpus, num_nodes)
