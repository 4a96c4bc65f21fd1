"""Slot checksums and the one comparison every verified move makes.

A move (a rebalance layer, a resize) is verified by comparing what arrived with what its
expert held before the move: `slot_checksums` of the sources before, of the arrivals
after (or of the staged rows before they are written), and `expected_checksums` picks,
for each arrival, the pre-move checksum of its expert's first old slot.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from eplb.core.transfer_plan import first_slot_of_expert

__all__ = ["TransferVerificationError", "slot_checksums", "expected_checksums"]


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
