"""The `balanced` planner (registered as `default` too): better balance than DeepSeek EPLB,
no two replicas of one expert on one GPU, few moves when a previous placement is given,
optional weighted replicas.

Every step works on "rows": one row is one MoE layer (global placement) or one
(layer, node) pair (hierarchical placement). All rows are processed together with
numpy array operations; Python loops run over rounds or improvement iterations, never
over the experts or slots of a row. Shapes are written next to the arrays: R rows,
n experts per row, p slots per row, m GPUs per row, s = p / m slots per GPU.

From scratch (`_solve`):

1. replica counts: DeepSeek's rule (the next replica goes to the expert with the highest
   load per replica), capped at m replicas so that no GPU needs two copies of an expert;
   a bisection on the per-replica threshold, then a short greedy top-up;
2. packing in s rounds, items heavy -> light: GPUs below the current mean GPU load take
   the next heaviest items (heaviest to the lightest GPU), GPUs at or above it take the
   lightest remaining ones; an item whose expert is already on its GPU trades GPUs with
   the nearest item of its round (and a repair pass catches anything left);
3. pair exchanges: the GPUs of every row are paired (heaviest with lightest, rotating;
   or GPUs 1-3 places apart in load order) and each pair takes its best exchange of one
   item (two when GPUs have 4-6 slots) for one, all pairs and rows at once;
4. moves aimed at the most loaded GPU of every row: swaps with other slots and replica
   count changes (a slot of an expert with several replicas is given to another expert);
5. with two slots per GPU, a count search: the best packing of two items per GPU pairs the
   heaviest with the lightest, so counts are hill-climbed (one replica moves from expert
   a to expert b, a or b on the critical pair) on that exact figure; the result is kept
   per row only where its real, duplicate-free packing is better;
6. GPUs that hold one item at least as heavy as the mean GPU load share out the lightest
   items of the row (what DeepSeek's greedy does for an expert it cannot split enough).

How much of steps 3-5 runs is set by the problem size (see the budgets below), never by
a clock: small problems run to convergence, DeepSeek-V3-sized ones take a few
milliseconds on one core.

With `previous` (`_plan_rows`), the from-scratch plan is the reference: the planner
starts from the previous placement and makes step-4 moves (one or two slots each) until
the layer's max GPU load is within (1 + move_tolerance) of the from-scratch one. Layers
that do not get there take the from-scratch plan, relabelled so that as many experts as
possible stay on the GPU and in the slot where they were (`_align`). On large problems
the moves from `previous` are not attempted (no budget left): a layer keeps its previous
placement if it is within tolerance, otherwise it takes the relabelled from-scratch plan.

With `weighted`, per-slot shares come from water-filling: every expert with several
replicas repeatedly moves half way to the split that evens out the loads of its
replicas' GPUs (all experts at once); a variant of the placement that links GPUs holding
only single-replica experts to the others is tried too, and the better kept per layer.
"""
from __future__ import annotations

import itertools
from math import comb
from typing import Optional

import numpy as np

# Iteration budgets. Sizes only, never clocks: the same input gives the same plan on
# every machine. An improvement iteration costs a fixed number of passes over the R * p
# slots of all rows, so an iteration budget is a work constant divided by R * p (pair
# exchanges, moves from a previous placement), or by (R * p)^2 for the phases whose gain
# does not pay for their cost on large problems, clamped; on large problems with more
# than 64 rows the per-row overhead counts too (x R / 64). Small problems (26 layers x 80 slots: R * p = 2080) get
# the upper limits, where they have converged; DeepSeek-V3-sized ones (58 layers x 288
# slots: R * p = 16704) get two pair-exchange iterations (one in the hierarchical case,
# 232 rows) and nothing else, about 4-5 ms on one core. With two slots per GPU pair exchanges cannot
# improve on the packing and replica-count moves are what helps, so that case gets
# max-GPU iterations on the linear rule instead (about 20 ms at 58 x 512 slots).
_PAIR_WORK, _PAIR_ITERS = 40_000, (1, 40)  # pair-exchange iterations: work / (R p max(1, R/64))
_MAX_WORK, _MAX_ITERS = 250_000_000, (0, 20)  # max-GPU iterations: work / ((R p)^2 max(1, R/64))
_MAX2_WORK = 600_000  # max-GPU iterations with two slots per GPU: work / (R p)
_PREV_WORK, _PREV_ITERS = 250_000_000, (0, 80)  # moves from a previous placement: work / (R p)^2
_COUNT_WORK, _COUNT_ITERS = 25_000_000, (0, 256)  # count-search steps: work / (R 4n p)
_MAX_CANDIDATES = 5_000  # candidate moves per kind and max-GPU iteration, all rows together
_SMALL = 8192  # R * p up to which a problem counts as small (full effort, every row)
_GOOD_ENOUGH = 5e-4  # large problems: rows with max/mean <= 1 + this are left as they are


