"""A transformers `*Experts` module's math on rows already sorted by local slot.

transformers' `grouped_mm` experts forward (its default `experts_implementation`) sorts
the (token, k) rows by expert, runs two grouped GEMMs and unsorts them. Our dispatch has
already sorted the rows by slot (and knows each slot's row offsets), so calling that
forward would sort and gather every row a second time. `SortedExperts.__call__` is the
same computation from the sorted rows on: the same grouped GEMM op on the same operands,
the module's own gate (`_apply_gate`), biases and post-expert norm, so its output equals
transformers' row for row (bitwise on the same device).

It applies to modules built by transformers' `use_experts_implementation` decorator
(they carry `has_gate`, `has_bias`, `is_transposed` and `_apply_gate`) whose config asks
for "grouped_mm"; any other implementation ("eager", "batched_mm", kernels) keeps the
module's own forward.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_FLAGS = ("has_gate", "has_bias", "is_transposed", "_apply_gate")


def sorted_rows_apply(module: nn.Module) -> bool:
    """True when `SortedExperts` computes `module`'s own forward: a transformers
    decorated experts module configured for "grouped_mm"."""
    config = getattr(module, "config", None)
    return (getattr(config, "_experts_implementation", None) == "grouped_mm"
            and all(hasattr(module, a) for a in _FLAGS))


def _slot_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:  # [rows] int64
    """Local slot of each sorted row from the end offsets [S] (rows past the last
    offset, "fixed" dispatch padding, get slot S - 1; nothing reads them)."""
    index = torch.arange(rows, device=offsets.device)  # [rows]
    slot = torch.searchsorted(offsets, index.to(offsets.dtype), right=True)  # [rows]
    return slot.clamp_(max=offsets.numel() - 1)


def _loop_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference grouped GEMM: x [T', in] sorted by slot, weight [S, in, out], offsets [S]
    -> [T', out]; one host sync (the offsets), one `mm` per non-empty slot."""
    out = x.new_zeros(x.shape[0], weight.shape[2])  # [T', out]
    start = 0
    for s, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[s], out=out[start:end])
        start = end
    return out


class SortedExperts:
    """One module's "grouped_mm" experts math on rows sorted by local slot (`__call__`),
    with its GEMM path: the grouped GEMM op, or (where the op refuses the inputs, e.g.
    CPU strides that are no multiple of 16 bytes) the per-slot loop from then on, with
    one warning."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name
        self.use_grouped_mm = _GROUPED_MM is not None

    def _mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [T', in] sorted by slot, weight [S, in, out] -> [T', out]."""
        x = x.to(weight.dtype)
        if self.use_grouped_mm:
            try:
                return _GROUPED_MM(x, weight, offs=offsets)
            except RuntimeError as e:
                if torch.compiler.is_compiling():
                    raise
                log.warning("%s: grouped GEMM refused the inputs (%s); using the per-slot "
                            "loop (one host sync per layer) from now on", self.name, e)
                self.use_grouped_mm = False
        return _loop_mm(x, weight, offsets)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                bias: torch.Tensor | None, slot: torch.Tensor | None) -> torch.Tensor:
        """x [T', in] @ each slot's weight (stored [S, out, in], or [S, in, out] when
        `is_transposed`) + that slot's bias row -> [T', out]."""
        w = weight if self.module.is_transposed else weight.transpose(-2, -1)  # [S, in, out]
        out = self._mm(x, w, offsets)
        if bias is not None:
            out.add_(bias[slot])  # [T', out]
        return out

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [T', H] rows sorted by local slot, offsets [S] int32 end row of each slot
        -> [T', H], one row per input row, no gate weight applied."""
        m = self.module
        slot = _slot_of_rows(offsets, x.shape[0]) if m.has_bias else None  # [T']
        up_w = m.gate_up_proj if m.has_gate else m.up_proj
        up_b = (m.gate_up_proj_bias if m.has_gate else m.up_proj_bias) if m.has_bias else None
        h = self._linear(x, up_w, offsets, up_b, slot)  # [T', 2I] or [T', I]
        h = m._apply_gate(h) if m.has_gate else m.act_fn(h)  # [T', I]
        out = self._linear(h, m.down_proj, offsets, m.down_proj_bias if m.has_bias else None,
                           slot)  # [T', H]
        if getattr(m, "has_post_expert_norm", False):
            out = m.post_expert_norm(out)
        return out
