"""From-scratch placement of a set of rows: the `balanced` planner's pipeline (counts,
packing, pair exchanges, max-GPU moves, count search, hot refill) under the budgets of
`eplb.core.policy.budgets`."""
from __future__ import annotations

import numpy as np

from eplb.core.policy.budgets import (COUNT_ITERS, COUNT_MOVES_WORK, COUNT_WORK, EXACT_COUNTS_MAX, EXACT_COUNTS_WORK,
                                 GOOD_ENOUGH, MAX2_WORK, MAX_ITERS, MAX_WORK, PAIR_ITERS, PAIR_WORK, SMALL,
                                 iterations)
from eplb.core.policy.packing import pack, pack_pairs, refill_hot, repair_duplicates
from eplb.core.policy.refinement import improve_max, improve_pairs
from eplb.core.policy.replicas import compositions, count_search_pairs, exact_counts_pairs, replica_counts
from eplb.core.policy.rows import counts_of, max_load, take


def solve(w: np.ndarray, p: int, m: int, share: float = 1.0) -> np.ndarray:
    """From-scratch placement of rows w [R, n] onto p slots of m GPUs: p2l [R, p].
    `share` < 1 scales the improvement budgets down (and lets them reach zero) when the
    caller has other work to do in the same time."""
    R, n = w.shape
    s = p // m
    cap = m
    size = R * p
    c = replica_counts(w, p, cap)  # [R, n]
    p2l = repair_duplicates(w, pack(w, c, m), m)
    lo = 1 if share >= 1 else 0
    # on large problems the improvement phases skip rows already within 0.05% of perfect
    # balance (the budget is set by the size, so the time only goes down)
    good = 1 + (GOOD_ENOUGH if size > SMALL else 0.0)
    mean = np.maximum(w.sum(1) / m, 1e-300)
    many_rows = max(1, R // 64) if size > SMALL else 1  # per-row overhead of large problems
    if s > 2:
        iters = iterations(int(PAIR_WORK * share), size * many_rows, (PAIR_ITERS[0] * lo, PAIR_ITERS[1]))
        r = np.nonzero(max_load(w, p2l, m) > good * mean)[0] if iters > 0 else ()  # iters 0: a no-op
        if len(r):
            p2l[r] = improve_pairs(w[r], p2l[r], m, iters)
        max_iters = iterations(int(MAX_WORK * share), size ** 2 * many_rows, MAX_ITERS)
    else:
        max_iters = iterations(int(MAX2_WORK * share), size, (lo, MAX_ITERS[1]))
    if max_iters > 0:
        r = np.nonzero(max_load(w, p2l, m) > good * mean)[0]
        if r.size:
            p2l[r], _ = improve_max(w[r], p2l[r], m, cap, budget=max_iters)
    steps = iterations(int(COUNT_WORK * share), R * 4 * n * p, COUNT_ITERS) if s == 2 and p > n else 0
    if steps > 0:
        # the count search scores counts by the best pairing, which may pair two replicas of
        # one expert; its counts are kept only where the real (duplicate-free) plan is better
        comps = compositions(p, n, cap, EXACT_COUNTS_MAX)  # [X, n] every count vector, if few
        if comps is not None and R * comps.shape[0] * p <= EXACT_COUNTS_WORK * share:
            searched = repair_duplicates(w, pack_pairs(w, exact_counts_pairs(w, m, comps), m), m)
        else:
            searched = repair_duplicates(w, pack(w, count_search_pairs(w, c, m, cap, steps), m), m)
        if max_iters > 0:
            searched, _ = improve_max(w, searched, m, cap, budget=max_iters)
        better = max_load(w, searched, m) < max_load(w, p2l, m)
        p2l = np.where(better[:, None], searched, p2l)
    if size <= SMALL and p > n and share >= 1:
        r = np.nonzero(max_load(w, p2l, m) > (1 + 1e-3) * mean)[0]  # rows not yet balanced
        if r.size:
            p2l[r] = count_moves(w[r], p2l[r], m, cap, COUNT_MOVES_WORK)
    return refill_hot(w, p2l, m)


def count_moves(w: np.ndarray, p2l: np.ndarray, m: int, cap: int, work: int) -> np.ndarray:
    """One step of hill-climbing on replica counts, scored by real placements: every
    move of one replica from an expert with several to another expert (all of them, in
    every row) is packed, repaired and improved (a few pair exchanges and max-GPU moves);
    a row takes its best candidate if that lowers its max GPU load. The max-GPU moves of
    `improve_max` score count changes by a bound and only on the most loaded GPU, so they
    miss moves whose gain appears only after re-packing. Skipped (p2l returned) when the
    candidates hold more than `work` slots in all. w [R, n], p2l [R, p] -> [R, p]."""
    R, n = w.shape
    p = p2l.shape[1]
    c = counts_of(p2l, n)  # [R, n]
    a, b = np.nonzero(~np.eye(n, dtype=bool))  # [K] every move a -> b
    ok = (take(c, np.broadcast_to(a, (R, a.size))) >= 2) & (take(c, np.broadcast_to(b, (R, b.size))) < cap)  # [R, K]
    rr, kk = np.nonzero(ok)
    if rr.size == 0 or rr.size * p > work:
        return p2l
    cand = c[rr].copy()  # [X, n]
    cand[np.arange(rr.size), a[kk]] -= 1
    cand[np.arange(rr.size), b[kk]] += 1
    wc = w[rr]
    pl = repair_duplicates(wc, pack(wc, cand, m), m)
    if p // m > 2:
        pl = improve_pairs(wc, pl, m, 8)
    pl, _ = improve_max(wc, pl, m, cap, budget=10)
    score = max_load(wc, pl, m)  # [X]
    # best candidate per row: candidates are grouped by row (np.nonzero order)
    order = np.lexsort((np.arange(rr.size), score, rr))  # by row, then score, then index
    first = order[np.r_[True, rr[order][1:] != rr[order][:-1]]]  # [rows with candidates]
    cur = max_load(w, p2l, m)
    better = score[first] < cur[rr[first]] * (1 - 1e-12)
    out = p2l.copy()
    out[rr[first][better]] = pl[first][better]
    return out
