"""The transport contract, written down: `Transport` (what the layer mover and
`eplb.runtime.transfer` call on a transport, and when), `TransportBase` (the optional
members' default behaviour; every transport derives from it), and what every transport
builds on: the staging buffer of one layer and the run-wise slot copies, with
`write_layer`, the default `write`.

Below both transports (`eplb.runtime.transports.P2PTransport`, `eplb.runtime.ipc.IpcTransport`)
and the mover, so each of them imports it and none imports the others back.

Shapes: `weights` is one layer's local expert tensors, each `[S, ...]` (stacked slots,
views allowed, non-contiguous too), written only with `copy_` into slot views; `staging`
one contiguous `[>= plan.num_staged, ...]` buffer per weight tensor (same dtype and
device); `plan` the rank's `LayerTransferPlan` of that layer; `group` the process group
whose group-relative ranks the plan uses (the runtime's transfer group).
"""
from __future__ import annotations

import abc
from typing import ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from eplb.core.transfer_plan import LayerTransferPlan

__all__ = [
    "Transport",
    "TransportBase",
    "allocate_staging",
    "check_staging",
    "check_weights",
    "copy_runs",
    "staging_rows",
    "write_layer",
]


@runtime_checkable
class Transport(Protocol):
    """How one layer's experts travel between the ranks of a group. Required: `name`,
    `exchange`, `settle`; the rest have defaults in `TransportBase`.

    Threads and streams: `exchange` runs on the thread that moves the layer: the caller's
    (synchronous), the rebalance thread (asynchronous, launch "thread") or the step loop
    (asynchronous, launch "step"), with a side CUDA stream current in the last two; it may
    leave its work queued on the current stream. `write`, `move` and `close` run on the
    caller's thread (the step loop), `write` and `move` on the caller's stream. `can_move`
    is called where the layer is prepared (either thread); `settle` only by
    `transfer.execute_layer_transfer` (the mover's agreement is its barrier instead)."""

    name: ClassVar[str]
    """The `EplbConfig.transport` value it stands for ("nccl", "ipc"), for logs."""

    exchange_launches_no_kernels: ClassVar[bool]
    """True when `exchange` launches no NCCL kernel, so it may run in a background thread
    beside the model's collectives (`MoveOptions.launch="auto"` then keeps it in the
    thread); False: an asynchronous change on GPUs launches it from the step loop."""

    hold: list[torch.Tensor] | None
    """A buffer of one layer of local experts the transport owns (`[S, ...]` per weight
    tensor), or None. `StagingCache` uses it as the change's staging buffer when it fits,
    so a change adds no memory (the IPC transport's hold buffer)."""

    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        """Fill staging rows `0 .. plan.num_staged - 1`: local sources about to be
        overwritten and the experts received from peers. Only READS `weights` (the model
        serves meanwhile). Every rank with a non-noop plan for the layer calls it. Returns
        bytes received."""
        ...

    def settle(self, plan: LayerTransferPlan, group) -> None:
        """After `exchange`, before writing: order this rank's writes after every peer's
        reads of its slots (a no-op where `exchange` already completed the sends)."""
        ...

    def write(self, plan: LayerTransferPlan, weights: list[torch.Tensor],
              staging: list[torch.Tensor]) -> None:
        """Write every changed slot of the layer from staging or an unchanged local slot
        (the switch). Default: `write_layer`."""
        ...

    def can_move(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether `move` can carry out a layer of these weights. Default: False."""
        ...

    def move(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group) -> int:
        """The whole layer in place in one pass, nothing staged (synchronous moves only,
        when `can_move`; every rank with a non-noop plan calls it). Returns bytes received.
        A failure inside leaves the layer partly written. Default: raises."""
        ...

    def close(self) -> None:
        """Release what the transport holds of its peers (the runtime's `close()`; not
        collective). Default: nothing."""
        ...


class TransportBase(abc.ABC):
    """The base of every transport: the optional members of `Transport` with their
    default behaviour; a subclass sets `name` and implements `exchange` and `settle`
    (abstract: a transport lacking one cannot be made)."""

    name: ClassVar[str]
    exchange_launches_no_kernels: ClassVar[bool] = False
    hold: list[torch.Tensor] | None = None

    @abc.abstractmethod
    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        """See `Transport.exchange`."""

    @abc.abstractmethod
    def settle(self, plan: LayerTransferPlan, group) -> None:
        """See `Transport.settle`."""

    def write(self, plan: LayerTransferPlan, weights: list[torch.Tensor],
              staging: list[torch.Tensor]) -> None:
        write_layer(plan, weights, staging)

    def can_move(self, weights: Sequence[torch.Tensor]) -> bool:
        return False

    def move(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group) -> int:
        raise NotImplementedError(f"{type(self).__name__} cannot move a layer in place "
                                  "(can_move is False): use exchange, settle and write")

    def close(self) -> None:
        pass


REQUIRED = ("name", "exchange", "settle")
"""The members of `Transport` a subclass of `TransportBase` must define itself."""


# ---- staging and slot copies: what every transport builds on ------------------------
def staging_rows(plan: LayerTransferPlan) -> int:
    """Staging rows `exchange_layer` needs for `plan` (`plan.num_staged`, at most S)."""
    return plan.num_staged


def allocate_staging(weights: Sequence[torch.Tensor], rows: int | None = None) -> list[torch.Tensor]:
    """A contiguous staging buffer for one layer: per weight tensor `[rows, ...]`
    (default `rows = S`, one layer of local experts), same dtype and device."""
    return [torch.empty((w.shape[0] if rows is None else rows, *w.shape[1:]),
                        dtype=w.dtype, device=w.device) for w in weights]


def check_staging(staging: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], rows: int) -> None:
    if len(staging) != len(weights):
        raise ValueError(f"staging has {len(staging)} tensors, the layer has {len(weights)}")
    for i, (b, w) in enumerate(zip(staging, weights)):
        if (b.shape[1:] != w.shape[1:] or b.shape[0] < rows or b.dtype != w.dtype
                or b.device != w.device or not b.is_contiguous()):
            raise ValueError(
                f"staging[{i}] must be contiguous [>= {rows}, {', '.join(map(str, w.shape[1:]))}] "
                f"{w.dtype} on {w.device}; got {tuple(b.shape)} {b.dtype} on {b.device}")


def check_weights(plan: LayerTransferPlan, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    weights = list(weights)
    for i, w in enumerate(weights):
        if w.shape[0] != plan.slots_per_rank:
            raise ValueError(f"weights[{i}] has {w.shape[0]} slots, the plan expects {plan.slots_per_rank}")
    return weights


def _runs(a, b) -> list[tuple[int, int, int]]:
    """Split paired index arrays into maximal runs where both step by +1: `(a0, b0, n)`,
    so one `copy_` of `n` consecutive slots/rows replaces `n` single-slot copies."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)  # [n], [n]
    if a.size == 0:
        return []
    cut = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [a.size]])
    return [(int(a[s]), int(b[s]), int(e - s)) for s, e in zip(starts, ends)]


def copy_runs(dst: Sequence[torch.Tensor], dst_idx, src: Sequence[torch.Tensor], src_idx) -> None:
    """`dst[i][dst_idx[j]] = src[i][src_idx[j]]` for every tensor `i` and index `j`, one
    `copy_` per run of indices consecutive on both sides (`_runs`), on the current stream."""
    for d0, s0, n in _runs(dst_idx, src_idx):
        for d, t in zip(dst, src):
            d[d0:d0 + n].copy_(t[s0:s0 + n])


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
