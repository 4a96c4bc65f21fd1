"""Planning with a previous placement: keep experts where they are unless moving them
buys balance (`move_tolerance`), and relabel a new plan's GPUs so that experts stay put."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.core.policy.balanced.budgets import PREV_ITERS, PREV_WORK, SMALL, iterations
from eplb.core.policy.balanced.packing import repair_duplicates
from eplb.core.policy.balanced.refinement import improve_max
from eplb.core.policy.balanced.rows import argsort_rows, counts_of, gpu_sums, presence, slot_loads, take
from eplb.core.policy.balanced.solve import solve

# A row keeps its replica counts only while its heaviest replica carries at most
# (1 + HEAVY_TOLERANCE) times the tokens of the from-scratch plan's heaviest replica, or
# fewer than HEAVY_ROWS tokens per step (known when the planner is told the tokens per
# step: `PolicyOptions.step_choices`). GPU token totals alone let a kept layout leave a
# hot expert with too few replicas: on an H100, a prefill grouped GEMM of Qwen3-235B's
# experts (about 33,000 rows in all) ran 4.5% above its fitted time (median) when its
# largest group held 14,000 rows or more, and 0.8% below it with 4,000-6,000; such
# layouts lost 1% to deepseek there (EP 8-16 steady loads; benchmarks/README.md, issue
# 29, 2026-12-05 (sixth)).
HEAVY_TOLERANCE = 0.5
HEAVY_ROWS = 8192


def heaviest(w: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """Tokens of the heaviest replica of each row [R] (even split): w [R, n], p2l [R, p]."""
    return slot_loads(w, p2l, counts_of(p2l, w.shape[1])).max(1)


def load_and_heaviest(w: np.ndarray, p2l: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(max GPU load [R], bit for bit `rows.max_load`, and the heaviest replica [R]) of
    p2l [R, p] on m GPUs, from one pass over its slot loads."""
    x = slot_loads(w, p2l, counts_of(p2l, w.shape[1]))  # [R, p]
    return gpu_sums(x, m).max(1), x.max(1)


