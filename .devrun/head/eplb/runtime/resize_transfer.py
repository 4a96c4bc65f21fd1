"""The point-to-point execution of a resize (`execute_resize`: `batch_isend_irecv` from
the old slot tensors into newly allocated ones, layer by layer, following the pure
`eplb.core.resize_plan.ResizePlan`) and the resize's errors. The steps around it
(agreement, planning, re-allocation, verification, the new runtime) are
`eplb.runtime.resize`."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.resize_plan import LayerResizePlan, ResizePlan

__all__ = ["ResizeError", "ResizeVerificationError", "TransferHook", "execute_resize"]

# transfer_hook(layer, new): called on every rank of the plan once `layer` has arrived,
# with this rank's new slot tensors of that layer (None outside the new group), before
# verification. A test seam for fault injection (corrupt a value "in flight").
TransferHook = Callable[[int, "list[torch.Tensor] | None"], None]


class ResizeError(RuntimeError):
    """A resize could not complete after weights started to move."""


class ResizeVerificationError(ResizeError):
    """After a resize, a new slot's checksum differs from its expert's old checksum
    (raised on every rank of the union at once)."""

    def __init__(self, layer: int, bad_slots: list[int], message: str):
        super().__init__(message)
        self.layer = layer
        self.bad_slots = bad_slots  # new physical slot ids


def _execute_layer(lp: LayerResizePlan, rank: int, old: Sequence[torch.Tensor] | None,
                   new: Sequence[torch.Tensor] | None, group) -> int:
    """One layer on one rank: post sends (from `old`) and receives (into `new`), copy the
    local rows, wait, copy received rows to their duplicates. Returns bytes received."""
    ops: list[tuple[int, str, int, int]] = []  # (expert, kind, peer, row) sorted below
    for t in np.flatnonzero(lp.src_rank == rank).tolist():
        ops.append((int(lp.recv_expert[t]), "send", int(lp.dst_rank[t]), t))
    for t in np.flatnonzero(lp.dst_rank == rank).tolist():
        ops.append((int(lp.recv_expert[t]), "recv", int(lp.src_rank[t]), t))
    # between two ranks each direction's messages go in ascending expert order on both sides
    ops.sort()
    p2p, keep, landing = [], [], []
    received = 0
    for _e, kind, peer, t in ops:
        for i in range(len(old if kind == "send" else new)):
            if kind == "send":
                src = old[i][int(lp.src_slot[t])]
                src = src if src.is_contiguous() else src.contiguous()
                keep.append(src)
                p2p.append(dist.P2POp(dist.isend, src, peer, group))
            else:
                dst = new[i][int(lp.dst_slot[t])]
                buf = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
                if buf is not dst:
                    landing.append((dst, buf))
                p2p.append(dist.P2POp(dist.irecv, buf, peer, group))
                received += buf.nbytes
    works = dist.batch_isend_irecv(p2p) if p2p else []
    mine = np.flatnonzero(lp.copy_rank == rank)
    for c in mine[~lp.copy_from_new[mine]].tolist():  # old -> new on this rank, no network
        for o, n in zip(old, new):
            n[int(lp.copy_dst[c])].copy_(o[int(lp.copy_src[c])])
    for w in works:
        w.wait()
    for dst, buf in landing:
        dst.copy_(buf)
    for c in mine[lp.copy_from_new[mine]].tolist():  # duplicates of a received expert
        for n in new:
            n[int(lp.copy_dst[c])].copy_(n[int(lp.copy_src[c])])
    del keep
    return received


def execute_resize(rs_plan: ResizePlan, old_weights: list | None, new_weights: list | None,
                   group=None, *, transfer_hook: TransferHook | None = None) -> int:
    """Carry out `rs_plan` on this rank: `old_weights[layer]` are its old slot tensors
    `[S_old, ...]` (None if it was not in the old group; each layer's list is dropped
    once that layer is done), `new_weights[layer]` the freshly allocated `[S_new, ...]`
    ones (None if it is not in the new group). `group`: a process group containing every
    rank of the plan (ops name global ranks). Every such rank must call it. Returns the
    bytes this rank received. `transfer_hook`: see `TransferHook` (tests only)."""
    rank = dist.get_rank()
    received = 0
    for layer, lp in enumerate(rs_plan.layers):
        old = old_weights[layer] if old_weights is not None else None
        new = new_weights[layer] if new_weights is not None else None
        if (old is None and (lp.src_rank == rank).any()) or (
                new is None and ((lp.dst_rank == rank).any() or (lp.copy_rank == rank).any())):
            raise ValueError(f"layer {layer}: rank {rank} has a part in the plan but no "
                             f"{'old' if old is None else 'new'} weights")
        received += _execute_layer(lp, rank, old, new, group)
        if transfer_hook is not None:
            transfer_hook(layer, new)
        if old_weights is not None:
            old_weights[layer] = None  # the old slots of this layer may be freed now
    return received
