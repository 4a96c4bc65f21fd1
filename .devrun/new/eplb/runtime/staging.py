"""One layer's staging buffer and the slot copies into and out of it, what every transport
and the layer mover build on: `allocate_staging` and its checks, `copy_runs` (one `copy_`
per run of consecutive slots), `write_layer` (staging into the changed slots: the default
`Transport.write`), and `StagingCache`, the one staging buffer a mover's owner keeps.

Shapes: `weights` is one layer's local expert tensors, each `[S, ...]`; `staging` one
contiguous `[>= plan.num_staged, ...]` buffer per weight tensor, same dtype and device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from eplb.core.transfer_plan import LayerTransferPlan

if TYPE_CHECKING:
    from eplb.runtime.transport_base import Transport

__all__ = ["StagingCache", "allocate_staging", "check_staging", "check_weights", "copy_runs",
           "staging_rows", "write_layer"]


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


class StagingCache:
    """The one staging buffer of a mover's owner: one layer of local experts, reused
    across layers (and across changes with `keep`); the IPC transport's hold buffer when
    it fits the weights (allocated once by the transport, so a change adds no memory)."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._buf: list[torch.Tensor] | None = None

    def get(self, transport: Transport, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        hold = transport.hold
        if hold is not None and _fits(hold, weights):
            return list(hold)
        if self._buf is None or not _fits(self._buf, weights):
            self._buf = allocate_staging(weights)
        return self._buf

    def done(self) -> None:
        """A change finished: free the buffer unless it is kept."""
        if not self.keep:
            self._buf = None

    def release(self) -> None:
        self._buf = None


def _fits(buf: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> bool:
    return len(buf) == len(weights) and all(
        b.shape == w.shape and b.dtype == w.dtype and b.device == w.device
        for b, w in zip(buf, weights))
