"""Planning with a previous placement: keep experts where they are unless moving them
buys balance (`move_tolerance`), and relabel a new plan's GPUs so that experts stay put."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.core.policy.budgets import PREV_ITERS, PREV_WORK, SMALL, iterations
from eplb.core.policy.packing import repair_duplicates
from eplb.core.policy.refinement import improve_max
from eplb.core.policy.rows import argsort_rows, counts_of, gpu_sums, max_load, presence, slot_loads, take
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
    # leftovers: k-th unmatched new GPU takes the k-th free old GPU. A row has as many of
    # each, so the two lists of flat indices in row-major order pair them row by row
    unmatched = match < 0  # [R, m]
    if unmatched.any():
        match.ravel()[np.flatnonzero(unmatched)] = np.flatnonzero(~taken) % m
    # slots inside each GPU: v_of, the old slot of an expert that stays (newcomers: below)
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
    # the k-th newcomer (index order) takes the k-th free slot of its GPU, a stayer its old
    # slot. Every GPU has as many free slots as newcomers (`new` holds an expert once per
    # GPU), so the flat indices of both in row-major order pair them GPU by GPU
    dest = v_of.astype(np.int64)  # [R m, s]
    dest.ravel()[np.flatnonzero(~hit)] = np.flatnonzero(~used[:, 1:]) % s
    dest = dest.reshape(R, m, s)
    dest += match[..., None] * s + (rows * p)[:, None, None]  # [R, m, s] flat slot of the result
    out = np.empty(new.shape, dtype=new.dtype)  # C order: ravel() is a view
    out.ravel()[dest] = E
    if not with_source:
        return out
    source = np.empty(new.shape, dtype=new.dtype)
    source.ravel()[dest] = np.arange(p).reshape(1, m, s)
    return out, source


_SLOT_MAP_MAX = 1 << 20  # align: (row, GPU, expert) entries up to which the old slots go through a map


def transition(w: np.ndarray, old: np.ndarray, c_new: np.ndarray, m: int) -> np.ndarray:
    """Move `old` [R, p] to the replica counts `c_new` [R, n] with one copy per changed
    count and nothing else: every expert with more replicas than c_new frees the slots
    of its replicas on the most loaded GPUs (loads with the new counts), and the missing
    replicas, heaviest first, take the freed slot of the least loaded GPU that does not
    hold their expert (a GPU that holds it only when none is left; such duplicates are
    then repaired by a swap). Every other slot keeps its expert. -> p2l [R, p]."""
    R, p = old.shape
    n = w.shape[1]
    s = p // m
    rows = np.arange(R)
    gpu = np.arange(p) // s
    c_old = counts_of(old, n)  # [R, n]
    piece = w / np.maximum(c_new, 1)  # [R, n] replica load with the new counts
    x = take(piece, old)  # [R, p]
    slot_gpu_load = gpu_sums(x, m)[:, gpu]  # [R, p]
    # free the surplus replicas of every expert, those on the most loaded GPUs first
    order = np.lexsort((-slot_gpu_load, old), axis=-1)  # [R, p] by expert, then GPU load descending
    e_sorted = take(old, order)
    idx = np.broadcast_to(np.arange(p), (R, p))
    start = np.where(np.concatenate([np.ones((R, 1), bool), e_sorted[:, 1:] != e_sorted[:, :-1]], 1), idx, 0)
    rank = idx - np.maximum.accumulate(start, 1)  # [R, p] rank of the replica within its expert
    surplus = np.maximum(c_old - c_new, 0)  # [R, n]
    free = np.zeros((R, p), dtype=bool)
    free[rows[:, None], order] = rank < take(surplus, e_sorted)
    out = old.copy()
    out[free] = -1
    x[free] = 0.0
    load = gpu_sums(x, m)  # [R, m] without the freed slots
    on = presence(np.where(free, old, n), m, n + 1)[..., :n]  # [R, m, n] (n: a freed slot's dummy expert)
    room = free.reshape(R, m, s).sum(-1)  # [R, m] free slots per GPU
    # the missing replicas, heaviest first: [R, K] expert per item, -1 padded
    deficit = np.maximum(c_new - c_old, 0)  # [R, n]
    K = int(deficit.sum(1).max()) if R else 0
    if K == 0:
        return out
    ordr = argsort_rows(piece, descending=True)  # [R, n]
    items = np.full((R, K), -1, dtype=np.int64)
    for r in np.nonzero(deficit.sum(1))[0]:  # rows with a count change (few items each)
        it = np.repeat(ordr[r], deficit[r, ordr[r]])
        items[r, :it.size] = it
    for k in range(K):
        e = items[:, k]  # [R]
        act = e >= 0
        ee = np.maximum(e, 0)
        ok = (room > 0) & ~on[rows, :, ee]  # [R, m]
        anyroom = room > 0
        pick = np.where(ok.any(1)[:, None], np.where(ok, load, np.inf), np.where(anyroom, load, np.inf)).argmin(1)
        r = rows[act]
        g = pick[act]
        slot = g * s + free.reshape(R, m, s)[r, g].argmax(1)  # first free slot of that GPU
        out[r, slot] = e[act]
        free[r, slot] = False
        room[r, g] -= 1
        load[r, g] += piece[r, e[act]]
        on[r, g, e[act]] = True
    return repair_duplicates(w, out, m)


def _move_rows(w, old, scratch, target, m, cap, iters):
    """Rows w [R', n] whose previous placement `old` [R', p] is above its `target` [R']
    max GPU load: two candidates that start from `old`, both improved by max-GPU moves
    (those that fix the most loaded GPU cleanly first: `improve_max(fix=True)`) until
    they reach the target: `old` itself, and `old` moved to the from-scratch replica
    counts of `scratch` [R', p] (`transition`: one copy per changed count, so a drifting
    load costs the copies of its count changes, not a fresh packing). Per row the one
    that reaches the target with fewer moved slots is kept (neither: the lower max GPU
    load; the caller then takes the from-scratch plan). -> [R', p]"""
    n = w.shape[1]
    a, _ = improve_max(w, old, m, cap, target=target, budget=iters, fix=True)  # [R', p]
    b = transition(w, old, counts_of(scratch, n), m)
    b, _ = improve_max(w, b, m, cap, target=target, budget=iters, fix=True)
    la, lb = max_load(w, a, m), max_load(w, b, m)  # [R']
    ma, mb = (a != old).sum(1), (b != old).sum(1)
    va, vb = la <= target, lb <= target
    take_b = (vb & (~va | (mb < ma))) | (~va & ~vb & (lb < la))
    return np.where(take_b[:, None], b, a)


def plan_rows(w: np.ndarray, p: int, m: int, prev: Optional[np.ndarray], tol: float) -> np.ndarray:
    """Placement of rows w [R, n]: from scratch, or from `prev` [R, p] (rows of -1 = no
    previous) with at most (1 + tol) times the from-scratch max GPU load, and (on small
    problems) at most the max GPU load of DeepSeek's own plan of the row. A row within
    that target keeps its previous placement; one above it moves as little as it can to
    reach it (`_move_rows`), else takes the from-scratch plan relabelled towards `prev`."""
    R, n = w.shape
    cap = m
    has_prev = np.zeros(R, dtype=bool) if prev is None else (prev >= 0).all(1)
    if not has_prev.any():
        return solve(w, p, m)
    # the from-scratch plan is the reference (and the fallback); on large problems (more
    # than 8192 slots in all) it gets half the budget so that the moves from the previous
    # placement fit in the rest
    scratch, ref = solve(w, p, m, share=1.0 if R * p <= SMALL else 0.5, with_reference=True)
    r = np.nonzero(has_prev)[0]
    every = r.size == R  # the usual case: no row copies
    old = prev if every else prev[r]
    w_r, scratch_r, ref_r = (w, scratch, ref) if every else (w[r], scratch[r], ref[r])
    # a previous placement may hold more than m replicas of an expert (not placeable without
    # two on one GPU); such rows restart from scratch, only relabelled
    c_old = counts_of(old, n)  # [R', n]
    ok_counts = c_old.max(1) <= cap
    smax = max_load(w_r, scratch_r, m)  # [R'] the from-scratch max GPU load
    # the tolerance, but never above DeepSeek's own from-scratch placement of the same
    # load (known on small problems): under a drifting load a layer kept at the edge of
    # the tolerance would otherwise be worse than re-planning with DeepSeek every time
    target = np.maximum(np.minimum((1.0 + tol) * smax, ref_r), smax) * (1 + 1e-12)
    sel = np.nonzero(ok_counts)[0]
    if sel.size == old.shape[0]:  # the usual case: no row copies
        local = repair_duplicates(w_r, old, m)  # may be `old` itself: copied before writing
    else:
        local = old.copy()
        if sel.size:
            local[sel] = repair_duplicates(w_r[sel], old[sel], m)
    # max GPU load of the previous placement (repairs swap slots, the counts stay c_old)
    top = gpu_sums(slot_loads(w_r, local, c_old), m).max(1)  # [R']
    iters = iterations(PREV_WORK, (sel.size * p) ** 2, PREV_ITERS) if sel.size else 0
    # rows outside the tolerance move; large problems (iters 0): only the rows already
    # within tolerance stay
    rn = sel[top[sel] > target[sel]] if iters > 0 else sel[:0]
    if rn.size:
        local = local.copy()
        local[rn] = _move_rows(w_r[rn], local[rn], scratch_r[rn], target[rn], m, cap, iters)
        top[rn] = max_load(w_r[rn], local[rn], m)  # moves change counts
    reached = ok_counts & (top <= target)  # (repaired rows hold no duplicates)
    miss = np.nonzero(~reached)[0]
    if every and not reached.any():  # every row takes the relabelled plan
        return align(scratch, old, m, n)
    out = scratch.copy()
    out[r[reached]] = local[reached]
    if miss.size:
        out[r[miss]] = align(scratch_r[miss], old[miss], m, n)
    return out
