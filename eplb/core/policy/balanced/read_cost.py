"""The cost model of the decode-aware pass (`reads`): what one slot costs in a step.

A slot expecting `lam` tokens per step (Poisson, X) costs `lam` tokens of work plus
`read_tokens` per weight read, one read per tile of `tile_rows` of its tokens
(`expected_tiles`: E[ceil(X / tile_rows)]; tile_rows 0: one read when it gets any token).
A placement's cost is its costliest GPU's sum (`layer_cost`); the fresh plan of a load,
DeepSeek's replica counts packed for tokens (`solve.fresh_packing`, the first step of a
from-scratch plan: DeepSeek's own plan at the cost of a packing, where DeepSeek's code
takes 20-110 ms at the DeepSeek-V3 shape), is what `reads` holds a kept layout against,
its per-expert figures kept (`Reference`) so that the pass reuses them wherever its counts
are the same (`slot_figures`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from eplb.core.policy.base import DEFAULT_TILE_ROWS
from eplb.core.policy.balanced.rows import counts_of, gpu_sums, take


class Reference(NamedTuple):
    """A placement's cost per layer as the pass counts it (`layer_cost`): for the fresh
    plan, what a kept layout is held against (`reads.spread_reads`)."""
    cost: np.ndarray  # [L] the largest GPU cost
    tokens: np.ndarray  # [L] the busiest GPU's tokens per step
    counts: np.ndarray  # [L, n] replica counts
    slot_cost: np.ndarray  # [L, n] one slot's cost of each expert at these counts (`per_slot`)
    slot_tokens: np.ndarray  # [L, n] ... and its tokens per step


def layer_cost(w: np.ndarray, p2l: np.ndarray, m: int, step_choices: float, read_tokens: float,
               tile_rows: float = DEFAULT_TILE_ROWS, counts: np.ndarray | None = None) -> Reference:
    """The largest GPU cost (tokens plus weight reads, as the pass counts them) and the
    busiest GPU's tokens per step [L] of each layer's placement p2l [L, P] on m GPUs, for
    loads w [L, n], with what they came from (`Reference`). counts [L, n]: p2l's replica
    counts, when known."""
    c = counts_of(p2l, w.shape[1]) if counts is None else counts  # [L, n]
    cost, lam = per_slot(expert_tokens(w, step_choices), c, read_tokens, tile_rows)  # [L, n]
    return Reference(gpu_sums(take(cost, p2l), m).max(1), gpu_sums(take(lam, p2l), m).max(1), c, cost, lam)


def expert_tokens(w: np.ndarray, step_choices: float) -> np.ndarray:
    """[L, n] tokens per step of each expert: its share of its layer's load w [L, n] of the
    `step_choices` token-expert choices (0 for an all-zero layer)."""
    total = w.sum(1, keepdims=True)  # [L, 1]
    return np.divide(w * step_choices, total, out=np.zeros(w.shape), where=total > 0)


def expected_tiles(lam: np.ndarray, tile_rows: float) -> np.ndarray:
    """E[ceil(X / tile_rows)] for X ~ Poisson(lam): the weight reads of a slot expecting
    `lam` tokens per step, one per tile of `tile_rows` rows (0: one per non-empty slot,
    P(X >= 1)). The tiles past the first, P(X > k tile_rows) for k >= 1, use the normal
    approximation of the Poisson tail (with continuity correction), close where it matters
    (lam near a multiple of tile_rows, tens of tokens or more); terms more than `_TAIL`
    standard deviations away are 1 or 0, so only the few in between are computed."""
    out = np.negative(lam, order="C")  # (C order: `reshape(-1)` below is a view)
    np.expm1(out, out=out)
    np.negative(out, out=out)  # P(X >= 1)
    if tile_rows <= 0 or lam.size == 0:
        return out
    # slots that may need a second tile: lam + _TAIL sqrt(lam) + 0.5 >= tile_rows, tested
    # on the few slots near or above the root of that sum (a tenth below it, for rounding)
    root = (np.sqrt(_TAIL ** 2 / 4 + tile_rows - 0.5) - _TAIL / 2) ** 2
    i = np.flatnonzero(lam >= 0.9 * root)
    li = lam.reshape(-1)[i]  # (1-D fancy indexing: 2x faster than `.flat`)
    si = np.sqrt(li)
    near = li + _TAIL * si + 0.5 >= tile_rows
    if not near.all():
        i, li, si = i[near], li[near], si[near]
    if i.size == 0:
        return out
    first = np.maximum(1, np.floor((li - _TAIL * si - 0.5) / tile_rows) + 1)  # [K] first k not surely 1
    last = np.floor((li + _TAIL * si) / tile_rows)  # [K] last k not surely 0
    extra = first - 1  # the terms that are 1
    for j in range(int((last - first).max()) + 1):
        on = np.flatnonzero(first + j <= last)  # the slots with a j-th term in between
        k, lo, so = first[on] + j, li[on], si[on]
        extra[on] += 0.5 * erfc((k * tile_rows + 0.5 - lo) / (np.sqrt(2.0) * np.maximum(so, 1e-12)))
    out.reshape(-1)[i] += extra
    return out


_TAIL = 8.0  # expected_tiles: standard deviations beyond which a tile's term is 0 or 1


def erfc(x: np.ndarray) -> np.ndarray:
    """The complementary error function, elementwise (numpy has none): torch's
    `special.erfc` on a float64 copy of x (correct to double precision)."""
    return torch.special.erfc(torch.from_numpy(np.array(x, dtype=np.float64))).numpy()


def per_slot(lam_e: np.ndarray, c: np.ndarray, read_tokens: float, tile_rows: float,
             lam: np.ndarray | None = None):
    """(cost, tokens) [R, n] of one slot of each expert with `c` replicas: tokens per step
    `lam_e / c` plus `read_tokens` per expected weight read (`expected_tiles`); lam: those
    tokens, when the caller has them."""
    lam = lam_e / np.maximum(c, 1) if lam is None else lam
    return lam + read_tokens * expected_tiles(lam, tile_rows), lam


def slot_figures(lam_e: np.ndarray, c: np.ndarray, reference: Reference | None, lays: np.ndarray,
                 read_tokens: float, tile_rows: float, lam: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`per_slot(lam_e, c, ...)` [J, n] for rows of the layers `lays` [J], taken from the
    reference where a row has its replica counts (the same numbers: costed per element;
    at 128 tokens per GPU `expected_tiles` takes 0.24 ms at the DeepSeek-V3 shape). lam
    [J, n]: `lam_e / max(c, 1)`, when the caller has it."""
    same = np.zeros(len(c), dtype=bool) if reference is None else (c == reference.counts[lays]).all(1)  # [J]
    if not same.any():
        return per_slot(lam_e, c, read_tokens, tile_rows, lam)
    cost, lam = reference.slot_cost[lays], reference.slot_tokens[lays]  # [J, n] copies (fancy indexing)
    if not same.all():
        cost[~same], lam[~same] = per_slot(lam_e[~same], c[~same], read_tokens, tile_rows)
    return cost, lam
