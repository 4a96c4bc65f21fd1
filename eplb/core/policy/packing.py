"""Packing replicas onto GPUs (step 2 of the `balanced` planner): rounds of heavy and
light items, duplicate repair, and the refill of GPUs dominated by one hot item."""
from __future__ import annotations

import numpy as np

from eplb.core.policy.replicas import expand
from eplb.core.policy.rows import argsort_rows, counts_of, gpu_sums, has_duplicates, max_load, presence, slot_loads, take


def pack(w: np.ndarray, c: np.ndarray, m: int) -> np.ndarray:
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
    order = argsort_rows(piece, descending=True)  # [R, n] experts heavy first
    items = expand(take(c, order), order)  # [R, p] expert of each item, heavy first
    sizes = take(piece, items)  # [R, p]
    load = np.zeros((R, m))  # [R, m] >= 0, never -0.0: its bits order like its values
    rows = np.arange(R)
    row_m = (rows * m)[:, None]
    row_p = (rows * p)[:, None]
    j = np.arange(m)[None, :]
    jm = j - m
    ib = max(1, int(m).bit_length())  # argsort_rows(load) inlined: keys = value bits, then GPU index
    low = (1 << ib) - 1
    held = np.zeros(R * m * n, dtype=bool)  # GPU holds expert, flat [(r * m + g) * n + e]
    gpu_of = np.empty((R, m, s), dtype=np.int64)  # [R, item j of round, round] GPU taking it
    item_of = np.empty((R, m, s), dtype=np.int64)  # ... and its expert; p2l is written once at the end
    items_flat, sizes_flat = items.ravel(), sizes.ravel()
    # round 0: the m heaviest items to GPUs 0..m-1 (all loads 0, nothing held yet)
    pick = row_p + j  # [R, m] flat item
    e = items_flat[pick]
    gflat = row_m + j
    held[gflat * n + e] = True
    gpu_of[..., 0] = j
    item_of[..., 0] = e
    load.ravel()[gflat] += sizes_flat[pick]
    front = row_p + m  # [R, 1] flat index of the next heavy item
    back = row_p + p  # [R, 1] one past the last light item left
    for rnd in range(1, s):
        # GPUs at or above the current mean load are closed
        mean = np.add.reduce(load, axis=1, keepdims=True)
        mean /= m  # = load.mean(1, keepdims=True), bit for bit, without its Python overhead
        closed = np.add.reduce(load >= mean, axis=1, dtype=np.int64, keepdims=True)
        nopen = m - closed
        key = load.view(np.int64) >> ib
        key <<= ib
        key |= j
        key.sort(axis=1)
        key &= low
        gpus = key  # [R, m] lightest first; closed GPUs come last
        pick = np.where(j < nopen, front + j, back + jm)  # [R, m] flat item
        e = items_flat[pick]  # [R, m]
        gflat = gpus + row_m
        hkey = gflat * n
        hkey += e
        bad = held[hkey]
        if bad.any():
            gpus = _untangle(gpus, e, bad, held, row_m, n)
            gflat = gpus + row_m
            hkey = gflat * n
            hkey += e
        held[hkey] = True
        gpu_of[..., rnd] = gpus
        item_of[..., rnd] = e
        load.ravel()[gflat] += sizes_flat[pick]
        front += nopen
        back -= closed
    p2l = np.empty(R * p, dtype=np.int64)
    gpu_of *= s
    gpu_of += np.arange(s)  # slot of the item: GPU * s + round
    gpu_of += row_p[..., None]
    p2l[gpu_of] = item_of
    return p2l.reshape(R, p)


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


def _untangle(gpus, e, bad, held, row_m, n):
    """Within one packing round (item j of row r goes to GPU gpus[r, j]), let every item
    whose expert that GPU already holds trade GPUs with the nearest item of the round
    for which both GPUs are free of the other's expert. [R, m] -> [R, m]."""
    gpus = gpus.copy()
    m = gpus.shape[1]
    j = np.arange(m)
    absd = np.abs(j[None, :] - j[:, None])  # [m, m] |j - j0|
    rb = np.nonzero(bad.any(1))[0]  # rows with a conflict; only these ever change
    bad = bad[rb]  # [B, m]
    g = gpus[rb]  # [B, m] kept up to date
    ee = e[rb]
    rmn = row_m[rb] * n  # [B, 1]
    live = np.arange(rb.size)  # rows of rb still with a conflict
    for _ in range(m):
        if live.size == 0:
            break
        gl, el, bl = g[live], ee[live], bad[live]
        gn = gl * n
        gn += rmn[live]  # [A, m] flat (GPU, expert 0) of every item's GPU
        j0 = bl.argmax(1)  # first bad item
        ar = np.arange(live.size)
        e0, g0n = el[ar, j0], gn[ar, j0]
        ok = ~held[gn + e0[:, None]]
        ok &= ~held[g0n[:, None] + el]
        ok &= el != e0[:, None]
        dist = np.where(ok, absd[j0], m + 1)
        j1 = dist.argmin(1)
        fixable = dist[ar, j1] <= m
        if not fixable.any():
            break
        rf, a0, a1 = live[fixable], j0[fixable], j1[fixable]
        t = g[rf, a0].copy()
        g[rf, a0] = g[rf, a1]
        g[rf, a1] = t
        # rows that could not be fixed are left to the repair pass
        live = rf
        gn = g[live] * n
        gn += rmn[live]
        gn += ee[live]
        still = held[gn]
        bad[live] = still
        live = live[still.any(1)]
    gpus[rb] = g
    return gpus


def repair_duplicates(w: np.ndarray, p2l: np.ndarray, m: int, cap_iters: int = 10_000) -> np.ndarray:
    """Remove every second replica of an expert on one GPU by swapping it with a slot of
    another GPU (that GPU must not hold the expert, and this GPU must not hold the other
    slot's expert), choosing the swap that keeps the two GPUs' max load lowest.
    One duplicate per row per iteration. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
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


def refill_hot(w: np.ndarray, p2l: np.ndarray, m: int, max_hot: int = 8) -> np.ndarray:
    """When one or several GPUs hold an item at least as heavy as the mean GPU load (an
    expert that cannot be split enough), the best they can do is hold the lightest items
    of the row: give the h(s-1) lightest items to those h GPUs, heaviest item first to the
    one with the lowest load (LPT over the fillers), and put their previous fillers where
    the light items were. Kept per row only if the max GPU load drops and no GPU gets two
    replicas of one expert. p2l [R, p] -> [R, p]."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    if s < 2 or m < 2 or R == 0:
        return p2l
    c = counts_of(p2l, n)
    x = slot_loads(w, p2l, c)  # [R, p]
    load = gpu_sums(x, m)
    mean = load.mean(1, keepdims=True)
    x3 = x.reshape(R, m, s)
    dom = x3.argmax(-1)  # [R, m] slot (in GPU) of the heaviest item
    big = np.take_along_axis(x3, dom[..., None], -1)[..., 0]  # [R, m]
    hot = big >= mean
    h = hot.sum(1)
    rows = np.nonzero(h >= 1)[0]
    if rows.size == 0:
        return p2l
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
    better = ok_rows & (max_load(w[rows], new, m) < max_load(w[rows], old, m)) & ~has_duplicates(new, m)
    out = p2l.copy()
    out[rows[better]] = new[better]
    return out