def align(new: np.ndarray, old: np.ndarray, m: int, n: int, rounds: int = 4, with_source: bool = False):
    """Relabel the GPUs of `new` [R, p] (and order the slots inside each GPU) so that as
    many experts as possible stay on the GPU and in the slot that held them in `old`.
    GPU loads are unchanged, only their labels. Greedy matching by proposals: every new
    GPU proposes to the old GPU that held most of its experts (each expert counted on the
    GPU of its first old replica); every old GPU accepts its best proposer; a few rounds;
    the rest are matched in index order. Inside a GPU, an expert that stays keeps its old
    slot and the k-th newcomer takes the k-th free slot. With `with_source`, also returns
    src [R, p]: the slot of `new` that every slot of the result comes from (to carry
    per-slot data such as shares).

    Items are kept slot-major, [s, U] (U = R m GPUs, flat u = r m + g): passes over the s
    slots of a GPU then run on long contiguous rows, and no temporary is larger than the
    R p items except the (row, GPU, expert) slot map."""
    R, p = new.shape
    s = p // m
    U = R * m
    rows = np.arange(R, dtype=np.int32)
    new_t = new.reshape(U, s).T  # [s, U] view
    # (row, expert) keys r n + e: intp for the scatter into `first` (numpy's fast path for
    # fancy indexing), int32 for the items of `new` (ids fit in int32: n, p <= MAX_SLOTS;
    # np.take casts them)
    key_old = np.add(old, (rows * n)[:, None], dtype=np.intp)  # [R, p]
    key_new = new_t.astype(np.int32, order="C")
    key_new += np.repeat(rows * n, m)  # [s, U]
    # cand: flat old GPU r m + g of the first old replica of every item's expert (absent: U)
    first = np.full(R * n, U, dtype=np.int32)
    first[key_old.ravel()[::-1]] = np.repeat(np.arange(U - 1, -1, -1, dtype=np.int32), s)  # written last = lowest slot wins
    cand = np.take(first, key_new)  # [s, U]
    # ov: how many items of the same new GPU have the same candidate; an item without
    # candidate counts 0. Each pair of slots (j, j + d) is compared once (s - 1 shifted
    # passes) and counts for both. The int8 passes add a mask viewed as int8 (0/1): adding
    # the bool mask itself would go through a buffered cast
    small = s <= 127
    ov = np.ones((s, U), dtype=np.int8 if small else np.int64)  # every item counts itself
    for d in range(1, s):
        eq = cand[d:] == cand[:-d]  # [s - d, U] slot j + d vs slot j
        eq = eq.view(np.int8) if small else eq
        ov[d:] += eq
        ov[:-d] += eq
    ov *= cand < U
    # an item's proposal key, maximal over its GPU for the proposal: its overlap, then the
    # lower slot (as argmax: the first maximum), then its candidate in the low bits (bit
    # fields, so that shifts and masks take them apart); int32 when the fields fit (they do
    # at the usual shapes: half the bytes of every round's passes)
    c_bits = int(U).bit_length()  # cand in 0..U
    c_mask = (1 << c_bits) - 1
    o_shift = c_bits + int(s - 1).bit_length()  # above the slot field (rev in 0..s-1)
    key_dtype = np.int32 if o_shift + int(s).bit_length() <= 31 else np.int64  # ov in 0..s
    okey = ov.astype(key_dtype)
    okey <<= o_shift
    okey |= np.arange(s - 1, -1, -1, dtype=key_dtype)[:, None] << c_bits  # rev: lower slot first
    okey |= cand  # [s, U]
    # an item whose candidate is taken scores as if it had none: overlap 0, candidate U. Its
    # own slot field then only matters when nothing of its GPU is left: the max is then
    # `floor`, slot 0 with candidate U, which every available item's key is at least. So a
    # round takes the max of the keys of the available items (others 0) and `floor`
    floor = ((s - 1) << c_bits) | U
    match = np.full(U, -1, dtype=np.int64)  # new GPU -> flat old GPU r m + g'
    avail = np.ones(U + 1, dtype=bool)  # old GPU not matched yet (U: none, never matched)
    # every old GPU is proposed to in one round at most (it then takes its best proposer),
    # so `top` needs no reset between rounds
    top = np.full(U + 1, -1, dtype=np.int32)
    # every round works on the new GPUs still proposing: a matched GPU, or one whose best
    # score was 0 (scores only drop as old GPUs are taken), never proposes again
    live = np.arange(U)  # [U'] flat new GPU
    tie = np.empty((R, m), dtype=np.int32)
    tie[:] = np.arange(m, 0, -1, dtype=np.int32)
    tie = tie.ravel()  # [U'] m - g: the lower new GPU wins ties
    k_live = okey  # [s, U']
    for rnd in range(rounds):
        if rnd == 0:  # nothing taken yet
            smax = k_live.max(0)  # [U']
        else:  # (a product, not np.where: where is slow on mixed masks)
            smax = np.maximum((k_live * np.take(avail, k_live & c_mask)).max(0), floor)
        best = (smax >> o_shift).astype(np.int32)  # [U'] best overlap
        tflat = smax & c_mask  # [U'] flat old GPU proposed to (U: no proposal)
        key = best * (m + 1) + tie  # [U'] unique per new GPU
        np.maximum.at(top, tflat, key)
        top[U] = -1  # the non-proposers' dummy: nobody wins it
        win = key == top[tflat]  # [U']
        w = np.flatnonzero(win)
        if w.size == 0:  # no proposal
            break
        tw = tflat[w]
        match[live[w]] = tw
        avail[tw] = False
        stay = np.flatnonzero((tflat < U) ^ win)  # proposed, not accepted
        # (np.take along axis 1: much faster than k_live[:, stay])
        live, tie, k_live = live[stay], tie[stay], np.take(k_live, stay, axis=1)
        if live.size == 0:
            break
    # leftovers: k-th unmatched new GPU takes the k-th free old GPU. A row has as many of
    # each, so the two lists of flat indices in row-major order pair them row by row
    unmatched = match < 0  # [U]
    if unmatched.any():
        match[unmatched] = np.flatnonzero(avail[:U])
    # slots inside each GPU: v_of, the old slot of an expert that stays (the last slot of
    # its matched old GPU holding it; newcomers -1)
    slot_dtype = np.int8 if s <= 127 else np.int32  # a slot inside a GPU; 1 byte when it fits
    if U * n <= _SLOT_MAP_MAX:
        # slot_of[(old GPU, expert)]: the last slot of that GPU holding the expert, or -1
        slot_of = np.full(U * n, -1, dtype=slot_dtype)
        old_key = old.reshape(U, s) + (np.arange(U) * n)[:, None]
        slot_of[old_key.ravel()] = np.tile(np.arange(s, dtype=slot_dtype), U)  # last write = highest slot
        v_of = np.take(slot_of, np.add(new_t, match * n, order="C"))  # [s, U]
    else:  # many GPUs and experts, few slots per GPU: s comparison passes cost less than the map
        # [s, U] old content of the matched GPU, int32 like key_new (a mixed compare casts);
        # whole GPUs gathered first (contiguous rows), then slot-major
        held = key_old.reshape(U, s).take(match, axis=0).T.astype(np.int32, order="C")
        v_of = np.full((s, U), -1, dtype=slot_dtype)
        for v in range(s):
            np.copyto(v_of, v, where=key_new == held[v])  # last write = highest slot
    # fc[t]: free old slots among 0..t of the matched GPU (not kept by a stayer)  [s, U]
    fc = np.empty((s, U), dtype=slot_dtype)
    run = np.zeros(U, dtype=slot_dtype)
    for t in range(s):
        free = ~(v_of == t).any(0)  # [U]
        run += free.view(np.int8) if small else free
        fc[t] = run
    # the k-th newcomer (1-based, in slot order) takes the k-th free slot: the number of
    # slots t with fc[t] < k. Every GPU has as many free slots as newcomers (`new` holds
    # an expert once per GPU)
    newcomer = v_of < 0
    q = np.empty((s, U), dtype=slot_dtype)  # newcomers among slots 0..j
    q[0] = newcomer[0]
    for j in range(1, s):
        np.add(q[j - 1], newcomer[j], out=q[j])
    if not np.array_equal(q[s - 1], fc[s - 1]):  # two stayers of one GPU on one old slot
        raise ValueError("align: a GPU of `new` holds an expert twice")
    q *= newcomer  # [s, U] newcomer rank, 0 for a stayer
    slot = np.maximum(v_of, 0)
    for t in range(s):
        before = fc[t] < q  # [s, U]
        slot += before.view(np.int8) if small else before
    # flat slot of the result. Few slots per GPU: slot-major [s, U] (a GPU-major cast of
    # `slot` would run s-long inner loops); else GPU-major [U, s] like `new` (a C-order
    # index and values: numpy's fast scatter)
    out = np.empty(new.shape, dtype=new.dtype)  # C order: ravel() is a view
    if s <= 4:
        dest_t = np.add(slot, match * s)  # [s, U] intp
        out.ravel()[dest_t] = new_t
        dest = dest_t.T  # [U, s] view
    else:
        dest = slot.T.astype(np.intp, order="C")  # [U, s]
        dest += (match * s)[:, None]
        out.ravel()[dest] = new.reshape(U, s)
    if not with_source:
        return out
    source = np.empty(new.shape, dtype=new.dtype)
    source.ravel()[dest.reshape(R, m, s)] = np.arange(p).reshape(m, s)
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


