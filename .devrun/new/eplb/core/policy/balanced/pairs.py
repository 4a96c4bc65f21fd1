"""Pair exchanges between GPUs (step 3 of the `balanced` planner, and the decode-aware
pass): every iteration pairs the GPUs of every row and applies, in every pair at once, the
exchange of a few items that lowers the pair's max load the most. Replica counts do not
change; no two replicas of one expert ever end up on one GPU. The exchange tables, the
swap scoring in a slot-major layout and the duplicate checks are this module's."""
from __future__ import annotations

import itertools
from math import comb

import numpy as np

from eplb.core.policy.balanced.rows import REL_EPS, argsort_rows, counts_of, gpu_sums, has_duplicates, presence, slot_loads, take


_EXCHANGES: dict[int, tuple] = {}
_SCORE_CHUNK = 1 << 17  # _best_swaps: scores per chunk of pairs
_MAP_SLOTS = 12  # improve_pairs: slots per GPU above which duplicate checks use a presence map


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


def improve_pairs(w: np.ndarray, p2l: np.ndarray, m: int, iters: int) -> np.ndarray:
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
    c = counts_of(p2l, n)
    x = slot_loads(w, p2l, c)  # [R, p]
    load = gpu_sums(x, m)  # [R, m]
    eps = REL_EPS * w.sum(1) / m  # [R]
    ar = np.arange(s)
    iters = min(40 * K + 8, iters)
    scored = single and s >= 4  # many items: swaps scored by _best_swaps, pairs laid out [s, B]
    # duplicate checks (is item u's expert on the other GPU?): comparing the two GPUs'
    # items costs s * s per pair and iteration, a presence map 2 s lookups (and R * m * n
    # to build, then updates), so the map pays from about a dozen slots per GPU. Both give
    # the same answer as long as no GPU holds two replicas of one expert (then swapping
    # one of them out clears the map's entry): always in the first iteration, which reads
    # the map before any update
    use_map = scored and (s > _MAP_SLOTS or (iters > 1 and has_duplicates(p2l, m).any()))
    row_m = (np.arange(R) * m)[:, None]
    if use_map:
        held = presence(p2l, m, n).ravel()  # [R * m * n]
    quiet = 0
    for it in range(iters):
        order = argsort_rows(load)  # [R, m] lightest first
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
        if scored:
            # B = R * Kp pairs, last: [s, B] arrays give numpy long inner loops
            hg, lg = (heavy + row_m).ravel(), (light + row_m).ravel()  # [B] flat GPU
            ih, il = hg * s + ar[:, None], lg * s + ar[:, None]  # [s, B] flat slots
            Gh, Gl = load.ravel()[hg], load.ravel()[lg]  # [B]
            Eh, El = p2l.ravel()[ih], p2l.ravel()[il]  # [s, B]
            if use_map:
                a_on_l = held[lg * n + Eh]  # [s, B]
                b_on_h = held[hg * n + El]
            else:
                same = Eh[:, None, :] == El[None, :, :]  # [s, s, B] expert on both GPUs
                a_on_l = np.logical_or.reduce(same, 1)  # [s, B]
                b_on_h = np.logical_or.reduce(same, 0)
            best, best_val = _best_swaps(x.ravel()[ih], x.ravel()[il], Gh, Gl, a_on_l, b_on_h)
            best, best_val = best.reshape(R, Kp), best_val.reshape(R, Kp)
            Gh, Gl = Gh.reshape(R, Kp), Gl.reshape(R, Kp)
        else:
            slots = np.concatenate([heavy[:, :, None] * s + ar, light[:, :, None] * s + ar], 2)  # [R, Kp, 2s]
            E = take(p2l, slots)  # [R, Kp, 2s]
            V = take(x, slots)
            Gh, Gl = take(load, heavy), take(load, light)  # [R, Kp]
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
        if it + 1 < iters:  # the loads are read by the next iteration only
            load = gpu_sums(x, m)
    return p2l


def _best_swaps(Vh, Vl, Gh, Gl, a_on_l, b_on_h):
    """Best one-for-one swap of every GPU pair. Moving load d from the heavy GPU to the
    light one gives a pair max of (Gh + Gl) / 2 + |d - gap / 2|, and helps iff
    0 < d < gap, so the score is |2 d - gap|. Vh, Vl [s, B] item loads of the heavy and
    the light GPU of B pairs, Gh, Gl [B], a_on_l / b_on_h [s, B] (the item's expert is
    already on the other GPU). Returns the swap index u * s + v (the first of the lowest
    score) [B] and the pair's new max [B].

    Scores are laid out [s * s, B] (long inner loops for numpy), a chunk of pairs at a
    time (temporaries of at most _SCORE_CHUNK values). A masked item is given load +inf
    (heavy side) or -inf (light side), so that every score of its row u or column v is
    +inf and the others are computed as they are: loads are finite. The best swap is
    found as a min-reduce plus its first match (ranks s * s .. 1 at the minimum, a
    max-reduce over 1-byte values), where an argmin over axis 0 would copy the scores to
    a pair-major layout. Scores are >= 0 (+0.0 after abs, never NaN), so the minimum is
    argmin's value, and ties go to the first index as with argmin."""
    s, B = Vh.shape
    gap = Gh - Gl  # [B]
    vh = np.where(a_on_l, np.inf, Vh)  # [s, B]
    vl = np.where(b_on_h, -np.inf, Vl)
    S = s * s
    rank = np.arange(S, 0, -1, dtype=np.uint8 if S < 256 else np.int64)[:, None]  # [s * s, 1] higher first
    j = np.empty(B, dtype=np.int64)
    best = np.empty(B)
    step = max(1, _SCORE_CHUNK // S)
    for a in range(0, B, step):
        b = min(B, a + step)
        score = vh[:, None, a:b] - vl[None, :, a:b]  # [s, s, b] load moved by swap (u, v)
        score *= 2.0
        score -= gap[a:b]
        np.abs(score, out=score)
        score = score.reshape(S, b - a)
        low = score.min(0)  # [b]
        j[a:b] = S - ((score == low) * rank).max(0)  # first (u, v) at the minimum
        best[a:b] = low
    new_max = 0.5 * (Gh + Gl + best)  # = max(Gh - d, Gl + d)
    new_max[~(best < gap)] = np.inf
    return j, new_max