def _iterations(work: int, size: int, limits: tuple[int, int]) -> int:
    lo, hi = limits
    return int(min(hi, max(lo, work // max(size, 1))))


_REL_EPS = 1e-9  # improvements smaller than this fraction of the mean GPU load are ignored


# ==== small helpers ==================================================================


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Row-wise gather: out[r, ...] = a[r, idx[r, ...]] for a [R, X], idx [R, ...]."""
    R, X = a.shape
    off = (np.arange(R, dtype=np.int64) * X).reshape((R,) + (1,) * (idx.ndim - 1))
    return a.ravel()[idx + off]


def _argsort_rows(v: np.ndarray, descending: bool = False) -> np.ndarray:
    """Order of every row of the non-negative float array v [R, X], ties broken by the
    lower index: the same permutation on every machine. Each row sorts unique integer
    keys (value bits, then index), which is faster than an argsort and as deterministic
    (values closer than ~1e-13 relative count as ties and keep index order)."""
    R, X = v.shape
    ib = max(1, int(X).bit_length())
    bits = (np.maximum(v, 0.0) + 0.0).view(np.int64) >> ib  # monotone in v for v >= 0
    if descending:
        bits = ((1 << (63 - ib)) - 1) - bits
    key = (bits << ib) | np.arange(X, dtype=np.int64)
    return np.sort(key, axis=1) & ((1 << ib) - 1)


def _counts_of(p2l: np.ndarray, n: int) -> np.ndarray:
    """Replica count [R, n] of a placement p2l [R, p]."""
    R, p = p2l.shape
    flat = (p2l + (np.arange(R, dtype=np.int64) * n)[:, None]).ravel()
    return np.bincount(flat, minlength=R * n).reshape(R, n)


def _slot_loads(w: np.ndarray, p2l: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Tokens per slot [R, p] with even split over replicas."""
    return _take(w / np.maximum(c, 1), p2l)


def _gpu_sums(x: np.ndarray, m: int) -> np.ndarray:
    """Sum of slot values x [R, p] per GPU -> [R, m], slot by slot in a fixed order (no
    BLAS: its summation order depends on the CPU, and plans must not)."""
    R, p = x.shape
    x3 = x.reshape(R, m, p // m)
    out = x3[..., 0].copy()
    for k in range(1, p // m):
        out += x3[..., k]
    return out


def _presence(p2l: np.ndarray, m: int, n: int) -> np.ndarray:
    """on [R, m, n] bool: GPU g holds expert e."""
    R, p = p2l.shape
    on = np.zeros((R, m, n), dtype=bool)
    gpu = np.arange(p) // (p // m)
    on[np.arange(R)[:, None], gpu[None, :], p2l] = True
    return on


def _has_duplicates(p2l: np.ndarray, m: int) -> np.ndarray:
    """[R] bool: some GPU of the row holds two replicas of one expert."""
    R, p = p2l.shape
    s = p // m
    g = p2l.reshape(R, m, s)
    if s < 2:
        return np.zeros(R, dtype=bool)
    upper = np.triu(np.ones((s, s), dtype=bool), 1)
    return ((g[..., :, None] == g[..., None, :]) & upper).any(axis=(1, 2, 3))


# ==== step 1: replica counts ===========================================================


def replica_counts(w: np.ndarray, p: int, cap: int) -> np.ndarray:
    """Replicas per expert [R, n] (sum p per row, each in [1, cap]): the next replica
    always goes to the expert with the highest load per replica (DeepSeek's rule).

    The greedy sequence takes the p - n largest values of {w_e / k : 1 <= k < cap};
    a bisection on that threshold finds nearly all of them at once, a short greedy loop
    adds the rest (ties go to the lower expert id, as with DeepSeek's argmax)."""
    R, n = w.shape
    extra = p - n
    c = np.ones((R, n), dtype=np.int64)
    if extra <= 0:
        return c
    total = w.sum(1)  # [R]
    pos = total > 0
    safe_total = np.where(pos, total, 1.0)
    # picks(t) = sum_e min(cap - 1, floor(w_e / t)) values >= t; picks(W / extra) <= extra
    # and, unless the cap binds, picks(W / p) >= extra
    lo = safe_total / p  # [R]
    hi = safe_total / extra * (1 + 1e-12)  # [R]
    limit = float(cap - 1)
    buf = np.empty_like(w)
    for _ in range(10):  # geometric bisection: hi/lo shrinks to (p / extra) ** (1 / 1024)
        mid = np.sqrt(lo * hi)
        np.divide(w, mid[:, None], out=buf)
        np.floor(buf, out=buf)
        np.minimum(buf, limit, out=buf)
        over = buf.sum(1) > extra
        lo = np.where(over, mid, lo)
        hi = np.where(over, hi, mid)
    np.divide(w, hi[:, None], out=buf)
    np.floor(buf, out=buf)
    np.minimum(buf, limit, out=buf)
    buf[~pos] = 0
    c += buf.astype(np.int64)
    short = p - c.sum(1)  # [R] >= 0
    rows = np.arange(R)
    while short.max() > 0:  # few iterations unless many loads tie
        prio = np.where(c < cap, w / c, -1.0)  # [R, n]
        e = prio.argmax(1)  # [R] first maximum
        r = rows[short > 0]
        c[r, e[r]] += 1
        short[r] -= 1
    return c


# ==== step 2: count search for two slots per GPU ======================================


def _expand(c: np.ndarray, experts: Optional[np.ndarray] = None) -> np.ndarray:
    """Items [R, p]: expert experts[r, i] repeated c[r, i] times, row by row (every row of
    c sums to p). experts defaults to 0..n-1 (expert-major order)."""
    R, n = c.shape
    if experts is None:
        experts = np.broadcast_to(np.arange(n), (R, n))
    return np.repeat(experts.ravel(), c.ravel()).reshape(R, -1)


def _pairing_max(vals: np.ndarray, m: int) -> np.ndarray:
    """Max GPU load of the best packing of 2m items onto m GPUs of two slots: the i-th
    heaviest item with the i-th lightest. Blind to duplicates (it may pair two replicas
    of one expert), so callers compare the real packings afterwards. [..., 2m] -> [...]."""
    v = np.sort(vals, axis=-1)
    return (v[..., :m] + v[..., ::-1][..., :m]).max(-1)


def _count_search_pairs(w: np.ndarray, c: np.ndarray, m: int, cap: int, steps: int) -> np.ndarray:
    """Replica counts for two slots per GPU. With two items per GPU the best packing
    pairs the i-th heaviest item with the i-th lightest, so the max GPU load of a count
    vector is cheap to score exactly (ignoring duplicates, see `_pairing_max`). Hill-climb: each step tries moving one replica from expert a to expert
    b where a or b is one of the two experts of the critical (max) pair, and keeps the
    best move while it lowers the max. c [R, n] -> [R, n]."""
    R, n = w.shape
    p = 2 * m
    c = c.copy()
    rows = np.arange(R)
    arange_n = np.arange(n)
    active = np.ones(R, dtype=bool)
    for _ in range(steps):
        ra = rows[active]
        if ra.size == 0:
            break
        cc, ww = c[ra], w[ra]  # [A, n]
        A_ = ra.size
        ar = np.arange(A_)
        items = _expand(cc)  # [A, p] expert-major
        vals = _take(ww / cc, items)  # [A, p]
        order = _argsort_rows(vals, descending=True)
        sv = _take(vals, order)
        se = _take(items, order)
        pair = sv[:, :m] + sv[:, ::-1][:, :m]  # [A, m]
        i = pair.argmax(1)
        cur = pair[ar, i]  # [A]
        big = se[ar, i]  # expert of the heavy item of the critical pair
        small = se[ar, p - 1 - i]  # expert of its partner
        # candidates (a -> b): b in {big, small} with any a; a in {big, small} with any b
        anyx = np.broadcast_to(arange_n, (A_, n))
        bigx = np.broadcast_to(big[:, None], (A_, n))
        smallx = np.broadcast_to(small[:, None], (A_, n))
        src = np.concatenate([anyx, anyx, bigx, smallx], 1)  # [A, K]
        dst = np.concatenate([bigx, smallx, anyx, anyx], 1)  # [A, K]
        c_src, c_dst = _take(cc, src), _take(cc, dst)
        ok = (src != dst) & (c_src >= 2) & (c_dst < cap)
        new_src = _take(ww, src) / np.maximum(c_src - 1, 1)  # [A, K]
        new_dst = _take(ww, dst) / (c_dst + 1)
        is_src = items[:, None, :] == src[:, :, None]  # [A, K, p]
        is_dst = items[:, None, :] == dst[:, :, None]
        first_src = is_src & (np.cumsum(is_src, -1) == 1)  # this item becomes a dst replica
        nv = np.where(is_src, new_src[..., None], vals[:, None, :])
        nv = np.where(is_dst | first_src, new_dst[..., None], nv)  # [A, K, p]
        f = np.where(ok, _pairing_max(nv, m), np.inf)  # [A, K]
        k = f.argmin(1)
        fb = f[ar, k]
        mean = ww.sum(1) / m
        better = fb < cur - _REL_EPS * mean
        r = ra[better]
        kb = k[better]
        c[r, src[better, kb]] -= 1
        c[r, dst[better, kb]] += 1
        active[ra[~better]] = False
    return c


# ==== step 3: packing =================================================================


def _pack(w: np.ndarray, c: np.ndarray, m: int) -> np.ndarray:
    """Pack the replicas (expert e: c[r, e] items of w[r, e] / c[r, e]) onto m GPUs with
    exactly s items each, in s rounds. Items sorted heavy -> light; in every round the
    GPUs below the current mean GPU load take the next heaviest items (heaviest to the
    lightest GPU) and the GPUs at or above it take the lightest remaining items (lightest
    to the heaviest GPU), which is what a greedy that always feeds the lightest GPU ends
    up doing. An item whose expert is already on its GPU trades GPUs with the
    nearest item of the round for which that is not the case (replicas of one expert
    are neighbours in the order, so this is rare). Returns p2l [R, p]."""
    R, n = w.shape
    p = int(c[0].sum())
    s = p // m
    piece = w / c  # [R, n]
    order = _argsort_rows(piece, descending=True)  # [R, n] experts heavy first
    items = _expand(_take(c, order), order)  # [R, p] expert of each item, heavy first
    sizes = _take(piece, items)  # [R, p]
    load = np.zeros((R, m))
    front = np.zeros((R, 1), dtype=np.int64)
    back = np.full((R, 1), p, dtype=np.int64)
    j = np.arange(m)[None, :]
    rows = np.arange(R)
    row_m = (rows * m)[:, None]
    row_p = (rows * p)[:, None]
    held = np.zeros(R * m * n, dtype=bool)  # GPU holds expert, flat [(r * m + g) * n + e]
    p2l = np.empty(R * p, dtype=np.int64)
    for rnd in range(s):
        if rnd == 0:
            closed = np.zeros((R, 1), dtype=np.int64)
        else:  # GPUs at or above the current mean load
            closed = (load >= load.mean(1, keepdims=True)).sum(1, keepdims=True)
        nopen = m - closed
        gpus = _argsort_rows(load)  # [R, m] lightest first; closed GPUs come last
        pick = np.where(j < nopen, front + j, back - closed + (j - nopen)) + row_p  # [R, m] flat item
        e = items.ravel()[pick]  # [R, m]
        gflat = gpus + row_m
        key = gflat * n + e
        bad = held[key]
        if bad.any():
            gpus = _untangle(gpus, e, bad, held, row_m, n)
            gflat = gpus + row_m
            key = gflat * n + e
        held[key] = True
        p2l[row_p + gpus * s + rnd] = e
        load.ravel()[gflat] += sizes.ravel()[pick]
        front += nopen
        back -= closed
    return p2l.reshape(R, p)


def _untangle(gpus, e, bad, held, row_m, n):
    """Within one packing round (item j of row r goes to GPU gpus[r, j]), let every item
    whose expert that GPU already holds trade GPUs with the nearest item of the round
    for which both GPUs are free of the other's expert. [R, m] -> [R, m]."""
    gpus = gpus.copy()
    m = gpus.shape[1]
    j = np.arange(m)
    for _ in range(m):
        rb = np.nonzero(bad.any(1))[0]
        if rb.size == 0:
            break
        g, ee, rm = gpus[rb], e[rb], row_m[rb]
        j0 = bad[rb].argmax(1)  # first bad item
        ar = np.arange(rb.size)
        e0, g0 = ee[ar, j0], g[ar, j0]
        ok = ~held[(g + rm) * n + e0[:, None]] & ~held[(g0[:, None] + rm) * n + ee] & (ee != e0[:, None])
        dist = np.where(ok, np.abs(j[None, :] - j0[:, None]), m + 1)
        j1 = dist.argmin(1)
        fixable = dist[ar, j1] <= m
        if not fixable.any():
            break
        rf, a0, a1 = rb[fixable], j0[fixable], j1[fixable]
        t = gpus[rf, a0].copy()
        gpus[rf, a0] = gpus[rf, a1]
        gpus[rf, a1] = t
        bad[rb] = held[(gpus[rb] + rm) * n + ee]
        bad[rb[~fixable]] = False  # left to the repair pass
    return gpus


def _repair_duplicates(w: np.ndarray, p2l: np.ndarray, m: int, cap_iters: int = 10_000) -> np.ndarray:
    """Remove every second replica of an expert on one GPU by swapping it with a slot of
    another GPU (that GPU must not hold the expert, and this GPU must not hold the other
    slot's expert), choosing the swap that keeps the two GPUs' max load lowest.
    One duplicate per row per iteration. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    dup_rows = np.nonzero(_has_duplicates(p2l, m))[0]
    if dup_rows.size == 0:
        return p2l
    p2l = p2l.copy()
    gpu = np.arange(p) // s
    lower = np.tril(np.ones((s, s), dtype=bool), -1)
    for _ in range(cap_iters):
        if dup_rows.size == 0:
            return p2l
        sub = p2l[dup_rows]  # [D, p]
        D = dup_rows.size
        c = _counts_of(sub, n)
        x = _slot_loads(w[dup_rows], sub, c)
        load = _gpu_sums(x, m)
        g3 = sub.reshape(D, m, s)
        isdup = ((g3[..., :, None] == g3[..., None, :]) & lower).any(-1).reshape(D, p)  # later copies
        q = isdup.argmax(1)  # [D] first duplicate slot
        a = sub[np.arange(D), q]
        gq = gpu[q]
        on = _presence(sub, m, n)
        ok = (gpu[None, :] != gq[:, None]) & ~on[np.arange(D)[:, None], gpu[None, :], a[:, None]]
        ok &= ~on[np.arange(D)[:, None], gq[:, None], sub]  # [D, p]
        delta = x[np.arange(D), q][:, None] - x  # [D, p] load leaving GPU gq
        worst = np.maximum(load[np.arange(D), gq][:, None] - delta, load[:, gpu] + delta)
        worst = np.where(ok, worst, np.inf)
        j = worst.argmin(1)
        fixable = np.isfinite(worst[np.arange(D), j])
        r = np.arange(D)[fixable]
        t = sub[r, q[r]].copy()
        sub[r, q[r]] = sub[r, j[r]]
        sub[r, j[r]] = t
        p2l[dup_rows] = sub
        still = _has_duplicates(sub, m) & fixable
        dup_rows = dup_rows[still]
    raise RuntimeError("duplicate repair did not converge")  # pragma: no cover


# ==== step 4: pair exchanges ==========================================================

_EXCHANGES: dict[int, tuple] = {}


def _exchanges(s: int, budget: int = 400):
    """All exchanges of j items between two GPUs of s slots, j = 1..jmax (as many j as
    fit in `budget` candidates; j <= s/2 covers every split of the 2s items).
    Returns out_idx [X, J] (items leaving GPU h, padded with s), in_idx [X, J] (items
    leaving GPU l), perm [X, 2s] (new content of the 2s slots: slot u takes item perm[u]) and
    mismatch [s*s, X] (1 where an exchange moves item u of h but not item v of l or the
    reverse: used to forbid two replicas of one expert on one GPU)."""
    if s not in _EXCHANGES:
        outs, ins, perms = [], [], []
        total = 0
        for j in range(1, s // 2 + 1):
            k = comb(s, j) ** 2
            if j > 1 and total + k > budget:
                break
            total += k
            for out in itertools.combinations(range(s), j):
                for inn in itertools.combinations(range(s), j):
                    om = np.zeros(s, dtype=bool)
                    om[list(out)] = True
                    im = np.zeros(s, dtype=bool)
                    im[list(inn)] = True
                    perm = np.arange(2 * s)
                    for u, v in zip(out, inn):
                        perm[u], perm[s + v] = s + v, u
                    outs.append(om)
                    ins.append(im)
                    perms.append(perm)
        om, im = np.array(outs), np.array(ins)  # [X, s]
        mismatch = (om[:, :, None] != im[:, None, :]).reshape(len(om), -1).T.astype(np.float64)
        J = int(om.sum(1).max())
        # item indices of every exchange, padded with s (a zero column): [X, J]
        out_idx = np.array([np.r_[np.nonzero(r)[0], [s] * (J - r.sum())] for r in om], dtype=np.int64)
        in_idx = np.array([np.r_[np.nonzero(r)[0], [s] * (J - r.sum())] for r in im], dtype=np.int64)
        _EXCHANGES[s] = (out_idx, in_idx, np.array(perms), mismatch)
    return _EXCHANGES[s]


def _improve_pairs(w: np.ndarray, p2l: np.ndarray, m: int, iters: int) -> np.ndarray:
    """Pair-exchange local search. Every iteration pairs the GPUs of every row (heaviest
    with lightest, rotating; or neighbours in load order) and applies, in every pair at
    once, the exchange of up to a few items that lowers the pair's max load the most.
    Replica counts do not change. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    s = p // m
    K = m // 2
    if K == 0 or R == 0 or s < 2 or iters <= 0:
        return p2l
    out_m, in_m, perm, mismatch = _exchanges(s)
    X = out_m.shape[0]
    single = out_m.shape[1] == 1 and s > 1  # only one-for-one swaps
    p2l = p2l.copy()
    n = w.shape[1]
    c = _counts_of(p2l, n)
    x = _slot_loads(w, p2l, c)  # [R, p]
    load = _gpu_sums(x, m)  # [R, m]
    eps = _REL_EPS * w.sum(1) / m  # [R]
    ar = np.arange(s)
    iters = min(40 * K + 8, iters)
    use_map = single and s >= 4  # many items: duplicate checks through a presence map
    if use_map:
        held = _presence(p2l, m, n).ravel()  # [R * m * n]
        row_m = (np.arange(R) * m)[:, None]
    quiet = 0
    for it in range(iters):
        order = _argsort_rows(load)  # [R, m] lightest first
        if it % 2 == 0 or iters <= 4:  # heaviest with lightest, rotating
            shift = it if iters <= 4 else it // 2
            k = np.arange(K)
            heavy = order[:, m - 1 - k]
            light = order[:, (k + shift) % K]
        else:  # GPUs d apart in load order (d = 1, 2, 3, 1, ...), disjoint pairs
            d = 1 + (it // 2) % 3
            k = np.arange(m - d)
            k = k[(k % (2 * d)) < d]
            heavy = order[:, m - 1 - k]
            light = order[:, m - 1 - d - k]
        Kp = heavy.shape[1]
        if Kp == 0:
            continue
        slots = np.concatenate([heavy[:, :, None] * s + ar, light[:, :, None] * s + ar], 2)  # [R, Kp, 2s]
        E = _take(p2l, slots)  # [R, Kp, 2s]
        V = _take(x, slots)
        Gh, Gl = _take(load, heavy), _take(load, light)  # [R, Kp]
        if use_map:
            a_on_l = held[((light[:, :, None] + row_m[:, :, None]) * n + E[..., :s])]  # [R, Kp, s]
            b_on_h = held[((heavy[:, :, None] + row_m[:, :, None]) * n + E[..., s:])]
            best, best_val = _best_swaps(V, Gh, Gl, a_on_l, b_on_h, s)
        else:
            same = E[..., :s, None] == E[..., None, s:]  # [R, Kp, s, s] expert on both GPUs
            if single:  # [R, Kp, s*s] load from h to l, swap (u, v) at u * s + v
                moved = (V[..., :s, None] - V[..., None, s:]).reshape(R, Kp, X)
                bad = (same.any(-1)[..., :, None] | same.any(-2)[..., None, :]).reshape(R, Kp, X)
            else:
                vh = np.concatenate([V[..., :s], np.zeros((R, Kp, 1))], -1)  # [R, Kp, s + 1]
                vl = np.concatenate([V[..., s:], np.zeros((R, Kp, 1))], -1)
                moved = vh[..., out_m[:, 0]] - vl[..., in_m[:, 0]]  # [R, Kp, X]
                for jj in range(1, out_m.shape[1]):  # fixed summation order
                    moved += vh[..., out_m[:, jj]] - vl[..., in_m[:, jj]]
                bad = ((same.reshape(-1, s * s).astype(np.float64) @ mismatch) > 0).reshape(R, Kp, X)
            new_max = np.maximum(Gh[..., None] - moved, Gl[..., None] + moved)
            new_max[bad] = np.inf
            best = new_max.argmin(-1)  # [R, Kp]
            best_val = new_max.reshape(-1, X)[np.arange(R * Kp), best.ravel()].reshape(R, Kp)
        do = best_val < np.maximum(Gh, Gl) - eps[:, None]
        if not do.any():
            quiet += 1
            if quiet > K + 2:  # every rotation tried without a gain
                break
            continue
        quiet = 0
        rr, kk = np.nonzero(do)
        if single:  # swap one slot of the heavy GPU with one of the light GPU
            bb = best[rr, kk]
            su = heavy[rr, kk] * s + bb // s
            sv = light[rr, kk] * s + bb % s
            eu, ev = p2l[rr, su], p2l[rr, sv]
            if use_map:  # keep the presence map up to date
                gu = (heavy[rr, kk] + rr * m) * n
                gv = (light[rr, kk] + rr * m) * n
                held[gu + eu] = False
                held[gv + ev] = False
                held[gu + ev] = True
                held[gv + eu] = True
            p2l[rr, su], p2l[rr, sv] = ev, eu
            xu = x[rr, su]
            x[rr, su] = x[rr, sv]
            x[rr, sv] = xu
        else:
            src = slots[rr, kk][np.arange(rr.size)[:, None], perm[best[rr, kk]]]  # [D, 2s]
            dst = slots[rr, kk]
            p2l[rr[:, None], dst] = p2l[rr[:, None], src]
            x[rr[:, None], dst] = x[rr[:, None], src]
        load = _gpu_sums(x, m)
    return p2l


def _best_swaps(V, Gh, Gl, a_on_l, b_on_h, s):
    """Best one-for-one swap of every GPU pair. Moving load d from the heavy GPU to the
    light one gives a pair max of (Gh + Gl) / 2 + |d - gap / 2|, and helps iff
    0 < d < gap, so the score is |2 d - gap|. V [R, K, 2s] item loads (heavy GPU's
    first), Gh, Gl [R, K], a_on_l / b_on_h [R, K, s] (the item's expert is already on the
    other GPU). Returns the swap index u * s + v [R, K] and the pair's new max [R, K]."""
    R, K, _ = V.shape
    gap = Gh - Gl  # [R, K]
    score = V[..., :s, None] - V[..., None, s:]  # [R, K, s, s] load moved
    score *= 2.0
    score -= gap[..., None, None]
    np.abs(score, out=score)
    score[a_on_l] = np.inf  # [R, K, s] masks whole rows u
    score.transpose(0, 1, 3, 2)[b_on_h] = np.inf  # and whole columns v
    flat = score.reshape(R * K, s * s)
    j = flat.argmin(-1)
    best = flat[np.arange(R * K), j].reshape(R, K)
    new_max = 0.5 * (Gh + Gl + best)  # = max(Gh - d, Gl + d)
    new_max[~(best < gap)] = np.inf
    return j.reshape(R, K), new_max


# ==== step 5: moves aimed at the most loaded GPU =======================================


def _improve_max(
    w: np.ndarray,
    p2l: np.ndarray,
    m: int,
    cap: int,
    target: Optional[np.ndarray] = None,
    budget: Optional[int] = None,  # iterations; default from _MAX_WORK
) -> tuple[np.ndarray, np.ndarray]:
    """Local search on the most loaded GPU g* of every row: one move per row and
    iteration, the one with the lowest new max GPU load:

    - swap: a slot of g* and a slot of another GPU exchange experts (plateau swaps that
      keep the max but lower the sum of squared loads are taken too);
    - count change: a slot holding expert a (>= 2 replicas) is given to expert b (fewer
      than `cap` replicas, not on that GPU); every replica of a gets heavier, every
      replica of b lighter. Either the slot is on g* (b = an expert with the smallest
      resulting replica load), or b is on g* (the slot is on one of the lightest GPUs).

    Swaps are scored exactly; count changes with an upper bound of the new max (GPUs
    that get lighter are counted at their old load), so an accepted move always lowers
    the row's max. Rows stop when no move improves or, with `target` [R], once their max
    GPU load is at most the target. Returns (p2l [R, p], moves [R] made per row)."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    p2l = p2l.copy()
    moves = np.zeros(R, dtype=np.int64)
    if R == 0 or m < 2:
        return p2l, moves
    gpu = np.arange(p) // s
    eps = _REL_EPS * w.sum(1) / m  # [R]
    c = _counts_of(p2l, n)  # [R, n] kept up to date
    on = _presence(p2l, m, n)  # [R, m, n] kept up to date
    active = np.ones(R, dtype=bool)
    # candidate sets: everything on small problems, the lightest GPUs and the heaviest
    # replicas of g* on large ones (about _MAX_CANDIDATES candidates of each kind in all)
    swap_all = R * s * p <= 4 * _MAX_CANDIDATES
    n_light = max(2, min(m - 1, 4 * _MAX_CANDIDATES // (R * s * s)))
    n_hot = max(1, min(s, _MAX_CANDIDATES // (R * s * n_light)))  # experts of g* given a replica
    iters = _iterations(_MAX_WORK, (R * p) ** 2, _MAX_ITERS) if budget is None else budget
    knew = min(3, n)
    for _ in range(iters):
        ra = np.nonzero(active)[0]
        if ra.size == 0:
            break
        P_, W_, C_ = p2l[ra], w[ra], c[ra]  # [A, p], [A, n], [A, n]
        x = _take(W_ / C_, P_)  # [A, p]
        load = _gpu_sums(x, m)  # [A, m]
        g1 = load.argmax(1)
        A_ = ra.size
        ar = np.arange(A_)
        top = load[ar, g1]
        if target is not None:
            reached = top <= target[ra]
            if reached.any():
                active[ra[reached]] = False
                keep = ~reached
                ra, P_, W_, C_, x, load, g1, top = (
                    ra[keep], P_[keep], W_[keep], C_[keep], x[keep], load[keep], g1[keep], top[keep])
                A_ = ra.size
                ar = np.arange(A_)
                if A_ == 0:
                    break
        rest = load.copy()
        rest[ar, g1] = -np.inf
        g2 = rest.argmax(1)
        v2 = rest[ar, g2]  # max without g*
        rest[ar, g2] = -np.inf
        v3 = rest.max(1)  # max without g* and g2
        ra_ = ra[:, None]
        g_slots = g1[:, None] * s + np.arange(s)  # [A, s]
        g_exp = _take(P_, g_slots)  # [A, s]
        g_x = _take(x, g_slots)

        # ---- swaps
        if swap_all:
            other = np.broadcast_to(np.arange(p), (A_, p))
        else:  # the lightest GPUs and the heaviest ones after g*
            by_load = _argsort_rows(load)
            half = max(1, n_light // 2)
            partners = np.concatenate([by_load[:, :n_light - half], by_load[:, m - 1 - half:m - 1]], 1)
            other = (partners[:, :, None] * s + np.arange(s)).reshape(A_, -1)
        O = other.shape[1]
        o_gpu = gpu[other]  # [A, O]
        o_exp = _take(P_, other)
        delta = g_x[:, :, None] - _take(x, other)[:, None, :]  # [A, s, O] load leaving g*
        o_load = _take(load, o_gpu)  # [A, O]
        new_g = top[:, None, None] - delta
        new_o = o_load[:, None, :] + delta
        untouched = np.where(o_gpu == g2[:, None], v3[:, None], v2[:, None])  # [A, O]
        score = np.maximum(np.maximum(new_g, new_o), untouched[:, None, :])
        ok = (o_gpu != g1[:, None])[:, None, :] & (delta > 0)
        ok &= ~on[ra_, g1[:, None], o_exp][:, None, :]  # the other expert is not on g*
        ok &= ~on[ra[:, None, None], o_gpu[:, None, :], g_exp[:, :, None]]  # g*'s is not there
        score = np.where(ok, score, np.inf).reshape(A_, -1)
        dsq = (new_g ** 2 + new_o ** 2 - o_load[:, None, :] ** 2).reshape(A_, -1) - (top ** 2)[:, None]
        sw = _lexmin(score, dsq)
        sw_score, sw_dsq = score[ar, sw], dsq[ar, sw]
        sw_u = g_slots[ar, sw // O]
        sw_v = other[ar, sw % O]

        # ---- count changes
        slot_load = load[ar[:, None], gpu[None, :]]  # [A, p]
        fe = (P_ + (ar * n)[:, None])  # [A, p] flat expert index
        masked = np.where(gpu[None, :] == g1[:, None], -np.inf, slot_load)
        emax = np.full(A_ * n, -np.inf)
        np.maximum.at(emax, fe.ravel(), masked.ravel())
        emax = emax.reshape(A_, n)  # max load of the GPUs holding e, g* excluded
        nb_all = W_ / (C_ + 1)  # [A, n] replica load of b after one more replica
        inc_all = W_ / np.maximum(C_ - 1, 1) - W_ / C_  # growth of a's replicas after one fewer
        dec_all = W_ / C_ - nb_all  # shrink of b's replicas
        # (i) slot on g* -> one of the experts with the smallest new replica load
        allowed = (C_ < cap) & ~on[ra_, g1[:, None], np.arange(n)[None, :]]
        pool = np.where(allowed, nb_all, np.inf)
        cand = []
        for _ in range(knew):
            b = pool.argmin(1)
            cand.append(b)
            pool[ar, b] = np.inf
        b1 = np.repeat(np.stack(cand, 1), s, 1)  # [A, knew*s]
        q1 = np.tile(g_slots, (1, knew))
        a1 = _take(P_, q1)
        ok1 = (_take(C_, a1) >= 2) & np.isfinite(_take(np.where(allowed, nb_all, np.inf), b1))
        inc1 = _take(inc_all, a1)
        sc1 = np.maximum(np.maximum(top[:, None] - _take(x, q1) + _take(nb_all, b1), _take(emax, a1) + inc1),
                         v2[:, None])
        sc1 = np.where(ok1, sc1, np.inf)
        # (ii) expert b on g* (its heaviest replicas) takes a slot q of one of the lightest GPUs
        if n_hot < s:
            hot = _argsort_rows(g_x, descending=True)[:, :n_hot]
            hot_exp = _take(g_exp, hot)  # [A, n_hot]
        else:
            hot_exp = g_exp
        light = _argsort_rows(load)[:, :n_light]
        light = np.where(light == g1[:, None], light[:, :1], light) if n_light < m else light
        lslots = (light[:, :, None] * s + np.arange(s)).reshape(A_, -1)  # [A, Lq]
        Lq = lslots.shape[1]
        q2 = np.tile(lslots, (1, n_hot))  # [A, n_hot*Lq]
        b2 = np.repeat(hot_exp, Lq, 1)
        a2 = _take(P_, q2)
        gq = gpu[q2]
        ca2 = _take(C_, a2)
        ok2 = (ca2 >= 2) & (_take(C_, b2) < cap) & (a2 != b2) & (gq != g1[:, None])
        ok2 &= ~on[ra_, gq, b2]
        inc2 = _take(inc_all, a2)
        a_on_g = on[ra_, g1[:, None], a2]
        new_top = top[:, None] - _take(dec_all, b2) + np.where(a_on_g, inc2, 0.0)
        new_q = _take(load, gq) - _take(x, q2) + _take(nb_all, b2)
        untouched2 = np.where(gq == g2[:, None], v3[:, None], v2[:, None])
        sc2 = np.maximum(np.maximum(new_top, new_q), np.maximum(_take(emax, a2) + inc2, untouched2))
        sc2 = np.where(ok2, sc2, np.inf)
        sc = np.concatenate([sc1, sc2], 1)
        qc = np.concatenate([q1, q2], 1)
        bc = np.concatenate([b1, b2], 1)
        cm = sc.argmin(1)
        cm_score = sc[ar, cm]

        use_count = cm_score < sw_score
        improve = np.where(use_count, cm_score < top - eps[ra],
                           (sw_score < top - eps[ra]) | ((sw_score <= top) & (sw_dsq < -eps[ra] * top)))
        improve &= np.isfinite(np.where(use_count, cm_score, sw_score))
        active[ra[~improve]] = False
        # apply swaps
        sel = improve & ~use_count
        r, u, v = ra[sel], sw_u[sel], sw_v[sel]
        a, b = p2l[r, u], p2l[r, v]
        on[r, gpu[u], a] = False
        on[r, gpu[v], b] = False
        on[r, gpu[u], b] = True
        on[r, gpu[v], a] = True
        p2l[r, u], p2l[r, v] = b, a
        # apply count changes
        sel = improve & use_count
        r, q, b = ra[sel], qc[sel, cm[sel]], bc[sel, cm[sel]]
        a = p2l[r, q]
        on[r, gpu[q], a] = False
        on[r, gpu[q], b] = True
        c[r, a] -= 1
        c[r, b] += 1
        p2l[r, q] = b
        moves[ra[improve]] += 1
    return p2l, moves


def _lexmin(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """Per row, the index of the smallest `primary`, ties broken by the smallest
    `secondary`, then by the lowest index. primary, secondary [A, K] -> [A]."""
    best = primary.min(1, keepdims=True)
    sec = np.where(primary <= best, secondary, np.inf)
    return sec.argmin(1)


def _refill_hot(w: np.ndarray, p2l: np.ndarray, m: int, max_hot: int = 8) -> np.ndarray:
    """When several GPUs hold one item at least as heavy as the mean GPU load (an expert
    that cannot be split enough), the best they can do is share the lightest items of
    the row: give the h(s-1) lightest items to those h GPUs, heaviest item first to the
    one with the lowest load (LPT over the fillers), and put their previous fillers where
    the light items were. Kept per row only if the max GPU load drops and no GPU gets two
    replicas of one expert. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    if s < 2 or m < 2 or R == 0:
        return p2l
    c = _counts_of(p2l, n)
    x = _slot_loads(w, p2l, c)  # [R, p]
    load = _gpu_sums(x, m)
    mean = load.mean(1, keepdims=True)
    x3 = x.reshape(R, m, s)
    dom = x3.argmax(-1)  # [R, m] slot (in GPU) of the heaviest item
    big = np.take_along_axis(x3, dom[..., None], -1)[..., 0]  # [R, m]
    hot = big >= mean
    h = hot.sum(1)
    rows = np.nonzero(h >= 2)[0]
    if rows.size == 0:
        return p2l
    k = int(min(max_hot, h[rows].max(), max(2, 32 // (s - 1))))
    Rr = rows.size
    rr = np.arange(Rr)
    # the k GPUs with the heaviest dominating items (padding GPUs are not hot)
    hg = _argsort_rows(big[rows], descending=True)[:, :k]  # [Rr, k]
    is_hot = np.take_along_axis(hot[rows], hg, 1)  # [Rr, k]
    nf = (is_hot.sum(1)) * (s - 1)  # fillers per row
    dom_slot = hg * s + np.take_along_axis(dom[rows], hg, 1)  # [Rr, k]
    filler_slots = (hg[:, :, None] * s + np.arange(s)).reshape(Rr, -1)  # [Rr, k*s] incl. dominating
    xr = x[rows]
    masked = xr.copy()
    masked[rr[:, None], dom_slot] = np.inf  # dominating items are not fillers
    light = _argsort_rows(masked)[:, :k * (s - 1)]  # [Rr, k(s-1)] lightest items, ascending
    # LPT of the fillers (heaviest first) onto the hot GPUs
    gl = np.where(is_hot, np.take_along_axis(big[rows], hg, 1), np.inf)  # [Rr, k]
    room = np.where(is_hot, s - 1, 0)
    take = np.full((Rr, k * (s - 1)), -1, dtype=np.int64)  # hot GPU index (0..k-1) of each filler
    F = k * (s - 1)
    for i in range(F - 1, -1, -1):  # heaviest filler first
        used = i < nf
        g = np.where(room > 0, gl, np.inf).argmin(1)
        ok = used & (room[rr, g] > 0)
        take[ok, i] = g[ok]
        gl[rr[ok], g[ok]] += xr[rr[ok], light[ok, i]]
        room[rr[ok], g[ok]] -= 1
    # new content: hot GPUs' filler slots get the chosen light items; light items' slots
    # that are not hot filler slots get the displaced fillers
    new = p2l[rows].copy()
    old = p2l[rows]
    # slots of hot GPUs other than the dominating one, in GPU order: [Rr, k, s-1]
    nondom = np.ones((Rr, k, s), dtype=bool)
    nondom[rr[:, None], np.arange(k)[None, :], np.take_along_axis(dom[rows], hg, 1)] = False
    fslots = filler_slots.reshape(Rr, k, s)[nondom].reshape(Rr, k, s - 1)
    # order the chosen fillers by target GPU to fill its slots in turn
    key = np.where(take >= 0, take, k) * F + np.arange(F)
    order = np.argsort(key, 1, kind="stable")
    tk = np.take_along_axis(take, order, 1)
    src = np.take_along_axis(light, order, 1)  # light item slots grouped by target GPU
    # position of every filler within its target GPU
    same = np.ones_like(tk, dtype=bool)
    same[:, 1:] = tk[:, 1:] == tk[:, :-1]
    idx = np.arange(F)[None, :].repeat(Rr, 0)
    start = np.where(~same, idx, 0)
    start = np.maximum.accumulate(start, 1)
    pos = idx - start  # [Rr, F]
    valid = tk < k
    dst = np.where(valid, fslots[rr[:, None], np.minimum(tk, k - 1), np.minimum(pos, s - 2)], -1)
    # moving light items into dst; the displaced fillers (dst slots whose item is not a
    # chosen light item) go to the light slots that are not filler slots
    chosen = np.zeros((Rr, p), dtype=bool)
    chosen[rr[:, None].repeat(F, 1)[valid], src[valid]] = True
    dst_mask = np.zeros((Rr, p), dtype=bool)
    dst_mask[rr[:, None].repeat(F, 1)[valid], dst[valid]] = True
    new[rr[:, None].repeat(F, 1)[valid], dst[valid]] = old[rr[:, None].repeat(F, 1)[valid], src[valid]]
    freed = chosen & ~dst_mask  # light slots to refill with displaced items
    displaced = dst_mask & ~chosen  # filler slots whose old item must go somewhere
    nfree = freed.sum(1)
    ok_rows = nfree == displaced.sum(1)
    fo = np.argsort(~freed, 1, kind="stable")  # freed slots first, ascending
    do = np.argsort(~displaced, 1, kind="stable")
    kmax = int(nfree.max()) if nfree.size else 0
    sel = np.arange(kmax)[None, :] < nfree[:, None]
    rsel = rr[:, None].repeat(kmax, 1)[sel]
    new[rsel, fo[:, :kmax][sel]] = old[rsel, do[:, :kmax][sel]]
    better = ok_rows & (_max_load(w[rows], new, m) < _max_load(w[rows], old, m)) & ~_has_duplicates(new, m)
    out = p2l.copy()
    out[rows[better]] = new[better]
    return out


# ==== the whole pipeline on a set of rows =============================================


def _solve(w: np.ndarray, p: int, m: int, share: float = 1.0) -> np.ndarray:
    """From-scratch placement of rows w [R, n] onto p slots of m GPUs: p2l [R, p].
    `share` < 1 scales the improvement budgets down (and lets them reach zero) when the
    caller has other work to do in the same time."""
    R, n = w.shape
    s = p // m
    cap = m
    size = R * p
    c = replica_counts(w, p, cap)  # [R, n]
    p2l = _repair_duplicates(w, _pack(w, c, m), m)
    lo = 1 if share >= 1 else 0
    # on large problems the improvement phases skip rows already within 0.05% of perfect
    # balance (the budget is set by the size, so the time only goes down)
    good = 1 + (_GOOD_ENOUGH if size > _SMALL else 0.0)
    mean = np.maximum(w.sum(1) / m, 1e-300)
    many_rows = max(1, R // 64) if size > _SMALL else 1  # per-row overhead of large problems
    if s > 2:
        iters = _iterations(int(_PAIR_WORK * share), size * many_rows, (_PAIR_ITERS[0] * lo, _PAIR_ITERS[1]))
        r = np.nonzero(_max_load(w, p2l, m) > good * mean)[0]
        if r.size:
            p2l[r] = _improve_pairs(w[r], p2l[r], m, iters)
        max_iters = _iterations(int(_MAX_WORK * share), size ** 2 * many_rows, _MAX_ITERS)
    else:
        max_iters = _iterations(int(_MAX2_WORK * share), size, (lo, _MAX_ITERS[1]))
    if max_iters > 0:
        r = np.nonzero(_max_load(w, p2l, m) > good * mean)[0]
        if r.size:
            p2l[r], _ = _improve_max(w[r], p2l[r], m, cap, budget=max_iters)
    steps = _iterations(int(_COUNT_WORK * share), R * 4 * n * p, _COUNT_ITERS) if s == 2 and p > n else 0
    if steps > 0:
        # the count search scores counts by the best pairing, which may pair two replicas of
        # one expert; its counts are kept only where the real (duplicate-free) plan is better
        searched = _repair_duplicates(w, _pack(w, _count_search_pairs(w, c, m, cap, steps), m), m)
        if max_iters > 0:
            searched, _ = _improve_max(w, searched, m, cap, budget=max_iters)
        better = _max_load(w, searched, m) < _max_load(w, p2l, m)
        p2l = np.where(better[:, None], searched, p2l)
    return _refill_hot(w, p2l, m)


def _max_load(w: np.ndarray, p2l: np.ndarray, m: int) -> np.ndarray:
    """Max GPU load per row [R] with even split."""
    c = _counts_of(p2l, w.shape[1])
    return _gpu_sums(_slot_loads(w, p2l, c), m).max(1)


# ==== keeping experts where they were ==================================================


def _align(new: np.ndarray, old: np.ndarray, m: int, n: int, rounds: int = 4) -> np.ndarray:
    """Relabel the GPUs of `new` [R, p] (and order the slots inside each GPU) so that as
    many experts as possible stay on the GPU and in the slot that held them in `old`.
    GPU loads are unchanged, only their labels. Greedy matching by proposals: every new
    GPU proposes to the old GPU that held most of its experts (each expert counted on the
    GPU of its first old replica); every old GPU accepts its best proposer; a few rounds;
    the rest are matched in index order."""
    R, p = new.shape
    s = p // m
    rows = np.arange(R)
    gpu = np.arange(p) // s
    # old GPU of the first old replica of every expert (experts absent from `old`: -1)
    first = np.full(R * n, -1, dtype=np.int64)
    flat_old = (old + (rows * n)[:, None]).ravel()
    first[flat_old[::-1]] = np.tile(gpu, R)[::-1]  # written last = lowest slot wins
    E = new.reshape(R, m, s)  # [R, m, s]
    cand = first[(E + (rows * n)[:, None, None])]  # [R, m, s] candidate old GPU per item
    # ov: how many items of the same new GPU have the same candidate (a bincount)
    pair_key = ((rows[:, None, None] * m + np.arange(m)[None, :, None]) * (m + 1) + cand + 1).ravel()
    ov = np.bincount(pair_key, minlength=R * m * (m + 1))[pair_key].reshape(R, m, s)
    ov = np.where(cand >= 0, ov, 0)
    match = np.full((R, m), -1, dtype=np.int64)  # new GPU -> old GPU
    taken = np.zeros(R * m, dtype=bool)  # old GPU already matched
    row_m = (rows * m)[:, None]
    key_g = m - np.arange(m)  # lower new GPU index wins ties
    for _ in range(rounds):
        free_g = match < 0  # [R, m]
        avail = (cand >= 0) & ~taken[np.maximum(cand, 0) + row_m[..., None]] & free_g[..., None]
        score = np.where(avail, ov, 0)  # [R, m, s]
        pick = score.argmax(-1)
        best = np.take_along_axis(score, pick[..., None], -1)[..., 0]  # [R, m]
        target = np.take_along_axis(cand, pick[..., None], -1)[..., 0]
        propose = best > 0
        if not propose.any():
            break
        key = np.where(propose, best * (m + 1) + key_g, -1)  # [R, m] unique per new GPU
        top = np.full(R * m, -1, dtype=np.int64)
        tflat = (np.maximum(target, 0) + row_m).ravel()
        np.maximum.at(top, tflat[propose.ravel()], key.ravel()[propose.ravel()])
        win = propose & (key == top[tflat].reshape(R, m))
        match[win] = target[win]
        taken[(target + row_m)[win]] = True
    # leftovers: k-th unmatched new GPU takes the k-th free old GPU
    free_new = np.argsort(match >= 0, axis=1, kind="stable")  # unmatched first
    free_old = np.argsort(taken.reshape(R, m), axis=1, kind="stable")  # free first
    left = np.arange(m)[None, :] < (match < 0).sum(1, keepdims=True)
    rr2 = np.broadcast_to(rows[:, None], (R, m))
    match[rr2[left], free_new[left]] = free_old[left]
    # slots inside each GPU: an expert that stays keeps its old slot
    # old slot (inside its GPU) of every (row, old GPU, expert), -1 if absent
    slot_in = np.full(R * m * n, -1, dtype=np.int16)
    slot_in[((rows[:, None] * m + gpu[None, :]) * n + old).ravel()] = np.tile(np.arange(p) % s, R)
    v_of = slot_in[((rows[:, None, None] * m + match[..., None]) * n + E).ravel()].reshape(R, m, s)
    hit = v_of >= 0  # [R, m, s] new item u stays in old slot v_of
    base = (rows[:, None, None] * m + np.arange(m)[None, :, None]) * s  # [R, m, 1]
    used = np.zeros(R * m * s, dtype=bool)
    used[(base + v_of)[hit]] = True
    used = used.reshape(R, m, s)
    # the k-th mover of a GPU takes its k-th free slot
    f_rank = np.cumsum(~used, -1) - 1
    slot_of_rank = np.zeros(R * m * s, dtype=np.int64)
    slot_of_rank[(base + f_rank)[~used]] = np.broadcast_to(np.arange(s), (R, m, s))[~used]
    u_rank = np.cumsum(~hit, -1) - 1  # rank of u among movers
    dest = np.where(hit, v_of, slot_of_rank[(base + np.maximum(u_rank, 0)).ravel()].reshape(R, m, s))
    out = np.empty_like(new)
    out[rows[:, None, None], match[..., None] * s + dest] = E
    return out


def _plan_rows(w: np.ndarray, p: int, m: int, prev: Optional[np.ndarray], tol: float) -> np.ndarray:
    """Placement of rows w [R, n]: from scratch, or from `prev` [R, p] (rows of -1 = no
    previous) with at most (1 + tol) times the from-scratch max GPU load."""
    R, n = w.shape
    cap = m
    has_prev = np.zeros(R, dtype=bool) if prev is None else (prev >= 0).all(1)
    if not has_prev.any():
        return _solve(w, p, m)
    # the from-scratch plan is the reference (and the fallback); on large problems (more
    # than 8192 slots in all) it gets half the budget so that the moves from the previous
    # placement fit in the rest
    scratch = _solve(w, p, m, share=1.0 if R * p <= _SMALL else 0.5)
    out = scratch.copy()
    r = np.nonzero(has_prev)[0]
    old = prev[r]
    # a previous placement may hold more than m replicas of an expert (not placeable without
    # two on one GPU); such rows restart from scratch, only relabelled
    ok_counts = _counts_of(old, n).max(1) <= cap
    target = (1.0 + tol) * _max_load(w[r], scratch[r], m) * (1 + 1e-12)
    local = old.copy()
    sel = np.nonzero(ok_counts)[0]
    if sel.size:
        local[sel] = _repair_duplicates(w[r[sel]], old[sel], m)
        iters = _iterations(_PREV_WORK, (sel.size * p) ** 2, _PREV_ITERS)
        if iters > 0:  # large problems: only the layers already within tolerance stay
            local[sel], _ = _improve_max(w[r[sel]], local[sel], m, cap, target=target[sel], budget=iters)
    reached = ok_counts & (_max_load(w[r], local, m) <= target) & ~_has_duplicates(local, m)
    out[r[reached]] = local[reached]
    miss = np.nonzero(~reached)[0]
    if miss.size:
        out[r[miss]] = _align(scratch[r[miss]], old[miss], m, n)
    return out


# ==== expert groups onto nodes ========================================================

_PARTITIONS: dict[tuple[int, int], np.ndarray] = {}


def _partitions(G: int, k: int) -> Optional[np.ndarray]:
    """All ways to split G groups into k unlabelled blocks of G/k, as block index arrays
    [X, G] (block of each group, blocks numbered by their smallest group), or None when
    there are more than 20000."""
    key = (G, k)
    if key not in _PARTITIONS:
        size = G // k
        count = 1
        rest = G
        for _ in range(k):
            count *= comb(rest - 1, size - 1)
            rest -= size
        if count > 20000:
            _PARTITIONS[key] = None
        else:
            out = []

            def rec(assign, remaining, block):
                if not remaining:
                    out.append(list(assign))
                    return
                head, others = remaining[0], remaining[1:]
                for mates in itertools.combinations(others, size - 1):
                    for g in (head, *mates):
                        assign[g] = block
                    rec(assign, [g for g in others if g not in mates], block + 1)

            rec([0] * G, list(range(G)), 0)
            _PARTITIONS[key] = np.array(out, dtype=np.int64)
    return _PARTITIONS[key]


def _groups_to_nodes(group_load: np.ndarray, k: int) -> np.ndarray:
    """Node of every group [L, G] (G/k groups per node) with the lowest max node load
    (then the lowest sum of squares): exhaustive when there are few splits, otherwise
    packing plus pair exchanges (groups as items, nodes as GPUs)."""
    L, G = group_load.shape
    if k == G:
        return np.broadcast_to(np.arange(G), (L, G)).copy()
    parts = _partitions(G, k)
    if parts is not None:
        members = np.argsort(parts * G + np.arange(G), axis=1, kind="stable").reshape(len(parts), k, G // k)
        gl = group_load[:, members]  # [L, X, k, G/k] loads of the groups of every node
        node = gl[..., 0].copy()
        for j in range(1, G // k):  # fixed summation order
            node += gl[..., j]
        best = _lexmin(node.max(-1), (node * node).sum(-1))
        return parts[best]
    ones = np.ones((L, G), dtype=np.int64)
    p2l = _pack(group_load, ones, k)  # [L, G] group of each "slot"
    p2l = _improve_pairs(group_load, p2l, k, 40)
    node = np.empty((L, G), dtype=np.int64)
    node[np.arange(L)[:, None], p2l] = np.arange(G) // (G // k)
    return node


def _node_assignment_of(prev: np.ndarray, N: int, G: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Node of every group [L, G] in a previous placement [L, P], and [L] bool: whether
    that placement keeps whole groups on nodes with G/k groups each."""
    L, P = prev.shape
    gs = N // G
    slot_node = np.arange(P) // (P // k)  # [P]
    grp = prev // gs  # [L, P]
    node = np.full((L, G), -1, dtype=np.int64)
    node[np.arange(L)[:, None], grp] = slot_node[None, :]
    # valid: every group seen on exactly one node, G/k groups per node
    seen = np.zeros((L, G, k), dtype=bool)
    seen[np.arange(L)[:, None], grp, slot_node[None, :]] = True
    valid = (seen.sum(-1) == 1).all(1)
    per_node = (node[:, :, None] == np.arange(k)).sum(1)  # [L, k]
    valid &= (per_node == G // k).all(1)
    return node, valid


# ==== weighted replicas =================================================================


def _components(p2l: np.ndarray, m: int, n: int) -> np.ndarray:
    """Connected components of the GPUs of every row, two GPUs being linked when they
    hold replicas of one expert: label [R, m] (smallest GPU index of the component)."""
    R, p = p2l.shape
    s = p // m
    label = np.broadcast_to(np.arange(m), (R, m)).copy()  # [R, m]
    flat_e = (p2l + (np.arange(R) * n)[:, None]).ravel()  # [R*p]
    for _ in range(m):
        slot_label = np.repeat(label, s, axis=1).ravel()  # [R*p]
        e_label = np.full(R * n, m, dtype=np.int64)
        np.minimum.at(e_label, flat_e, slot_label)
        new = e_label[flat_e].reshape(R, m, s).min(-1)  # [R, m]
        if np.array_equal(new, label):
            break
        label = new
    return label


def _connect_for_shares(w: np.ndarray, p2l: np.ndarray, m: int, max_iters: int = 64) -> np.ndarray:
    """Weighted replicas can only move load between GPUs linked by a replicated expert
    (GPUs that hold only single-replica experts keep their load whatever the shares).
    While the component with the highest mean load is above the row mean, swap one of its
    slots with a slot of another component such that one of the two experts has another
    replica (the swap links the two components), choosing the two slots with the closest
    loads. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    gpu = np.arange(p) // s
    p2l = p2l.copy()
    active = np.ones(R, dtype=bool)
    for _ in range(max_iters):
        ra = np.nonzero(active)[0]
        if ra.size == 0:
            break
        P_ = p2l[ra]
        A_ = ra.size
        ar = np.arange(A_)
        c = _counts_of(P_, n)
        x = _slot_loads(w[ra], P_, c)
        load = _gpu_sums(x, m)  # [A, m]
        label = _components(P_, m, n)  # [A, m]
        flat = (label + (ar * m)[:, None]).ravel()
        size = np.bincount(flat, minlength=A_ * m).reshape(A_, m)
        total = np.bincount(flat, weights=load.ravel(), minlength=A_ * m).reshape(A_, m)
        avg = np.where(size > 0, total / np.maximum(size, 1), -np.inf)  # [A, m] by label
        hot = avg.argmax(1)  # label of the heaviest component
        mean = load.mean(1)
        need = ((size > 0).sum(1) > 1) & (avg[ar, hot] > mean * (1 + 1e-9))
        slot_lab = label[:, gpu]  # [A, p]
        in_hot = slot_lab == hot[:, None]
        multi = _take(c, P_) >= 2  # [A, p]
        on = _presence(P_, m, n)
        ok = in_hot[:, :, None] & ~in_hot[:, None, :]  # [A, p(u), p(v)]
        ok &= multi[:, :, None] | multi[:, None, :]
        ok &= ~on[ar[:, None, None], gpu[None, None, :], P_[:, :, None]]  # a not on v's GPU
        ok &= ~on[ar[:, None, None], gpu[None, :, None], P_[:, None, :]]  # b not on u's GPU
        ok &= need[:, None, None]
        gap = np.abs(x[:, :, None] - x[:, None, :])
        score = np.where(ok, gap, np.inf).reshape(A_, -1)
        best = score.argmin(1)
        can = np.isfinite(score[ar, best])
        active[ra[~can]] = False
        r = ar[can]
        u, v = best[can] // p, best[can] % p
        t = P_[r, u].copy()
        P_[r, u] = P_[r, v]
        P_[r, v] = t
        p2l[ra] = P_
    return p2l


def replica_shares(w: np.ndarray, p2l: np.ndarray, m: int, iters: int = 300) -> np.ndarray:
    """Per-slot shares [R, p] (each expert's shares sum to 1) that even out GPU loads.

    Every iteration, every expert with several replicas water-fills its tokens over its
    replicas given the other load on their GPUs (the level at which its replicas' GPUs
    would be equal), and moves half way there; all experts and rows at once. The best
    iterate per row (lowest max GPU load) is returned."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    rows = np.arange(R)
    c = _counts_of(p2l, n)  # [R, n]
    x = _slot_loads(w, p2l, c)  # [R, p] tokens per slot
    cmax = int(c.max())
    share_even = 1.0 / _take(c, p2l)
    if cmax < 2 or R == 0:
        return share_even
    # slots of every expert [R, n, cmax], -1 padded (ascending slot order)
    order = _argsort_rows(p2l.astype(np.float64))  # [R, p]
    e_sorted = _take(p2l, order)
    start = np.cumsum(c, 1) - c  # [R, n]
    rank = np.arange(p)[None, :] - _take(start, e_sorted)
    slots = np.full((R, n, cmax), -1, dtype=np.int64)
    slots[rows[:, None], e_sorted, rank] = order
    valid = slots >= 0  # [R, n, cmax]
    multi = c >= 2  # [R, n]
    safe = np.where(valid, slots, 0)
    gpu_of = safe // s  # [R, n, cmax]
    we = w[..., None]
    best_x = x.copy()
    load = _gpu_sums(x, m)
    best_max = load.max(1)
    kk = np.arange(1, cmax + 1)
    flat_slots = (safe + (rows * p)[:, None, None]).ravel()  # padded entries add 0 to slot 0
    stall = 0
    for _ in range(iters):
        load = _gpu_sums(x, m)
        mx = load.max(1)
        better = mx < best_max * (1 - 1e-10)
        stall = 0 if better.any() else stall + 1
        if stall > 25:  # no row improved for a while: converged
            break
        best_max = np.where(better, mx, best_max)
        best_x[better] = x[better]
        xs = _take(x, safe.reshape(R, -1)).reshape(R, n, cmax)
        other = _take(load, gpu_of.reshape(R, -1)).reshape(R, n, cmax) - xs  # load without e
        other = np.where(valid, other, np.inf)
        o_sorted = np.sort(other, -1)
        csum = np.cumsum(np.where(np.isfinite(o_sorted), o_sorted, 0.0), -1)
        level = (we + csum) / kk  # [R, n, cmax] level if the k lowest get tokens
        fits = (level > o_sorted) & np.isfinite(o_sorted)
        nfit = np.maximum(fits.sum(-1), 1)  # [R, n]
        lam = np.take_along_axis(level, (nfit - 1)[..., None], -1)  # [R, n, 1]
        goal = np.where(valid, np.maximum(lam - other, 0.0), 0.0)  # [R, n, cmax]
        step = np.where(multi[..., None] & valid, 0.5 * (goal - xs), 0.0)  # [R, n, cmax]
        x = x + np.bincount(flat_slots, weights=step.ravel(), minlength=R * p).reshape(R, p)
    load = _gpu_sums(x, m)
    mx = load.max(1)
    better = mx < best_max
    best_x[better] = x[better]
    we_slot = _take(w, p2l)  # [R, p]
    shares = np.where(we_slot > 0, best_x / np.where(we_slot > 0, we_slot, 1.0), share_even)
    shares = np.maximum(shares, 0.0)
    # exact normalisation per expert
    tot = np.zeros(R * n)
    np.add.at(tot, (p2l + (rows * n)[:, None]).ravel(), shares.ravel())
    shares = shares / _take(tot.reshape(R, n), p2l)
    return shares


def _break_tight_sets(w: np.ndarray, p2l: np.ndarray, m: int, rounds: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """With shares, the max GPU load is set by the heaviest set S of GPUs that holds
    every replica of its experts (load(S) / |S|; water-filling ends with S at one level).
    Each round swaps, per layer, one slot of such an expert inside S with a slot outside
    S (so that the expert can move load out), choosing the swap that lowers the estimate
    max(load(S after) / |S|, load of the receiving GPU) most, recomputes the shares and
    keeps the swap only where the max GPU load drops. Returns (p2l, shares)."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    gpu = np.arange(p) // s
    shares = replica_shares(w, p2l, m)
    p2l = p2l.copy()
    rows = np.arange(R)
    for _ in range(rounds):
        x = _take(w, p2l) * shares  # [R, p] tokens per slot
        load = _gpu_sums(x, m)
        top = load.max(1)
        mean = load.mean(1)
        active = top > mean * (1 + 1e-4)
        if not active.any():
            break
        tight = load >= (top - 0.1 * (top - mean))[:, None]  # [R, m] the top level
        size = tight.sum(1)
        in_t = tight[rows[:, None], gpu[None, :]]  # [R, p]
        flat = (p2l + (rows * n)[:, None]).ravel()
        outside = np.bincount(flat, weights=(~in_t).ravel(), minlength=R * n).reshape(R, n)
        closed = _take(outside, p2l) == 0  # [R, p] slot of an expert with no replica outside S
        c = _counts_of(p2l, n)
        wt = (load * tight).sum(1)  # [R] load of S
        on = _presence(p2l, m, n)
        u_ok = in_t & closed  # candidate slots inside S
        v_ok = ~in_t  # candidate slots outside S
        a, b = p2l[:, :, None], p2l[:, None, :]  # [R, p, 1], [R, 1, p]
        ok = u_ok[:, :, None] & v_ok[:, None, :]
        ok &= ~on[rows[:, None, None], gpu[None, None, :], a]  # a not on v's GPU
        ok &= ~on[rows[:, None, None], gpu[None, :, None], b]  # b not on u's GPU
        wa = _take(w, p2l)  # [R, p]
        b_closed_after = (_take(c, p2l) == 1)[:, None, :] | (_take(outside, p2l) == 1)[:, None, :]
        w_s_after = wt[:, None, None] - wa[:, :, None] + np.where(b_closed_after, wa[:, None, :], 0.0)
        recv = load[rows[:, None], gpu[None, :]][:, None, :] - x[:, None, :] + np.where(
            (_take(c, p2l) == 1)[:, :, None], wa[:, :, None], x[:, :, None])
        est = np.maximum(w_s_after / size[:, None, None], recv)
        est = np.where(ok & active[:, None, None], est, np.inf).reshape(R, -1)
        j = est.argmin(1)
        do = est[rows, j] < top * (1 - 1e-9)
        if not do.any():
            break
        r = rows[do]
        u, v = j[do] // p, j[do] % p
        trial = p2l.copy()
        trial[r, u], trial[r, v] = p2l[r, v], p2l[r, u]
        t_shares = replica_shares(w[r], trial[r], m)
        t_max = _gpu_sums(_take(w[r], trial[r]) * t_shares, m).max(1)
        keep = t_max < top[r] * (1 - 1e-9)
        if not keep.any():
            break
        p2l[r[keep]] = trial[r[keep]]
        shares[r[keep]] = t_shares[keep]
    return p2l, shares


# ==== the policy ==========================================================================


def balanced_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    """Balanced expert placement (registered as `balanced` and as `default`).

    From the same inputs as DeepSeek EPLB it balances better: replica counts that fit the
    packing (a count search when GPUs have two slots, count-changing moves otherwise),
    packing in rounds, pair exchanges and moves on the most loaded GPU. Never two
    replicas of one expert on one GPU (unless a GPU has more slots than there are
    experts to fill them; then it returns DeepSeek's placement). With expert groups that
    divide over the nodes (`num_groups % num_nodes == 0`, num_nodes > 1) it keeps
    DeepSeek's node locality: whole groups go to nodes (G/nodes each, lowest max node
    load), and every replica of an expert stays on its group's node. Otherwise the
    placement is global, as DeepSeek's. Deterministic: stable orders with explicit
    tie-breaks, iteration budgets from the problem size only, no randomness.

    `previous` (the placement in force) and `options.move_tolerance` (tol, default 0.02)
    trade balance for moves. A layer is kept as it is if its max GPU load is already at
    most (1 + tol) x the from-scratch plan's; otherwise the planner moves one or two slots
    at a time from `previous`, aimed at the most loaded GPU (swaps, replica count
    changes), until it is; a layer that does not get there takes the from-scratch plan
    with its GPUs relabelled so that experts stay where they were when possible.
    tol = 0: the from-scratch balance whatever it moves; 0.02 moved about a fifth of the
    copies DeepSeek moves per rebalance in the ESFT replay of benchmarks/planner.py;
    larger values move less and accept more imbalance. On large problems (more than
    8192 slots over all layers) the step-by-step moves are skipped for time: a layer
    keeps its previous placement within tolerance, else takes the relabelled plan. In
    the hierarchical case the previous group-to-node assignment is kept while its max
    node load is within the same tolerance.

    `options.weighted`: also return per-slot shares [L, P] (each expert's shares sum to
    1), from damped water-filling of every expert over its replicas; they remove most of
    the imbalance that whole replicas leave (with P = N there is nothing to share and the
    shares are all 1).

    benchmarks/planner.py measures all of this against `deepseek` (see benchmarks/README.md).
    """
    w = np.asarray(load, dtype=np.float64)  # [L, N]
    L, N = w.shape
    P, M = int(num_slots), int(num_gpus)
    tol = 0.02 if options is None else float(options.move_tolerance)
    weighted = False if options is None else bool(options.weighted)
    prev = None if previous is None else np.asarray(previous.physical_to_logical, dtype=np.int64)  # [L, P]
    k = int(num_nodes)
    hierarchical = k > 1 and num_groups % k == 0
    if (P * k > N * M) if hierarchical else (P > N * M):
        # more slots per GPU than experts to fill them: duplicates cannot be avoided
        from eplb.policy import deepseek_policy

        p2l = deepseek_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)
    elif not hierarchical:
        p2l = _plan_rows(w, P, M, prev, tol)
    else:
        p2l = _plan_hierarchical(w, P, M, k, int(num_groups), prev, tol)
    if not weighted:
        return p2l
    shares = replica_shares(w, p2l, M)
    if P > N and not ((P * k > N * M) if hierarchical else (P > N * M)):
        # also try a variant that links isolated GPUs (inside every node in the
        # hierarchical case); keep, per layer, the better one
        if hierarchical:
            sub = p2l.reshape(L * k, P // k)
            linked = _connect_for_shares(np.repeat(w, k, axis=0), sub, M // k).reshape(L, P)
        else:
            linked = _connect_for_shares(w, p2l, M)
        linked_shares = replica_shares(w, linked, M)
        a = _gpu_sums(_take(w, p2l) * shares, M).max(1)
        b = _gpu_sums(_take(w, linked) * linked_shares, M).max(1)
        use = b < a
        p2l = np.where(use[:, None], linked, p2l)
        if not hierarchical:  # (swaps across nodes would break locality)
            p2l, shares = _break_tight_sets(w, p2l, M)
        else:
            shares = np.where(use[:, None], linked_shares, shares)
    return p2l, shares


def _plan_hierarchical(w, P, M, k, G, prev, tol) -> np.ndarray:
    """Groups -> nodes, then every (layer, node) is a row of the flat planner."""
    L, N = w.shape
    gs = N // G  # experts per group
    group_load = w.reshape(L, G, gs).sum(-1)  # [L, G]
    node = _groups_to_nodes(group_load, k)  # [L, G]
    if prev is not None:
        prev_node, valid = _node_assignment_of(prev, N, G, k)
        onehot = (prev_node[:, :, None] == np.arange(k))
        prev_max = (group_load[:, :, None] * onehot).sum(1).max(1)  # sums over axis 1: fixed order
        new_max = (group_load[:, :, None] * (node[:, :, None] == np.arange(k))).sum(1).max(1)
        keep = valid & (prev_max <= (1 + tol) * new_max * (1 + 1e-12))
        node = np.where(keep[:, None], prev_node, node)
        node = _relabel_nodes(node, prev_node, valid & ~keep, k)
    # experts of every node, ascending: [L, k, N/k]
    expert_node = np.repeat(node, gs, axis=1)  # [L, N]
    order = _argsort_rows(expert_node.astype(np.float64))  # [L, N] experts grouped by node, ascending ids
    node_experts = order.reshape(L, k, N // k)
    sub_w = _take(w, order).reshape(L * k, N // k)  # [L*k, N/k]
    Pk, Mk = P // k, M // k
    sub_prev = None
    if prev is not None:
        local = np.full((L, N), -1, dtype=np.int64)  # local id of every expert in its node
        local[np.arange(L)[:, None], order] = np.tile(np.arange(N // k), k)
        lid = _take(local, prev).reshape(L, k, Pk)
        same_node = (_take(expert_node, prev).reshape(L, k, Pk) == np.arange(k)[None, :, None]).all(-1)  # [L, k]
        sub_prev = np.where(same_node[..., None], lid, -1).reshape(L * k, Pk)
        # every local expert must appear in its node's previous slots
        seen = np.zeros((L * k, N // k), dtype=bool)
        sp = np.maximum(sub_prev, 0)
        seen[np.arange(L * k)[:, None], sp] = True
        sub_prev[~seen.all(1)] = -1
    sub = _plan_rows(sub_w, Pk, Mk, sub_prev, tol)  # [L*k, P/k] local ids
    glob = np.take_along_axis(node_experts.reshape(L * k, -1), sub, 1)  # [L*k, P/k]
    return glob.reshape(L, P)


def _relabel_nodes(node: np.ndarray, prev_node: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """For the layers in `rows` (new group-to-node assignment), renumber the new nodes so
    that each takes the previous node sharing most groups with it (greedy over k steps,
    all layers at once). node, prev_node [L, G] -> [L, G]."""
    if not rows.any():
        return node
    L = node.shape[0]
    new1 = (node[:, :, None] == np.arange(k)).astype(np.int64)  # [L, G, k]
    old1 = (prev_node[:, :, None] == np.arange(k)).astype(np.int64)
    ov = np.einsum("lgi,lgj->lij", new1, old1)  # [L, k new, k old] shared groups
    mapping = np.full((L, k), -1, dtype=np.int64)
    used = np.zeros((L, k), dtype=bool)
    lr = np.arange(L)
    for _ in range(k):
        o = np.where((mapping[:, :, None] < 0) & ~used[:, None, :], ov, -1).reshape(L, -1)
        flat = o.argmax(1)  # first best (new, old) pair
        i, j = flat // k, flat % k
        mapping[lr, i] = j
        used[lr, j] = True
    relabelled = np.take_along_axis(mapping, node, 1)
    return np.where(rows[:, None], relabelled, node)
