"""Local search on a packed placement (steps 3-4 of the `balanced` planner): pair
exchanges between GPUs, and moves aimed at the most loaded GPU (swaps, replica count
changes). No two replicas of one expert ever end up on one GPU.

About 450 lines: the two searches share the exchange tables, the swap scoring and the
duplicate checks, and the pair exchanges keep a second, slot-major layout for speed."""
from __future__ import annotations

import itertools
from math import comb
from typing import Optional

import numpy as np

from eplb.core.policy.balanced.rows import REL_EPS, argsort_rows, counts_of, gpu_sums, has_duplicates, lexmin, presence, slot_loads, take


_MAX_CANDIDATES = 5_000  # candidate moves per kind and max-GPU iteration, all rows together


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


def improve_max(
    w: np.ndarray,
    p2l: np.ndarray,
    m: int,
    cap: int,
    budget: int,  # iterations at most (see eplb.core.policy.balanced.budgets)
    target: Optional[np.ndarray] = None,  # [R] stop a row once its max GPU load is at most this
    fix: bool = False,  # with target: moves that bring g* within the target come first
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
    GPU load is at most the target. Returns (p2l [R, p], moves [R] made per row).

    With `target` and `fix` (moves from a previous placement, where every changed slot is
    a copy), the moves that put no other GPU above the target come first: one that brings
    g* within the target (a count change, one copy, before a swap, two), else the count
    change that lowers g* most. Each overloaded GPU then costs one move, and no move makes
    a GPU within the target overloaded (which would cost another move later). Only
    without such a move does the row take the move with the lowest new max."""
    R, p = p2l.shape
    n = w.shape[1]
    s = p // m
    p2l = p2l.copy()
    moves = np.zeros(R, dtype=np.int64)
    if R == 0 or m < 2:
        return p2l, moves
    gpu = np.arange(p) // s
    eps = REL_EPS * w.sum(1) / m  # [R]
    c = counts_of(p2l, n)  # [R, n] kept up to date
    on = presence(p2l, m, n)  # [R, m, n] kept up to date
    on_g = on.reshape(R * m, n)  # views of `on`: GPU r * m + g's experts,
    on_f = on.reshape(-1)  # and flat index (r * m + g) * n + e (gathers without index broadcasting)
    active = np.ones(R, dtype=bool)
    # candidate sets: everything on small problems, the lightest GPUs and the heaviest
    # replicas of g* on large ones (about _MAX_CANDIDATES candidates of each kind in all)
    swap_all = R * s * p <= 4 * _MAX_CANDIDATES
    n_light = max(2, min(m - 1, 4 * _MAX_CANDIDATES // (R * s * s)))
    n_hot = max(1, min(s, _MAX_CANDIDATES // (R * s * n_light)))  # experts of g* given a replica
    iters = budget
    knew = min(3, n)
    slot = np.arange(s)
    for _ in range(iters):
        ra = np.flatnonzero(active)
        if ra.size == 0:
            break
        P_, W_, C_ = p2l[ra], w[ra], c[ra]  # [A, p], [A, n], [A, n]
        wc = W_ / C_  # [A, n] replica load
        x = take(wc, P_)  # [A, p]
        load = gpu_sums(x, m)  # [A, m]
        g1 = load.argmax(1)
        A_ = ra.size
        ar = np.arange(A_)
        top = load[ar, g1]
        if target is not None:
            reached = top <= target[ra]
            if reached.any():
                active[ra[reached]] = False
                keep = ~reached
                ra, P_, W_, C_, wc, x, load, g1, top = (
                    ra[keep], P_[keep], W_[keep], C_[keep], wc[keep], x[keep], load[keep], g1[keep], top[keep])
                A_ = ra.size
                ar = np.arange(A_)
                if A_ == 0:
                    break
        # row-wise gathers as flat ones: a[r, i] = a.ravel()[i + r * width], offsets once
        op, on_, om = (ar * p)[:, None], (ar * n)[:, None], (ar * m)[:, None]  # [A, 1]
        rm = (ra * m)[:, None]  # [A, 1] row offset in on_g
        Pf, Cf, xf, lf = P_.ravel(), C_.ravel(), x.ravel(), load.ravel()
        rest = load.copy()
        rest[ar, g1] = -np.inf
        g2 = rest.argmax(1)
        v2 = rest[ar, g2]  # max without g*
        rest[ar, g2] = -np.inf
        v3 = rest.max(1)  # max without g* and g2
        g_slots = g1[:, None] * s + slot  # [A, s]
        g_exp = Pf[g_slots + op]  # [A, s]
        g_x = xf[g_slots + op]
        on_top = on_g[ra * m + g1]  # [A, n] experts on g*
        ot_f = on_top.ravel()
        by_load = argsort_rows(load)  # [A, m] lightest first

        # ---- swaps
        if swap_all:
            other = np.broadcast_to(np.arange(p), (A_, p))
        else:  # the lightest GPUs and the heaviest ones after g*
            half = max(1, n_light // 2)
            partners = np.concatenate([by_load[:, :n_light - half], by_load[:, m - 1 - half:m - 1]], 1)
            other = (partners[:, :, None] * s + slot).reshape(A_, -1)
        O = other.shape[1]
        o_gpu = gpu[other]  # [A, O]
        o_exp = Pf[other + op]
        delta = g_x[:, :, None] - xf[other + op][:, None, :]  # [A, s, O] load leaving g*
        o_load = lf[o_gpu + om]  # [A, O]
        new_g = top[:, None, None] - delta
        new_o = o_load[:, None, :] + delta
        untouched = np.where(o_gpu == g2[:, None], v3[:, None], v2[:, None])  # [A, O]
        score = np.maximum(new_g, new_o)
        np.maximum(score, untouched[:, None, :], out=score)
        ok = delta > 0
        ok &= ((o_gpu != g1[:, None]) & ~ot_f[o_exp + on_])[:, None, :]  # the other expert is not on g*
        ok &= ~on_f[((rm + o_gpu) * n)[:, None, :] + g_exp[:, :, None]]  # g*'s is not there
        np.copyto(score, np.inf, where=~ok)
        score = score.reshape(A_, -1)
        dsq = np.square(new_g)  # new sum of squares minus the old: [A, s, O] -> [A, s * O]
        dsq += np.square(new_o)
        dsq -= np.square(o_load)[:, None, :]
        dsq = dsq.reshape(A_, -1)
        dsq -= np.square(top)[:, None]
        sw = lexmin(score, dsq)

        # ---- count changes
        slot_load = np.repeat(load, s, 1)  # [A, p] load of the slot's GPU
        # g* excluded (np.where: with -inf written in place, np.maximum.at below ran ~20x slower here)
        masked = np.where(gpu[None, :] == g1[:, None], -np.inf, slot_load)
        emax = np.full(A_ * n, -np.inf)
        np.maximum.at(emax, (P_ + on_).ravel(), masked.ravel())  # [A * n] max load of the GPUs holding e, g* excluded
        nb_all = W_ / (C_ + 1)  # [A, n] replica load of b after one more replica
        inc_all = W_ / np.maximum(C_ - 1, 1) - wc  # growth of a's replicas after one fewer
        dec_all = wc - nb_all  # shrink of b's replicas
        nb_f, inc_f, dec_f = nb_all.ravel(), inc_all.ravel(), dec_all.ravel()
        # (i) slot on g* -> one of the experts with the smallest new replica load
        allowed = (C_ < cap) & ~on_top
        pool0 = np.where(allowed, nb_all, np.inf)
        pool = pool0.copy()
        cand = []
        for _ in range(knew):
            b = pool.argmin(1)
            cand.append(b)
            pool[ar, b] = np.inf
        b1 = np.repeat(np.stack(cand, 1), s, 1)  # [A, knew*s]
        q1 = np.tile(g_slots, (1, knew))
        a1n = np.tile(g_exp, (1, knew)) + on_  # expert of slot q1, flat
        b1n = b1 + on_
        ok1 = (Cf[a1n] >= 2) & np.isfinite(pool0.ravel()[b1n])
        top1 = top[:, None] - np.tile(g_x, (1, knew)) + nb_f[b1n]  # g*'s new load
        grow1 = emax[a1n] + inc_f[a1n]  # the GPUs holding a, their new max
        sc1 = np.maximum(np.maximum(top1, grow1), v2[:, None])
        sc1 = np.where(ok1, sc1, np.inf)
        # (ii) expert b on g* (its heaviest replicas) takes a slot q of one of the lightest GPUs
        if n_hot < s:
            hot = argsort_rows(g_x, descending=True)[:, :n_hot]
            hot_exp = np.take_along_axis(g_exp, hot, 1)  # [A, n_hot]
        else:
            hot_exp = g_exp
        light = by_load[:, :n_light]
        light = np.where(light == g1[:, None], light[:, :1], light) if n_light < m else light
        lslots = (light[:, :, None] * s + slot).reshape(A_, -1)  # [A, Lq]
        Lq = lslots.shape[1]
        q2 = np.tile(lslots, (1, n_hot))  # [A, n_hot*Lq]
        b2 = np.repeat(hot_exp, Lq, 1)
        a2 = Pf[q2 + op]
        gq = gpu[q2]
        a2n, b2n = a2 + on_, b2 + on_
        ok2 = (Cf[a2n] >= 2) & (Cf[b2n] < cap) & (a2 != b2) & (gq != g1[:, None])
        ok2 &= ~on_f[(rm + gq) * n + b2]
        inc2 = inc_f[a2n]
        a_on_g = ot_f[a2n]
        new_top = top[:, None] - dec_f[b2n] + np.where(a_on_g, inc2, 0.0)
        new_q = lf[gq + om] - xf[q2 + op] + nb_f[b2n]
        grow2 = emax[a2n] + inc2
        untouched2 = np.where(gq == g2[:, None], v3[:, None], v2[:, None])
        sc2 = np.maximum(np.maximum(new_top, new_q), np.maximum(grow2, untouched2))
        sc2 = np.where(ok2, sc2, np.inf)
        sc = np.concatenate([sc1, sc2], 1)
        qc = np.concatenate([q1, q2], 1)
        bc = np.concatenate([b1, b2], 1)
        cm = sc.argmin(1)
        fixing = None
        if fix and target is not None:
            lim = target[ra][:, None]  # [A, 1]
            # clean: every GPU that gets heavier, g* aside, ends within the target
            sw_ok = np.isfinite(score) & (new_o <= lim[..., None]).reshape(A_, -1)
            sw_ok &= np.broadcast_to(new_g <= lim[..., None], new_o.shape).reshape(A_, -1)  # g* within target
            cm_top = np.concatenate([top1, new_top], 1)  # g*'s new load
            cm_clean = np.isfinite(sc) & (np.concatenate([grow1, np.maximum(grow2, new_q)], 1) <= lim)
            cm_fix = cm_clean & (cm_top <= lim)
            cf = np.where(cm_fix, sc, np.inf).argmin(1)
            sf = lexmin(np.where(sw_ok, score, np.inf), dsq)
            # no single move brings g* within the target: the clean count change lowering g* most
            cl = np.where(cm_clean, cm_top, np.inf).argmin(1)
            f_cm = cm_fix[ar, cf]
            f_sw = ~f_cm & sw_ok[ar, sf]
            f_cl = ~f_cm & ~f_sw & (cm_clean & (cm_top < (top - eps[ra])[:, None]))[ar, cl]
            fixing = f_cm | f_sw | f_cl
            cm = np.where(f_cm, cf, np.where(f_cl, cl, cm))
            sw = np.where(f_sw, sf, sw)
        sw_score, sw_dsq = score[ar, sw], dsq[ar, sw]
        sw_u = g_slots[ar, sw // O]
        sw_v = other[ar, sw % O]
        cm_score = sc[ar, cm]

        use_count = cm_score < sw_score
        improve = np.where(use_count, cm_score < top - eps[ra],
                           (sw_score < top - eps[ra]) | ((sw_score <= top) & (sw_dsq < -eps[ra] * top)))
        improve &= np.isfinite(np.where(use_count, cm_score, sw_score))
        if fixing is not None:
            use_count = np.where(fixing, f_cm | f_cl, use_count)
            improve |= fixing
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
