"""Moving expert weights from one placement to the next, into the model's own tensors.

Three modules:

* `eplb.core.transfer_plan` (pure, numpy): from the old and new `physical_to_logical` rows of
  one layer, one rank's plan: which local slots stay, which are filled from an expert the
  rank already holds, which experts arrive from which peer and what the rank sends;
* `eplb.runtime.transports`: how experts travel (`P2PTransport`: NCCL or gloo point-to-point;
  `IpcTransport`: CUDA IPC on one host; `make_transport`);
* this module, the executor: it carries a plan out *into the model's own tensors*: weights
  are written with `copy_` into slot views, so storage and `data_ptr` never change and
  CUDA graphs and registered views stay valid. Everything of the other two is re-exported
  here.

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
    _as_p2l,
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
    _check_staging,
    _check_weights,
    _copy_runs,
    _resolve,
    _weights_key,
    allocate_staging,
    make_transport,
    staging_rows,
)

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
    weights = _check_weights(plan, weights)
    if plan.is_noop:
        return 0
    if staging is None:
        raise ValueError("staging is required: allocate_staging(weights, staging_rows(plan))")
    staging = list(staging)
    _check_staging(staging, weights, plan.num_staged)
    return _resolve(transport).exchange(plan, weights, group, staging)


@torch.no_grad()
def write_layer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                staging: Sequence[torch.Tensor]) -> None:
    """Phase 3 of one layer, on the current stream: write every changed slot from its staging
    row or from an unchanged local slot holding the same expert (one `copy_` per run of
    consecutive slots); unchanged slots are never written, storage and `data_ptr` stay."""
    weights = _check_weights(plan, weights)
    st = plan.write_from_stage  # [W]
    if st.any():  # staging is only read when some slot comes from it
        staging = list(staging)
        _check_staging(staging, weights, plan.num_staged)
    _copy_runs(weights, plan.write_dst[st], staging, plan.write_src[st])
    _copy_runs(weights, plan.write_dst[~st], weights, plan.write_src[~st])


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
    weights = _check_weights(plan, weights)
    if plan.is_noop:
        return 0
    transport = _resolve(transport)
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


class TransferVerificationError(RuntimeError):
    """After a layer's transfer, a slot's checksum differs from its expert's pre-transfer
    checksum. Raised on every rank of the group at once (all ranks compare the same
    gathered checksums), before `on_layer_done` of that layer."""

    def __init__(self, layer: int, bad_slots: list[int], message: str):
        super().__init__(message)
        self.layer = layer
        self.bad_slots = bad_slots  # global physical slot ids


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant, as a signed int64


def slot_checksums(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[S]` int64 checksum of each local slot over all of a layer's tensors, on their device.

    Each slot's bytes are read as int32 words (bytes when the size is not a multiple of 4),
    widened to int64 and summed with position-dependent odd multipliers; int64 wraps, so
    the sum is exact modular arithmetic and independent of reduction order (bitwise equal
    on every rank and device for equal bytes). Slot by slot, so the temporary memory is
    about 3x one slot's bytes of one tensor."""
    weights = list(weights)
    S = weights[0].shape[0]
    out = torch.zeros(S, dtype=torch.int64, device=weights[0].device)  # [S]
    coeffs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    for i, w in enumerate(weights):
        for s in range(S):
            raw = w[s].contiguous().reshape(-1).view(torch.uint8)  # [B]
            words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw  # [B/4] or [B]
            key = (i, words.numel(), words.dtype)
            c = coeffs.get(key)
            if c is None:  # odd multipliers depending on position and tensor index
                c = coeffs[key] = (torch.arange(words.numel(), dtype=torch.int64, device=w.device)
                                   * _MIX + (2 * i + 1))
            out[s] = out[s] * 1000003 + (words.to(torch.int64) * c).sum()
    return out