def _move_rows(w, old, scratch, target, heavy_target, m, cap, iters):
    """Rows w [R', n] whose previous placement `old` [R', p] is above its `target` [R']
    max GPU load or its `heavy_target` [R'] heaviest replica: two candidates that start
    from `old`, both improved by max-GPU moves (those that fix the most loaded GPU cleanly
    first: `improve_max(fix=True)`) until they reach the target: `old` itself, and `old`
    moved to the from-scratch replica counts of `scratch` [R', p] (`transition`: one copy
    per changed count, so a drifting load costs the copies of its count changes, not a
    fresh packing). Per row the one that reaches both targets with fewer moved slots is
    kept (neither: the lower max GPU load; the caller then takes the from-scratch plan).
    -> [R', p]"""
    n = w.shape[1]
    a, _ = improve_max(w, old, m, cap, target=target, budget=iters, fix=True)  # [R', p]
    b = transition(w, old, counts_of(scratch, n), m)
    b, _ = improve_max(w, b, m, cap, target=target, budget=iters, fix=True)
    (la, ha), (lb, hb) = load_and_heaviest(w, a, m), load_and_heaviest(w, b, m)  # [R'] each
    ma, mb = (a != old).sum(1), (b != old).sum(1)
    va = (la <= target) & (ha <= heavy_target)
    vb = (lb <= target) & (hb <= heavy_target)
    take_b = (vb & (~va | (mb < ma))) | (~va & ~vb & (lb < la))
    return np.where(take_b[:, None], b, a)


