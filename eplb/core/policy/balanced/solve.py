"""From-scratch placement of a set of rows: the `balanced` planner's pipeline (counts,
packing, pair exchanges, max-GPU moves, count search, hot refill) under the budgets of
`eplb.core.policy.balanced.budgets`."""
from __future__ import annotations

import numpy as np
import torch

from eplb.core.policy import deepseek

from eplb.core.policy.balanced.budgets import (COUNT_ITERS, COUNT_MOVES_WORK, COUNT_WORK, EXACT_COUNTS_MAX, EXACT_COUNTS_WORK,
                                 GOOD_ENOUGH, MAX2_WORK, MAX_ITERS, MAX_WORK, PAIR_ITERS, PAIR_WORK, SMALL,
                                 iterations)
from eplb.core.policy.balanced.packing import pack, pack_pairs, refill_hot, repair_duplicates
from eplb.core.policy.balanced.pairs import improve_pairs
from eplb.core.policy.balanced.refinement import improve_max
from eplb.core.policy.balanced.replicas import compositions, count_search_pairs, exact_counts_pairs, replica_counts
from eplb.core.policy.balanced.rows import argsort_rows, counts_of, has_duplicates, max_load, take


def fresh_packing(w: np.ndarray, p: int, m: int):
    """The first step of `solve`: DeepSeek's replica counts (capped at m) packed for tokens,
    any two replicas of one expert on one GPU repaired. Returns (counts [R, n], p2l
    [R, p], top [R] or None: the max GPU load of p2l where the repair changed nothing).
    The decode-aware pass holds kept layouts against this packing (`reads`), so the
    planner makes it once and hands it to `solve`."""
    c = replica_counts(w, p, m)  # [R, n]
    packed, load = pack(w, c, m, with_loads=True)  # [R, p], [R, m]
    p2l = repair_duplicates(w, packed, m)
    return c, p2l, (load.max(1) if p2l is packed else None)


