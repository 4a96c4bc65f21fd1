"""Packing replicas onto GPUs (step 2 of the `balanced` planner): rounds of heavy and
light items, duplicate repair, and the refill of GPUs dominated by one hot item."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from eplb.core.policy.balanced.replicas import expand
from eplb.core.policy.balanced.rows import argsort_rows, counts_of, gpu_sums, has_duplicates, max_load, presence, slot_loads, take


def pack(w: np.ndarray, c: np.ndarray, m: int, with_loads: bool = False):
    """Pack the replicas (expert e: c[r, e] items of w[r, e] / c[r, e]) onto m GPUs with
    exactly s items each, in s rounds. Items sorted heavy -> light; in every round the
    GPUs below the current mean GPU load take the next heaviest items (heaviest to the
    lightest GPU) and the GPUs at or above it take the lightest remaining items (lightest
    to the heaviest GPU), which is what a greedy that always feeds the lightest GPU ends
    up doing. An item whose expert is already on its GPU trades GPUs with the
    nearest item of the round for which that is not the case (replicas of one expert
    are neighbours in the order, so this is rare). Returns p2l [R, p]; with `with_loads`
    also its GPU loads [R, m], summed slot by slot like `rows.gpu_sums` (so bit for bit
    those of `rows.max_load`, the counts being c >= 1)."""
    R, n = w.shape
    p = int(c[0].sum())
    s = p // m
    piece = w / c  # [R, n]
    order = _heavy_first(piece)  # [R, n] experts heavy first
    rows = np.arange(R, dtype=np.int64)
    order += (rows * n)[:, None]  # flat expert r * n + e
    items = np.repeat(order.ravel(), c.ravel()[order.ravel()])  # [R * p] flat expert of each item, heavy first
    sizes = piece.ravel()[items]  # [R * p]
    held = np.zeros(R * n * m, dtype=bool)  # GPU holds expert, flat [(r * n + e) * m + g]
    hold = items * m  # [R * p] flat (expert, GPU 0) of every item in held
    # The arrays of a round are [R, m] (item j of the round, in row r) and contiguous:
    # an operation that broadcasts an [R, 1] array costs a loop per row.
    row_m = np.repeat(rows * m, m).reshape(R, m)  # [R, m] r * m
    j = np.tile(np.arange(m, dtype=np.int64), R).reshape(R, m)  # [R, m] j
    ib = max(1, int(m).bit_length())  # argsort_rows(load) inlined: keys = value bits, then GPU index
    low = (1 << ib) - 1
    # Item j of round t >= 1 takes the flat item base (the next heavy items) when its GPU
    # is open, else base + p - m (t + 1) (the last light items left), where
    # base = r * p + m t + j - (GPUs closed in the rounds before).
    base = (rows * p)[:, None] + j  # [R, m]
    # Row c of these tables is for a row with c closed GPUs: 1 for the items j >= m - c,
    # which go to the closed GPUs, and the number of open GPUs m - c. Taking an [R] index,
    # they broadcast per-row values to [R, m] in one pass; worth it while they are smaller
    # than the [R, m] arrays of a round.
    tables = m < R
    if tables:
        cs = np.arange(m + 1, dtype=np.int64)[:, None]  # [m + 1, 1]
        to_closed = (j[0] >= m - cs).astype(np.int64)  # [m + 1, m]
        opened = np.repeat(m - cs, m, axis=1)  # [m + 1, m]
    gpus = np.empty((R, m), dtype=np.int64)  # [R, m] GPU of item j of the round
    pick = np.empty((R, m), dtype=np.int64)  # [R, m] flat item j of the round
    gflat = np.empty((R, m), dtype=np.int64)  # [R, m] its flat GPU r * m + g
    taken = np.empty((s, R, m), dtype=np.int64)  # [round, R, GPU] flat item taken; p2l is read from it at the end
    # round 0: the m heaviest items to GPUs 0..m-1 (all loads 0, nothing held yet)
    taken[0] = base
    held[hold[base] + j] = True
    load = sizes[base] + 0.0  # [R, m] >= 0, never -0.0: its bits order like its values
    base += m
    for rnd in range(1, s):
        # GPUs at or above the current mean load are closed
        mean = np.add.reduce(load, axis=1, keepdims=True)
        mean /= m  # = load.mean(1, keepdims=True), bit for bit, without its Python overhead
        if m == 8:
            # a row of 8 bools is one 64-bit word of 0/1 bytes; times 0x0101..01, its top
            # byte is their sum (at most 8: no carry); cheaper than a reduce over rows
            closed = (load >= mean).view(np.uint64)  # [R, 1]
            closed *= 0x0101010101010101
            closed >>= 56
            closed = closed.view(np.int64).reshape(R)
        else:
            closed = np.add.reduce(load >= mean, axis=1, dtype=np.int64)  # [R]
        np.bitwise_and(load.view(np.int64), ~low, out=gpus)
        gpus |= j
        gpus.sort(axis=1)
        gpus &= low  # [R, m] lightest first; closed GPUs come last
        if tables:
            np.take(to_closed * (p - m * (rnd + 1)), closed, axis=0, out=pick, mode="clip")
            pick += base
            base += opened.take(closed, axis=0)  # += the row's open GPUs
        else:
            nopen = np.repeat(m - closed, m).reshape(R, m)  # [R, m] open GPUs of the row
            np.multiply(j >= nopen, p - m * (rnd + 1), out=pick)  # items j >= nopen go to closed GPUs
            pick += base
            base += nopen
        em = hold[pick]  # [R, m]
        hkey = em + gpus
        bad = held[hkey]
        if np.count_nonzero(bad):
            _untangle(gpus, em, bad, held)
            np.add(em, gpus, out=hkey)
        held[hkey] = True
        np.add(gpus, row_m, out=gflat)
        now = taken[rnd]  # [R, GPU]
        now.ravel()[gflat] = pick
        load += sizes[now]  # one addition per GPU, as load[r, gpus[r, j]] += sizes[pick[r, j]]
    p2l = items.take(taken.transpose(1, 2, 0))  # [R, GPU, round]: slot GPU * s + round
    p2l -= (rows * n)[:, None, None]  # expert ids within the row
    return (p2l.reshape(R, p), load) if with_loads else p2l.reshape(R, p)


def _heavy_first(v: np.ndarray) -> np.ndarray:
    """`argsort_rows(v, descending=True)`, bit for bit (int64 arithmetic wraps the same
    way), in fewer passes: its key (K - (bits >> ib)) << ib | index, with
    K = 2 ** (63 - ib) - 1, equals (K << ib) + index - (bits & ~low), since
    (bits >> ib) << ib = bits & ~low and the low ib bits of (K << ib) - (bits & ~low)
    are 0. [R, X] -> [R, X]."""
    X = v.shape[1]
    ib = max(1, int(X).bit_length())
    low = (1 << ib) - 1
    bits = np.maximum(v, 0.0)
    bits += 0.0
    key = bits.view(np.int64)
    key &= ~low
    np.subtract((((1 << (63 - ib)) - 1) << ib) + np.arange(X, dtype=np.int64), key, out=key)
    key.sort(axis=1)
    key &= low
    return key


def pack_pairs(w: np.ndarray, c: np.ndarray, m: int) -> np.ndarray:
    """Two slots per GPU: GPU i takes the i-th heaviest and the i-th lightest item (the
    best pairing when duplicates are ignored; `repair_duplicates` fixes the rare pair of
    two replicas of one expert). w, c [R, n] -> p2l [R, 2m]."""
    R, n = w.shape
    piece = w / c  # [R, n]
    order = argsort_rows(piece, descending=True)  # [R, n] experts heavy first
    items = expand(take(c, order), order)  # [R, 2m] expert of each item, heavy first
    p2l = np.empty_like(items)
    p2l[:, 0::2] = items[:, :m]
    p2l[:, 1::2] = items[:, ::-1][:, :m]
    return p2l


@lru_cache(maxsize=None)
def _distances(m: int) -> np.ndarray:
    """[m, m] |j - j0| (read-only)."""
    j = np.arange(m)
    d = np.abs(j[None, :] - j[:, None])
    d.flags.writeable = False
    return d


@lru_cache(maxsize=None)
def _nearest(m: int) -> tuple:
    """For every j0 < m: the other j < m by increasing |j - j0|, the lower one first on ties
    (the order in which `dist.argmin` of `_untangle` prefers them)."""
    return tuple(tuple(j for d in range(1, m) for j in (j0 - d, j0 + d) if 0 <= j < m) for j0 in range(m))


# Up to this many items in conflict (left), `_untangle` trades them one by one in Python:
# about a microsecond each, where one step of its [rows, m] passes costs some tens.
_FEW = 64


def _untangle(gpus, em, bad, held):
    """Within one packing round (item j of row r goes to GPU gpus[r, j]; em[r, j] + g is
    the flat index in held of its expert on GPU g), let every item whose expert that GPU
    already holds trade GPUs with the nearest item of the round for which both GPUs are
    free of the other's expert. bad [R, m]: the items in conflict. Changes gpus in place."""
    R, m = gpus.shape
    nz = np.flatnonzero(bad)  # flat items in conflict, row by row
    if nz.size <= _FEW:
        _untangle_few(gpus, em, held, nz)
        return
    dist0 = _distances(m)  # [m, m] |j - j0|
    rn = nz // m  # row of each item in conflict, ascending
    first = np.ones(nz.size, dtype=bool)  # first item in conflict of its row
    np.not_equal(rn[1:], rn[:-1], out=first[1:])
    rows = rn[first]  # [B] rows with a conflict; only these ever change
    j0 = nz[first] - rows * m  # [B] their first bad item
    g, ee, bad = gpus[rows], em[rows], bad[rows]  # [B, m]
    gf, ef, bf = g.ravel(), ee.ravel(), bad.ravel()
    live = np.arange(rows.size)  # [A] rows of g with a conflict left
    gl, el = g, ee  # [A, m] their GPUs and experts
    for _ in range(m):
        f0 = live * m
        f0 += j0  # [A] flat first bad item
        e0, g0 = ef[f0], gf[f0]
        no = held[gl + e0[:, None]]  # [A, m] GPU of item j holds e0
        no |= held[el + g0[:, None]]  # GPU g0 holds the expert of item j
        no |= el == e0[:, None]
        dist = dist0[j0]  # [A, m]
        dist[no] = m + 1
        j1 = dist.argmin(1)  # [A] nearest item to trade with (the lower one on ties)
        fixable = no.ravel()[np.arange(0, live.size * m, m) + j1]  # [A] no[a, j1[a]] ...
        np.logical_not(fixable, out=fixable)  # ... negated
        nfix = np.count_nonzero(fixable)
        if nfix < live.size:
            if nfix == 0:
                break
            # rows that could not be fixed are left to the repair pass
            live, f0, j1, g0 = live[fixable], f0[fixable], j1[fixable], g0[fixable]
        f1 = live * m
        f1 += j1
        # trade GPUs: both items are then free of conflict (what `no` ruled out) and the
        # other items keep theirs (held does not change within a round)
        gf[f0] = gf[f1]
        gf[f1] = g0
        bf[f0] = False
        bf[f1] = False
        rest = bad[live]  # [A, m] items still in conflict
        if np.count_nonzero(rest) <= _FEW:  # few left: one by one
            gpus[rows] = g
            f = np.flatnonzero(rest)
            _untangle_few(gpus, em, held, rows[live[f // m]] * m + f % m)
            return
        j0 = rest.argmax(1)  # [A] next bad item, if any
        still = bf[live * m + j0]
        nstill = np.count_nonzero(still)
        if nstill < live.size:
            if nstill == 0:
                break
            live, j0 = live[still], j0[still]
        gl, el = g[live], ee[live]
    gpus[rows] = g


def _untangle_few(gpus, em, held, nz):
    """`_untangle` for a few items in conflict (nz: their flat indices, ascending): the
    same trades, one item after the other, read and made through memoryviews (Python
    ints and bools, cheaper than numpy scalars)."""
    m = gpus.shape[1]
    near = _nearest(m)
    hv, gv, ev = memoryview(held), memoryview(gpus.ravel()), memoryview(em.ravel())  # gpus and em are contiguous
    traded = set()  # flat items that took a bad item's GPU: no longer in conflict
    dead = -1  # first flat item of the last row given up
    for f in nz.tolist():
        lo = f - f % m  # its row's first flat item
        if lo == dead or f in traded:
            continue
        e0, g0 = ev[f], gv[f]
        for j1 in near[f - lo]:
            f1 = lo + j1
            e1 = ev[f1]
            if e1 != e0 and not hv[gv[f1] + e0] and not hv[e1 + g0]:
                break
        else:
            dead = lo  # the rest of the row is left to the repair pass
            continue
        gv[f] = gv[f1]
        gv[f1] = g0
        traded.add(f1)


def repair_duplicates(w: np.ndarray, p2l: np.ndarray, m: int, cap_iters: int = 10_000) -> np.ndarray:
    """Remove every second replica of an expert on one GPU by swapping it with a slot of
    another GPU (that GPU must not hold the expert, and this GPU must not hold the other
    slot's expert), choosing the swap that keeps the two GPUs' max load lowest.
    One duplicate per row per iteration. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    if s < 2 or R == 0:
        return p2l
    dup_rows = np.nonzero(has_duplicates(p2l, m))[0]
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
        c = counts_of(sub, n)
        x = slot_loads(w[dup_rows], sub, c)
        load = gpu_sums(x, m)
        g3 = sub.reshape(D, m, s)
        isdup = ((g3[..., :, None] == g3[..., None, :]) & lower).any(-1).reshape(D, p)  # later copies
        q = isdup.argmax(1)  # [D] first duplicate slot
        a = sub[np.arange(D), q]
        gq = gpu[q]
        on = presence(sub, m, n)
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
        still = has_duplicates(sub, m) & fixable
        dup_rows = dup_rows[still]
    raise RuntimeError("duplicate repair did not converge")  # pragma: no cover


def refill_hot(w: np.ndarray, p2l: np.ndarray, m: int, max_hot: int = 8, with_max: bool = False):
    """When one or several GPUs hold an item at least as heavy as the mean GPU load (an
    expert that cannot be split enough), the best they can do is hold the lightest items
    of the row: give the k(s-1) lightest items to k of those h GPUs (k: at most `max_hot`
    and 32 / (s - 1), the ones with the heaviest dominating items), heaviest item first to the
    one with the lowest load (LPT over the fillers), and put their previous fillers where
    the light items were. Kept per row only if the max GPU load drops and no GPU gets two
    replicas of one expert. p2l [R, p] -> [R, p]; with `with_max` also the result's max
    GPU load [R] (that of `rows.max_load`, which this step computes anyway)."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    if s < 2 or m < 2 or R == 0:
        return (p2l, max_load(w, p2l, m)) if with_max else p2l
    c = counts_of(p2l, n)
    x = slot_loads(w, p2l, c)  # [R, p]
    load = gpu_sums(x, m)  # [R, m]
    mean = load.mean(1, keepdims=True)
    if not (x.max(1, keepdims=True) >= mean).any():  # no hot GPU (see below) in any row
        return (p2l, load.max(1)) if with_max else p2l
    x3 = x.reshape(R, m, s)
    dom = x3.argmax(-1)  # [R, m] slot (in GPU) of the heaviest item
    big = np.take_along_axis(x3, dom[..., None], -1)[..., 0]  # [R, m]
    hot = big >= mean
    h = hot.sum(1)
    rows = np.nonzero(h >= 1)[0]
    if rows.size == 0:
        return (p2l, load.max(1)) if with_max else p2l
    k = int(min(max_hot, h[rows].max(), max(2, 32 // (s - 1))))
    Rr = rows.size
    rr = np.arange(Rr)
    # the k GPUs with the heaviest dominating items (padding GPUs are not hot)
    hg = argsort_rows(big[rows], descending=True)[:, :k]  # [Rr, k]
    is_hot = np.take_along_axis(hot[rows], hg, 1)  # [Rr, k]
    nf = (is_hot.sum(1)) * (s - 1)  # fillers per row
    dom_slot = hg * s + np.take_along_axis(dom[rows], hg, 1)  # [Rr, k]
    filler_slots = (hg[:, :, None] * s + np.arange(s)).reshape(Rr, -1)  # [Rr, k*s] incl. dominating
    xr = x[rows]
    masked = xr.copy()
    masked[rr[:, None], dom_slot] = np.inf  # dominating items are not fillers
    light = argsort_rows(masked)[:, :k * (s - 1)]  # [Rr, k(s-1)] lightest items, ascending
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
    top = load.max(1)  # [R] max GPU load of p2l; old = p2l[rows], so its max is top[rows]
    new_top = max_load(w[rows], new, m)  # [Rr]
    better = ok_rows & (new_top < top[rows]) & ~has_duplicates(new, m)
    out = p2l.copy()
    out[rows[better]] = new[better]
    top[rows[better]] = new_top[better]
    return (out, top) if with_max else out