def plan_rows(w: np.ndarray, p: int, m: int, prev: Optional[np.ndarray], tol: float,
              heavy: Optional[np.ndarray] = None, fresh: Optional[tuple] = None) -> np.ndarray:
    """Placement of rows w [R, n]: from scratch, or from `prev` [R, p] (rows of -1 = no
    previous) with at most (1 + tol) times the from-scratch max GPU load, and (on small
    problems) at most the max GPU load of DeepSeek's own plan of the row; with `heavy`
    [R] (the load of HEAVY_ROWS tokens per step in each row; None: no such check), its
    heaviest replica at most that or (1 + HEAVY_TOLERANCE) times the from-scratch plan's.
    A row within these targets keeps its previous placement; one above them moves as
    little as it can to reach them (`_move_rows`), else takes the from-scratch plan
    relabelled towards `prev`. `fresh`: `solve.fresh_packing(w, p, m)`, when the caller
    made it."""
    R, n = w.shape
    cap = m
    has_prev = np.zeros(R, dtype=bool) if prev is None else (prev >= 0).all(1)
    if not has_prev.any():
        return solve(w, p, m, fresh=fresh)
    # the from-scratch plan is the reference (and the fallback); on large problems (more
    # than 8192 slots in all) it gets half the budget so that the moves from the previous
    # placement fit in the rest
    scratch, ref, smax = solve(w, p, m, share=1.0 if R * p <= SMALL else 0.5, with_reference=True,
                              fresh=fresh)
    r = np.nonzero(has_prev)[0]
    every = r.size == R  # the usual case: no row copies
    old = prev if every else prev[r]
    # smax [R']: the from-scratch max GPU load
    w_r, scratch_r, ref_r = (w, scratch, ref) if every else (w[r], scratch[r], ref[r])
    if not every:
        smax = smax[r]
    # a previous placement may hold more than m replicas of an expert (not placeable without
    # two on one GPU); such rows restart from scratch, only relabelled
    c_old = counts_of(old, n)  # [R', n]
    ok_counts = c_old.max(1) <= cap
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
    x = slot_loads(w_r, local, c_old)  # [R', p]
    top = gpu_sums(x, m).max(1)  # [R']
    big = x.max(1)  # [R'] heaviest replica
    if heavy is None:
        heavy_target = np.full(top.shape, np.inf)  # [R']
    else:
        floor = heavy if every else heavy[r]
        heavy_target = np.maximum((1.0 + HEAVY_TOLERANCE) * heaviest(w_r, scratch_r), floor) * (1 + 1e-12)  # [R']
    iters = iterations(PREV_WORK, (sel.size * p) ** 2, PREV_ITERS) if sel.size else 0
    # rows outside the tolerance move; large problems (iters 0): only the rows already
    # within tolerance stay
    rn = sel[(top[sel] > target[sel]) | (big[sel] > heavy_target[sel])] if iters > 0 else sel[:0]
    if rn.size:
        local = local.copy()
        local[rn] = _move_rows(w_r[rn], local[rn], scratch_r[rn], target[rn], heavy_target[rn], m, cap, iters)
        top[rn], big[rn] = load_and_heaviest(w_r[rn], local[rn], m)  # moves change counts
    reached = ok_counts & (top <= target) & (big <= heavy_target)  # (repaired rows hold no duplicates)
    miss = np.nonzero(~reached)[0]
    if every and not reached.any():  # every row takes the relabelled plan
        return align(scratch, old, m, n)
    out = scratch.copy()
    out[r[reached]] = local[reached]
    if miss.size:
        out[r[miss]] = align(scratch_r[miss], old[miss], m, n)
    return out
