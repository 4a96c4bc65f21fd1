"""Planning with a previous placement: keep experts where they are unless moving them
buys balance (`move_tolerance`), and relabel a new plan's GPUs so that experts stay put."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.policy.budgets import PREV_ITERS, PREV_WORK, SMALL, iterations
from eplb.policy.packing import repair_duplicates
from eplb.policy.refinement import improve_max
from eplb.policy.rows import counts_of, max_load
from eplb.policy.solve import solve


def align(new: np.ndarray, old: np.ndarray, m: int, n: int, rounds: int = 4, with_source: bool = False):
    """Relabel the GPUs of `new` [R, p] (and order the slots inside each GPU) so that as
    many experts as possible stay on the GPU and in the slot that held them in `old`.
    GPU loads are unchanged, only their labels. Greedy matching by proposals: every new
    GPU proposes to the old GPU that held most of its experts (each expert counted on the
    GPU of its first old replica); every old GPU accepts its best proposer; a few rounds;
    the rest are matched in index order. Inside a GPU, an expert that stays keeps its old
    slot and the k-th newcomer takes the k-th free slot. With `with_source`, also returns
    src [R, p]: the slot of `new` that every slot of the result comes from (to carry
    per-slot data such as shares)."""
    R, p = new.shape
    s = p // m
    rows = np.arange(R, dtype=np.int32)
    # ids fit in int32 (n, p <= MAX_SLOTS): half the memory of int64 temporaries
    # old GPU of the first old replica of every expert (experts absent from `old`: -1)
    first = np.full(R * n, -1, dtype=np.int32)
    flat_old = old.astype(np.int32)
    flat_old += (rows * n)[:, None]
    gpu_rev = np.repeat(np.arange(m - 1, -1, -1, dtype=np.int32), s)  # [p] GPU of the slots, reversed
    first[flat_old[:, ::-1]] = gpu_rev  # written last = lowest slot wins (rows do not overlap)
    E = new.reshape(R, m, s)  # [R, m, s]
    Ei = new.astype(np.int32).reshape(R, m, s)
    Ei += (rows * n)[:, None, None]
    cand = first[Ei]  # [R, m, s] candidate old GPU per item
    # ov: how many items of the same new GPU have the same candidate (a bincount); the
    # bin of "no candidate" (cand = -1) counts 0
    base = (rows[:, None] * m + np.arange(m, dtype=np.int32)) * (m + 1) + 1  # [R, m]
    pair_key = cand + base[..., None]  # [R, m, s]
    bins = np.bincount(pair_key.ravel(), minlength=R * m * (m + 1))
    bins[base.ravel() - 1] = 0
    ov = bins[pair_key]  # [R, m, s]
    match = np.full((R, m), -1, dtype=np.int64)  # new GPU -> old GPU
    taken = np.zeros(R * m, dtype=bool)  # old GPU already matched
    row_m = (rows * m)[:, None]  # [R, 1]
    cand_flat = np.maximum(cand, 0)
    cand_flat += row_m[..., None]  # [R, m, s] flat old GPU
    key_g = m - np.arange(m)  # lower new GPU index wins ties
    for _ in range(rounds):
        score = np.where(taken[cand_flat] | (match >= 0)[..., None], 0, ov)  # [R, m, s]
        pick = score.argmax(-1)[..., None]
        best = np.take_along_axis(score, pick, -1)[..., 0]  # [R, m]
        propose = best > 0
        if not propose.any():
            break
        tflat = np.take_along_axis(cand_flat, pick, -1)[..., 0]  # [R, m] flat old GPU
        key = np.where(propose, best * (m + 1) + key_g, -1)  # [R, m] unique per new GPU
        top = np.full(R * m, -1, dtype=np.int64)
        np.maximum.at(top, tflat[propose], key[propose])
        win = propose & (key == top[tflat])
        match[win] = (tflat - row_m)[win]
        taken[tflat[win]] = True
    # leftovers: k-th unmatched new GPU takes the k-th free old GPU
    unmatched = match < 0  # [R, m]
    if unmatched.any():
        free_new = _stable_false_first(~unmatched)  # [R, m] unmatched first
        free_old = _stable_false_first(taken.reshape(R, m))  # free first
        left = np.arange(m)[None, :] < unmatched.sum(1, keepdims=True)
        rr2 = np.broadcast_to(rows[:, None], (R, m))
        match[rr2[left], free_new[left]] = free_old[left]
    # slots inside each GPU: an expert that stays keeps its old slot (v_of), the k-th
    # newcomer of a GPU takes its k-th free slot; loops over the s slots of a GPU
    held = old.reshape(R, m, s)[rows[:, None], match]  # [R, m, s] old content of the matched GPU
    v_of = np.full((R * m, s), -1, dtype=np.int64)  # [R m, s] old slot of new item u, or -1
    E2, held2 = E.reshape(R * m, s), held.reshape(R * m, s)
    for v in range(s):
        v_of[E2 == held2[:, v:v + 1]] = v
    hit = v_of >= 0  # [R m, s]
    used = np.zeros(R * m * s, dtype=bool)  # old slot kept by its expert
    used[(np.arange(0, R * m * s, s)[:, None] + v_of)[hit]] = True
    used = used.reshape(R * m, s)
    free = _stable_false_first(used)  # [R m, s] free slots first
    # the k-th newcomer (index order) takes the k-th free slot, a stayer its old slot
    mover_rank = np.cumsum(~hit, axis=1)  # [R m, s] 1-based among newcomers
    mover_rank -= 1
    np.maximum(mover_rank, 0, out=mover_rank)
    dest = np.where(hit, v_of, np.take_along_axis(free, mover_rank, 1)).reshape(R, m, s)
    dest += match[..., None] * s  # [R, m, s] slot of the result
    out = np.empty_like(new)
    where = (rows[:, None, None], dest)
    out[where] = E
    if not with_source:
        return out
    source = np.empty_like(new)
    source[where] = np.arange(p).reshape(1, m, s)
    return out, source


def _stable_false_first(b: np.ndarray) -> np.ndarray:
    """Per row of the bool array b [R, X], the indices of the False entries in order, then
    those of the True entries in order: a stable argsort of b. [R, X] -> [R, X]."""
    X = b.shape[1]
    ib = max(1, int(X).bit_length())
    key = (b.astype(np.int64) << ib) | np.arange(X, dtype=np.int64)
    return np.sort(key, axis=1) & ((1 << ib) - 1)


def plan_rows(w: np.ndarray, p: int, m: int, prev: Optional[np.ndarray], tol: float) -> np.ndarray:
    """Placement of rows w [R, n]: from scratch, or from `prev` [R, p] (rows of -1 = no
    previous) with at most (1 + tol) times the from-scratch max GPU load."""
    R, n = w.shape
    cap = m
    has_prev = np.zeros(R, dtype=bool) if prev is None else (prev >= 0).all(1)
    if not has_prev.any():
        return solve(w, p, m)
    # the from-scratch plan is the reference (and the fallback); on large problems (more
    # than 8192 slots in all) it gets half the budget so that the moves from the previous
    # placement fit in the rest
    scratch = solve(w, p, m, share=1.0 if R * p <= SMALL else 0.5)
    out = scratch.copy()
    r = np.nonzero(has_prev)[0]
    old = prev[r]
    # a previous placement may hold more than m replicas of an expert (not placeable without
    # two on one GPU); such rows restart from scratch, only relabelled
    ok_counts = counts_of(old, n).max(1) <= cap
    target = (1.0 + tol) * max_load(w[r], scratch[r], m) * (1 + 1e-12)
    local = old.copy()
    sel = np.nonzero(ok_counts)[0]
    if sel.size:
        local[sel] = repair_duplicates(w[r[sel]], old[sel], m)
        iters = iterations(PREV_WORK, (sel.size * p) ** 2, PREV_ITERS)
        if iters > 0:  # large problems: only the layers already within tolerance stay
            local[sel], _ = improve_max(w[r[sel]], local[sel], m, cap, target=target[sel], budget=iters)
    reached = ok_counts & (max_load(w[r], local, m) <= target)  # (repaired rows hold no duplicates)
    out[r[reached]] = local[reached]
    miss = np.nonzero(~reached)[0]
    if miss.size:
        out[r[miss]] = align(scratch[r[miss]], old[miss], m, n)
    return out
