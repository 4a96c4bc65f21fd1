"""Moving expert weights from one placement to the next, into the model's own tensors.

Three modules:

* `eplb.core.transfer_plan` (pure, numpy): from the old and new `physical_to_logical` rows of
  one layer, one rank's plan: which local slots stay, which are filled from an expert the
  rank already holds, which experts arrive from which peer and what the rank sends;
* `eplb.runtime.transports`: how experts travel (`P2PTransport`: NCCL or gloo point-to-point;
  `IpcTransport`: CUDA IPC on one host; `make_transport`);
* this module: one layer carried out *into the model's own tensors* (`exchange_layer`,
  `write_layer`, `execute_layer_transfer`): weights are written with `copy_` into slot
  views, so storage and `data_ptr` never change and CUDA graphs and registered views stay
  valid. The public names of the other two are re-exported here. `TransferExecutor`, the
  standalone whole-placement move of tools and benchmarks, is a thin front of the one
  layer mover (`eplb.runtime.placement_change.PlacementChange`).

Per layer and rank the execution is (after vLLM's `move_to_buffer`/`move_from_buffer`
and SGLang's `update_expert_weights_single_layer`), in two public halves that an
asynchronous caller can run apart (`exchange_layer` in a background thread or launched
from the step loop, on a side stream; `write_layer` at a step boundary):

1. (`exchange_layer`) copy experts needed locally whose only local source slot is about
   to be overwritten into a staging buffer (an in-place write could clobber the source);
2. (`exchange_layer`) move the remote experts into staging, reading the peers' untouched
   weights, through a transport;
3. (`write_layer`) write every changed slot from staging, or straight from an unchanged
   local slot that holds the same expert (unchanged slots are never written, so they are
   safe sources).

A synchronous move over CUDA IPC skips the staging of received experts
(`IpcTransport.move`, used by `execute_layer_transfer`): every rank first copies the old
experts of its changed slots that someone still reads into a *hold buffer*, and each
sender then writes its experts straight into the receivers' slots while later hold
chunks are still being copied. Each byte crosses NVLink once and is written once
(`in_place_ops`, pure, says which copies).

Extra memory: the staging buffer (`staging_rows(plan)` <= S rows, one layer of local
experts; for the IPC transport its hold buffer, allocated once, serves as both) plus,
for the point-to-point transport only, pack buffers of at most 2 x `chunk_bytes` per
receiving peer when sends need packing, taken from the staging rows a layer leaves
unused when they have room.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from eplb.core.placement import Placement
from eplb.core.transfer_plan import (  # noqa: F401 - re-exported
    InPlaceOps,
    LayerTransferPlan,
    TransferStats,
    as_p2l,
    assign_senders,
    first_slot_of_expert,
    in_place_ops,
    plan_layer_transfer,
    plan_layer_transfers,
    transfer_stats,
)
from eplb.runtime.transports import (  # noqa: F401 - re-exported
    AUTO_PREFERS_IPC,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_HOLD_CHUNK_BYTES,
    TRANSPORTS,
    IpcTransport,
    P2PTransport,
    allocate_staging,
    check_staging,
    check_weights,
    copy_runs,
    make_transport,
    resolve_transport,
    staging_rows,
    weights_key,
)
from eplb.runtime.verify import TransferVerificationError, slot_checksums  # noqa: F401 - re-exported

__all__ = [
    "LayerTransferPlan",
    "InPlaceOps",
    "in_place_ops",
    "TransferStats",
    "TransferResult",
    "TransferExecutor",
    "assign_senders",
    "plan_layer_transfer",
    "plan_layer_transfers",
    "transfer_stats",
    "execute_layer_transfer",
    "exchange_layer",
    "write_layer",
    "moves_in_place",
    "staging_rows",
    "allocate_staging",
    "P2PTransport",
    "IpcTransport",
    "make_transport",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_HOLD_CHUNK_BYTES",
    "AUTO_PREFERS_IPC",
    "TRANSPORTS",
    "TransferVerificationError",
    "first_slot_of_expert",
    "slot_checksums",
]


def exchange_layer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor], group,
                   staging: Sequence[torch.Tensor], *, transport=None) -> int:
    """Phases 1 and 2 of one layer: fill staging rows `0 .. plan.num_staged - 1` (local
    copies of sources that will be overwritten, and the experts received from peers).
    Reads `weights` and never writes them. Returns bytes received.

    On CUDA the work may be left queued on the current stream (like NCCL's `work.wait()`):
    staging is ready once an event recorded on the current stream afterwards completes. It
    never touches the default stream explicitly nor synchronizes the device, so it may run
    in a background thread with a side stream current.
    `transport`: None or "nccl" (`P2PTransport` with `DEFAULT_CHUNK_BYTES`), or an object
    from `make_transport`. Every rank of `group` with a non-noop plan for the layer must
    call it (plans of all ranks come from the same rows); noop ranks may skip it.
    """
    weights = check_weights(plan, weights)
    if plan.is_noop:
        return 0
    if staging is None:
        raise ValueError("staging is required: allocate_staging(weights, staging_rows(plan))")
    staging = list(staging)
    check_staging(staging, weights, plan.num_staged)
    return resolve_transport(transport).exchange(plan, weights, group, staging)


@torch.no_grad()
def write_layer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                staging: Sequence[torch.Tensor]) -> None:
    """Phase 3 of one layer, on the current stream: write every changed slot from its staging
    row or from an unchanged local slot holding the same expert (one `copy_` per run of
    consecutive slots); unchanged slots are never written, storage and `data_ptr` stay."""
    weights = check_weights(plan, weights)
    st = plan.write_from_stage  # [W]
    if st.any():  # staging is only read when some slot comes from it
        staging = list(staging)
        check_staging(staging, weights, plan.num_staged)
    copy_runs(weights, plan.write_dst[st], staging, plan.write_src[st])
    copy_runs(weights, plan.write_dst[~st], weights, plan.write_src[~st])


def execute_layer_transfer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                           group=None, staging: Sequence[torch.Tensor] | None = None, *,
                           transport=None) -> int:
    """Carry out `plan` on one layer's local expert tensors, in place; return bytes received:
    with an IPC transport that has a hold buffer, `IpcTransport.move` (received experts
    go straight into their slots, no staging); otherwise `exchange_layer`, the transport's
    `settle` (IPC: wait until peers finished reading), then `write_layer`.

    `weights`: tensors `[S, ...]` (stacked local slots, views allowed, non-contiguous too),
    written only through `copy_` into slot views, so storage and `data_ptr` are unchanged.
    `staging`: optional reusable buffer as from `allocate_staging` (at least
    `plan.num_staged` rows); else exactly the rows needed are allocated.
    `group`: the process group whose (group-relative) ranks the plan uses.
    Every rank of the group must call this for the layer (ranks with nothing to do return
    at once). Under NCCL the group must already have run a collective, since a first
    `batch_isend_irecv` that leaves some ranks out is undefined behaviour.
    """
    weights = check_weights(plan, weights)
    if plan.is_noop:
        return 0
    transport = resolve_transport(transport)
    if moves_in_place(transport, weights):
        return transport.move(plan, weights, group)
    staging = allocate_staging(weights, plan.num_staged) if staging is None else list(staging)
    received = exchange_layer(plan, weights, group, staging, transport=transport)
    transport.settle(plan, group)
    write_layer(plan, weights, staging)
    return received


def moves_in_place(transport, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `execute_layer_transfer` moves this layer with `transport.move` (the IPC
    transport with its hold buffer) rather than exchange, settle and write."""
    can = getattr(transport, "can_move", None)
    return bool(can is not None and can(list(weights)))


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
        from eplb.runtime.placement_change import StagingCache

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
        from eplb.runtime.groups import EplbGroups

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
        import torch.distributed as dist

        from eplb.runtime.placement_change import (MoveOptions, PlacementChange,
                                                   RebalanceError)

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
        c = change.counts
        return TransferResult(
            experts_received=c["received"], local_copies=c["local_copies"],
            slots_written=c["written"], bytes_received=c["bytes_received"],
            seconds=time.perf_counter() - t0, bytes_sent=c["bytes_sent"],
            layers_changed=len(changed))


def _placement(p2l: np.ndarray, num_gpus: int, num_nodes: int) -> Placement:
    """A Placement of the rows `p2l [L, P]` (its experts numbered 0 .. max)."""
    n = int(p2l.max()) + 1 if p2l.size else 1
    return Placement(np.asarray(p2l, dtype=np.int64), n, num_gpus, num_nodes)