def _verify_layer(layer: int, old_row: np.ndarray, new_row: np.ndarray, rank: int,
                  num_ranks: int, old_cs: torch.Tensor, new_cs: torch.Tensor, group) -> None:
    """Gather `[S]` old and new checksums of every rank (one all_gather of `[2S]` int64)
    and compare, on every rank, each new slot to the old checksum of its expert (the first
    old slot holding it). Every rank reaches the same verdict, so all raise together."""
    S = old_cs.shape[0]
    mine = torch.cat([old_cs, new_cs])  # [2S]
    if num_ranks > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(mine) for _ in range(num_ranks)]
        dist.all_gather(parts, mine, group=group)
        both = torch.stack(parts).cpu().numpy()  # [M, 2S]
    else:
        both = mine.cpu().numpy()[None]
    old_all, new_all = both[:, :S].reshape(-1), both[:, S:].reshape(-1)  # [P], [P]
    first = first_slot_of_expert(old_row)
    want = old_all[[first[e] for e in new_row.tolist()]]  # [P]
    bad = np.flatnonzero(want != new_all)
    if bad.size:
        raise TransferVerificationError(
            layer, bad.tolist(),
            f"transfer verification failed on layer {layer}: slots {bad.tolist()} (experts "
            f"{new_row[bad].tolist()}, ranks {(bad // S).tolist()}) differ from their expert's "
            f"pre-transfer checksum")


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
    """Moves expert weights from one placement to another, layer by layer, synchronously,
    reusing one staging buffer. Later executors (asynchronous, other transports) keep the
    signature of `execute`.

    `num_nodes`: node count for same-node sender preference; defaults to the Placement's
    `num_nodes`, else 1.
    `verify`: after each changed layer, checksum every local slot (`slot_checksums`), gather
    the checksums of all ranks (one all_gather of `[2S]` int64 per changed layer) and raise
    `TransferVerificationError` on every rank, before `on_layer_done(layer)`, when a slot
    differs from its expert's pre-transfer checksum.
    `transport`: "nccl" (default; point-to-point over the group's backend, gloo on CPU),
    "ipc", "auto" (see `make_transport`; set up collectively on the first `execute` and
    again whenever the weights or group change) or a transport object.
    `chunk_bytes`: message size of the point-to-point transport (default
    `DEFAULT_CHUNK_BYTES`).
    """

    def __init__(self, num_nodes: int | None = None, verify: bool = False, transport="nccl",
                 chunk_bytes: int | None = None) -> None:
        if isinstance(transport, str) and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or a transport object, got {transport!r}")
        if chunk_bytes is not None:
            P2PTransport(chunk_bytes)  # validates
        self.num_nodes = num_nodes
        self.verify = verify
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self._staging: list[torch.Tensor] | None = None
        self._made: tuple[tuple, object] | None = None  # (key, transport) made for ipc/auto

    def _transport_for(self, expert_weights, group):
        """None for the default path (plain `execute_layer_transfer(plan, w, group, staging)`),
        else the transport object to pass."""
        t = self.transport
        if not isinstance(t, str):
            return t
        if t == "nccl":
            return None if self.chunk_bytes is None else P2PTransport(self.chunk_bytes)
        key = (id(group), tuple(_weights_key(ws) for ws in expert_weights))
        if self._made is None or self._made[0] != key:
            self._made = (key, make_transport(t, expert_weights, group, chunk_bytes=self.chunk_bytes))
        return self._made[1]

    def release_staging(self) -> None:
        """Drop the cached staging buffer (it is reused across calls otherwise)."""
        self._staging = None

    def close(self) -> None:
        """Drop staging and close a transport this executor made ('ipc'/'auto'); see
        `IpcTransport.close` for the shutdown order."""
        self._staging = None
        if self._made is not None and hasattr(self._made[1], "close"):
            self._made[1].close()
        self._made = None

    def _staging_for(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        b = self._staging
        if b is None or len(b) != len(weights) or any(
                x.shape != w.shape or x.dtype != w.dtype or x.device != w.device
                for x, w in zip(b, weights)):
            b = self._staging = allocate_staging(weights)
        return b

    def execute(self, old, new, expert_weights: Sequence[Sequence[torch.Tensor]],
                group=None, on_layer_done=None) -> TransferResult:
        """Rewrite `expert_weights[layer][i]` (`[S, ...]` local slots) from placement `old`
        to `new` (Placement or `[L, P]` array) over `group` (default: the world, or no
        communication at all when torch.distributed is not initialized).

        `on_layer_done(layer)` is called for every layer, in order, as soon as that
        layer's weights are final (on the current stream), so the caller can switch the
        layer's maps with its weights; if a later layer fails, earlier ones stay switched.
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        old_p2l, new_p2l = _as_p2l(old), _as_p2l(new)  # [L, P], [L, P]
        if old_p2l.shape != new_p2l.shape:
            raise ValueError(f"old {old_p2l.shape} and new {new_p2l.shape} differ in shape")
        L, P = old_p2l.shape
        if len(expert_weights) != L:
            raise ValueError(f"expert_weights has {len(expert_weights)} layers, placement {L}")
        if dist.is_available() and dist.is_initialized():
            num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
            if rank < 0:
                raise ValueError("this process is not a member of the given group")
        else:
            num_ranks, rank = 1, 0
        for p in (old, new):
            if isinstance(p, Placement) and p.num_gpus != num_ranks:
                raise ValueError(f"placement is for {p.num_gpus} GPUs, the group has {num_ranks} ranks")
        num_nodes = self.num_nodes
        if num_nodes is None:
            num_nodes = new.num_nodes if isinstance(new, Placement) else 1

        received = local = written = nbytes = sent = changed_layers = 0
        device = None
        transport = None
        if num_ranks > 1 and any(not np.array_equal(o, n) for o, n in zip(old_p2l, new_p2l)):
            transport = self._transport_for(expert_weights, group)  # collective for ipc/auto
        for layer in range(L):
            if not np.array_equal(old_p2l[layer], new_p2l[layer]):
                # every rank sees the same rows, so every rank takes the same branch
                changed_layers += 1
                weights = list(expert_weights[layer])
                device = weights[0].device if weights else device
                plan = plan_layer_transfer(old_p2l[layer], new_p2l[layer], num_ranks, rank, num_nodes)
                old_cs = slot_checksums(weights) if self.verify and weights else None
                if not plan.is_noop:
                    staging = None if moves_in_place(transport, weights) else self._staging_for(weights)
                    if transport is None:
                        nbytes += execute_layer_transfer(plan, weights, group, staging)
                    else:
                        nbytes += execute_layer_transfer(plan, weights, group, staging,
                                                         transport=transport)
                    received += plan.num_received
                    local += plan.num_local_copies
                    written += plan.num_slots_written
                    sent += plan.num_sent * sum(w[0].nbytes for w in weights)
                if old_cs is not None:  # every rank of the group, noop plan or not
                    _verify_layer(layer, old_p2l[layer], new_p2l[layer], rank, num_ranks,
                                  old_cs, slot_checksums(weights), group)
            if on_layer_done is not None:
                on_layer_done(layer)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return TransferResult(
            experts_received=received, local_copies=local, slots_written=written,
            bytes_received=nbytes, seconds=time.perf_counter() - t0, bytes_sent=sent,
            layers_changed=changed_layers,
        )
