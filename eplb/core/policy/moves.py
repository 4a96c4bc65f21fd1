"""Planning with a previous placement: keep experts where they are unless moving them
buys balance (`move_tolerance`), and relabel a new plan's GPUs so that experts stay put."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.core.policy.budgets import PREV_ITERS, PREV_WORK, SMALL, iterations
from eplb.core.policy.packing import repair_duplicates
from eplb.core.policy.refinement import improve_max
from eplb.core.policy.rows import counts_of, max_load
from eplb.core.policy.solve import solve


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
    match = np.full(R * m, -1, dtype=np.int64)  # new GPU -> old GPU, flat [r * m + g]
    taken = np.zeros(R * m, dtype=bool)  # old GPU already matched
    row_m = (rows * m)[:, None]  # [R, 1]
    cand_flat = np.maximum(cand, 0)
    cand_flat += row_m[..., None]  # [R, m, s] flat old GPU
    # every round works on the new GPUs still proposing: a matched GPU, or one whose best
    # score was 0 (scores only drop as old GPUs are taken), never proposes again
    live = np.arange(R * m)  # [U] flat new GPU
    c_live = cand_flat.reshape(R * m, s)  # [U, s]
    ov_live = ov.reshape(R * m, s)
    key_live = np.tile(m - np.arange(m), R)  # [U] lower new GPU index wins ties
    top = np.full(R * m, -1, dtype=np.int64)
    for _ in range(rounds):
        score = np.where(taken[c_live], 0, ov_live)  # [U, s]
        pick = score.argmax(1)
        u = np.arange(live.size)
        best = score[u, pick]  # [U]
        propose = best > 0
        if not propose.any():
            break
        tflat = c_live[u, pick]  # [U] flat old GPU
        key = best * (m + 1) + key_live  # [U] unique per new GPU
        top[tflat[propose]] = -1
        np.maximum.at(top, tflat[propose], key[propose])
        win = propose & (key == top[tflat])
        match[live[win]] = tflat[win] - live[win] // m * m
        taken[tflat[win]] = True
        stay = propose & ~win
        live, c_live, ov_live, key_live = live[stay], c_live[stay], ov_live[stay], key_live[stay]
        if live.size == 0:
            break
    match = match.reshape(R, m)
    # leftovers: k-th unmatched new GPU takes the k-th free old GPU
    unmatched = match < 0  # [R, m]
    if unmatched.any():
        free_new = _stable_false_first(~unmatched)  # [R, m] unmatched first
        free_old = _stable_false_first(taken.reshape(R, m))  # free first
        left = np.arange(m)[None, :] < unmatched.sum(1, keepdims=True)
        rr2 = np.broadcast_to(rows[:, None], (R, m))
        match[rr2[left], free_new[left]] = free_old[left]
    # slots inside each GPU: an expert that stays keeps its old slot (v_of), the k-th
    # newcomer of a GPU takes its k-th free slot
    if R * m * n <= _SLOT_MAP_MAX:
        # slot_of[(r, old GPU, expert)]: the last slot of that GPU holding the expert, or -1
        slot_dtype = np.int8 if s <= 127 else np.int32  # a slot inside a GPU; 1 byte when it fits
        slot_of = np.full(R * m * n, -1, dtype=slot_dtype)
        old_key = old.reshape(R, m, s) + ((rows[:, None] * m + np.arange(m, dtype=np.int32)) * n)[..., None]
        slot_of[old_key.ravel()] = np.tile(np.arange(s, dtype=slot_dtype), R * m)  # last write = highest slot
        new_key = E + ((rows[:, None] * m + match) * n)[..., None]  # [R, m, s] (r, matched old GPU, expert)
        v_of = slot_of[new_key].reshape(R * m, s)  # [R m, s] old slot of new item u, or -1
    else:  # many GPUs and experts, few slots per GPU: s comparison passes cost less than the map
        held = old.reshape(R, m, s)[rows[:, None], match].reshape(R * m, s)  # old content of the matched GPU
        v_of = np.full((R * m, s), -1, dtype=np.int64)
        E2 = E.reshape(R * m, s)
        for v in range(s):
            v_of[E2 == held[:, v:v + 1]] = v
    hit = v_of >= 0  # [R m, s]
    # old slots kept by their expert; a newcomer (v_of = -1) marks the extra column 0
    used = np.zeros((R * m, s + 1), dtype=bool)
    used.ravel()[v_of + np.arange(1, R * m * (s + 1), s + 1)[:, None]] = True
    free = _stable_false_first(used[:, 1:])  # [R m, s] free slots first
    # the k-th newcomer (index order) takes the k-th free slot, a stayer its old slot
    # 1-based rank among the GPU's newcomers, from one flat running count (a cumsum along
    # the short rows is slow), made a flat index into free
    mover_rank = np.cumsum(~hit.ravel()).reshape(R * m, s)  # [R m, s]
    row_base = np.empty(R * m, dtype=mover_rank.dtype)  # newcomers of the earlier GPUs
    row_base[0] = 0
    row_base[1:] = mover_rank[:-1, -1]
    row_base -= np.arange(-1, R * m * s - 1, s)
    mover_rank -= row_base[:, None]
    np.maximum(mover_rank, 0, out=mover_rank)
    dest = np.where(hit, v_of, free.ravel()[mover_rank]).reshape(R, m, s)
    dest += match[..., None] * s + (rows * p)[:, None, None]  # [R, m, s] flat slot of the result
    out = np.empty(new.shape, dtype=new.dtype)  # C order: ravel() is a view
    out.ravel()[dest] = E
    if not with_source:
        return out
    source = np.empty(new.shape, dtype=new.dtype)
    source.ravel()[dest] = np.arange(p).reshape(1, m, s)
    return out, source


_SLOT_MAP_MAX = 1 << 20  # align: (row, GPU, expert) entries up to which the old slots go through a map


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
    r = np.nonzero(has_prev)[0]
    every = r.size == R  # the usual case: no row copies
    old = prev if every else prev[r]
    w_r, scratch_r = (w, scratch) if every else (w[r], scratch[r])
    # a previous placement may hold more than m replicas of an expert (not placeable without
    # two on one GPU); such rows restart from scratch, only relabelled
    ok_counts = counts_of(old, n).max(1) <= cap
    target = (1.0 + tol) * max_load(w_r, scratch_r, m) * (1 + 1e-12)
    local = old.copy()
    sel = np.nonzero(ok_counts)[0]
    if sel.size:
        local[sel] = repair_duplicates(w_r[sel], old[sel], m)
        iters = iterations(PREV_WORK, (sel.size * p) ** 2, PREV_ITERS)
        if iters > 0:  # large problems: only the layers already within tolerance stay
            local[sel], _ = improve_max(w_r[sel], local[sel], m, cap, target=target[sel], budget=iters)
    reached = ok_counts & (max_load(w_r, local, m) <= target)  # (repaired rows hold no duplicates)
    miss = np.nonzero(~reached)[0]
    if every and not reached.any():  # every row takes the relabelled plan
        return align(scratch, old, m, n)
    out = scratch.copy()
    out[r[reached]] = local[reached]
    if miss.size:
        out[r[miss]] = align(scratch_r[miss], old[miss], m, n)
    return out