def solve(w: np.ndarray, p: int, m: int, share: float = 1.0, with_reference: bool = False,
          fresh: tuple | None = None):
    """From-scratch placement of rows w [R, n] onto p slots of m GPUs: p2l [R, p].
    `share` < 1 scales the improvement budgets down (and lets them reach zero) when the
    caller has other work to do in the same time. With `with_reference`, also returns
    ref [R]: the max GPU load of DeepSeek's own placement of every row (computed on small
    problems only; inf elsewhere), and top [R]: the max GPU load of p2l (bit for bit
    `rows.max_load`; the steps compute it on the way, so the caller need not). `fresh`:
    `fresh_packing(w, p, m)` when the caller has made it (it is not written to)."""
    R, n = w.shape
    s = p // m
    cap = m
    size = R * p
    c, p2l, top = fresh_packing(w, p, m) if fresh is None else fresh  # [R, n], [R, p], [R] or None
    p2l = p2l.copy()  # the steps below write into it
    lo = 1 if share >= 1 else 0
    # on large problems the improvement phases skip rows already within 0.05% of perfect
    # balance (the budget is set by the size, so the time only goes down)
    good = 1 + (GOOD_ENOUGH if size > SMALL else 0.0)
    mean = np.maximum(w.sum(1) / m, 1e-300)
    many_rows = max(1, R // 64) if size > SMALL else 1  # per-row overhead of large problems
    if s > 2:
        iters = iterations(int(PAIR_WORK * share), size * many_rows, (PAIR_ITERS[0] * lo, PAIR_ITERS[1]))
        if iters > 0:
            r = np.nonzero((max_load(w, p2l, m) if top is None else top) > good * mean)[0]
        else:
            r = ()  # iters 0: a no-op
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
    p2l, top = refill_hot(w, p2l, m, with_max=True)
    ref = np.full(R, np.inf)
    if size <= SMALL and share >= 1:
        ds, ref = deepseek_rows(w, p, m)
        kept = keep_better(w, p2l, ds, m)
        if kept is not p2l:
            p2l, top = kept, max_load(w, kept, m)
    return (p2l, ref, top) if with_reference else p2l


def deepseek_rows(w: np.ndarray, p: int, m: int) -> np.ndarray:
    """DeepSeek EPLB's global placement of every row of w [R, n] (its replica counts and
    its packing: heaviest replica first onto the lightest GPU with room), with any two
    replicas of one expert on one GPU repaired and then improved by max-GPU moves: the
    candidate that makes the planner never worse than `deepseek` where it is kept
    (`keep_better`). A row where DeepSeek gives an expert more than m replicas keeps
    duplicates (the repair cannot remove them); `keep_better` never takes such a row.
    Returns (p2l [R, p], the max GPU load of DeepSeek's placement as it is [R])."""
    raw, _, _ = deepseek.rebalance_experts(torch.tensor(w, dtype=torch.float64), p, 1, 1, m)  # [R, p]
    raw = raw.numpy().astype(np.int64)
    ref = max_load(w, raw, m)  # [R]
    p2l = repair_duplicates(w, raw, m)
    if p // m > 2:
        p2l = improve_pairs(w, p2l, m, PAIR_ITERS[1])
    p2l, _ = improve_max(w, p2l, m, m, budget=MAX_ITERS[1])
    return p2l, ref


def keep_better(w: np.ndarray, p2l: np.ndarray, alt: np.ndarray, m: int) -> np.ndarray:
    """Per row, `alt` where its max GPU load is lower than that of `p2l` and no GPU holds
    two replicas of one expert, else `p2l` (both [R, p])."""
    better = (max_load(w, alt, m) < max_load(w, p2l, m)) & ~has_duplicates(alt, m)  # [R]
    return np.where(better[:, None], alt, p2l) if better.any() else p2l


def count_moves(w: np.ndarray, p2l: np.ndarray, m: int, cap: int, work: int, steps: int = 3,
                pool: int = 8) -> np.ndarray:
    """Hill-climbing on replica counts, scored by real placements: every step tries moving
    one replica from an expert a with several to another expert b, packs, repairs and
    improves (a few pair exchanges and max-GPU moves) each candidate, and a row takes its
    best candidate if that lowers its max GPU load; up to `steps` steps, while some row
    gains. The max-GPU moves of `improve_max` score count changes by a bound and only on
    the most loaded GPU, so they miss moves whose gain appears only after re-packing
    (e.g. one replica fewer for each of two hot experts, so that no GPU holds two hot
    replicas). Candidates per row: a among the `pool` heaviest experts with two replicas
    or more, b among the `pool` experts with the heaviest replicas and the one with the
    lightest replica after a split. The search stops at a step whose candidates hold more
    than `work` slots in all. w [R, n], p2l [R, p] -> [R, p]."""
    R, n = w.shape
    p = p2l.shape[1]
    out = p2l.copy()
    rows = np.arange(R)
    for _ in range(steps):
        if rows.size == 0:
            break
        wr, c = w[rows], counts_of(out[rows], n)  # [A, n]
        ka, kb = min(pool, n), min(pool, n)
        multi = np.where(c >= 2, wr, -1.0)  # [A, n]
        a_set = argsort_rows(np.maximum(multi, 0) + (c >= 2), descending=True)[:, :ka]  # [A, ka]
        a_ok = take(c, a_set) >= 2
        b_set = np.concatenate([argsort_rows(wr / c, descending=True)[:, :kb],
                                argsort_rows(np.where(c < cap, wr / (c + 1), np.inf))[:, :1]], 1)  # [A, kb+1]
        a = np.repeat(a_set, b_set.shape[1], 1)  # [A, K]
        b = np.tile(b_set, (1, ka))
        ok = np.repeat(a_ok, b_set.shape[1], 1) & (a != b) & (take(c, b) < cap)
        # the same pair can appear twice (b in both parts of b_set): keep the first
        key = a * n + b
        srt = np.sort(key, 1)
        dup = np.zeros_like(ok)
        o = np.argsort(key, 1, kind="stable")
        first = np.ones_like(ok)
        first[:, 1:] = srt[:, 1:] != srt[:, :-1]
        np.put_along_axis(dup, o, ~first, 1)
        ok &= ~dup
        rr, kk = np.nonzero(ok)
        if rr.size == 0 or rr.size * p > work:
            break
        ar = np.arange(rr.size)
        cand = c[rr].copy()  # [X, n]
        cand[ar, a[rr, kk]] -= 1
        cand[ar, b[rr, kk]] += 1
        wc = wr[rr]
        pl = repair_duplicates(wc, pack(wc, cand, m), m)
        if p // m > 2:
            pl = improve_pairs(wc, pl, m, 2)
        pl, _ = improve_max(wc, pl, m, cap, budget=10)
        score = max_load(wc, pl, m)  # [X]
        # best candidate per row: candidates are grouped by row (np.nonzero order)
        order = np.lexsort((ar, score, rr))  # by row, then score, then index
        best = order[np.r_[True, rr[order][1:] != rr[order][:-1]]]  # [rows with candidates]
        cur = max_load(wr, out[rows], m)
        better = score[best] < cur[rr[best]] * (1 - 1e-12)
        out[rows[rr[best][better]]] = pl[best][better]
        rows = rows[rr[best][better]]
    return out
