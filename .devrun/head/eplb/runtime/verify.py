"""Slot checksums and the one comparison every verified move makes.

A move (a rebalance layer, a resize) is verified by comparing what arrived with what its
expert held before the move: `slot_checksums` of the sources before, of the arrivals
after (or of the staged rows before they are written), and `expected_checksums` picks,
for each arrival, the pre-move checksum of its expert's first old slot. The layer mover's
two halves of that: `gather_checksums` (every slot of a layer, before its exchange) and
`check_staged` (the staged rows, before anything is written).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from eplb.core.transfer_plan import LayerTransferPlan, first_slot_of_expert

__all__ = ["TransferVerificationError", "check_staged", "expected_checksums", "gather_checksums",
           "slot_checksums"]


class TransferVerificationError(RuntimeError):
    """A moved slot's checksum differs from its expert's pre-move checksum."""

    def __init__(self, layer: int, bad_slots: list[int], message: str):
        super().__init__(message)
        self.layer = layer
        self.bad_slots = bad_slots  # physical slot ids (of the new placement)


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


def expected_checksums(old_row, old_sums: np.ndarray, experts) -> np.ndarray:
    """`[K]`: for each expert in `experts`, the pre-move checksum (`old_sums [P_old]`, one
    per old slot) of the first old slot holding it in `old_row [P_old]`."""
    first = first_slot_of_expert(old_row)
    return np.asarray(old_sums)[[first[int(e)] for e in np.asarray(experts).tolist()]]


def gather_checksums(weights: Sequence[torch.Tensor], group, num_ranks: int) -> np.ndarray:
    """`[P]` pre-transfer checksums of every slot of a layer, on every rank of `group` (a
    gloo group: no NCCL kernel from a background thread). Collective when `num_ranks > 1`."""
    import torch.distributed as dist

    mine = slot_checksums(weights).cpu()  # [S]
    if num_ranks > 1:
        parts = [torch.empty_like(mine) for _ in range(num_ranks)]
        dist.all_gather(parts, mine, group=group)
        mine = torch.cat(parts)  # [P]
    return mine.numpy()


def check_staged(staging: Sequence[torch.Tensor], plan: LayerTransferPlan, layer: int, rank: int,
                 old_row: np.ndarray, old_sums: np.ndarray) -> None:
    """Every staged row must carry the checksum its expert had in its first old slot
    (`old_row [P]`, `old_sums [P]` from `gather_checksums`); else TransferVerificationError
    naming the slots that would have been written from a bad row."""
    K = plan.num_staged
    if K == 0:
        return
    got = slot_checksums([b[:K] for b in staging]).cpu().numpy()  # [K]
    want = expected_checksums(old_row, old_sums, plan.stage_expert)  # [K]
    bad_rows = np.flatnonzero(got != want)
    if bad_rows.size:
        S = plan.slots_per_rank
        from_bad = plan.write_from_stage & np.isin(plan.write_src, bad_rows)
        bad_slots = (plan.write_dst[from_bad] + rank * S).tolist()
        raise TransferVerificationError(
            layer, bad_slots,
            f"transfer verification failed on layer {layer}, rank {rank}: experts "
            f"{plan.stage_expert[bad_rows].tolist()} arrived with the wrong checksum "
            f"(nothing of the layer was written)")
