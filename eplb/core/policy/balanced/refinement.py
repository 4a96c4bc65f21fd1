"""Moves aimed at the most loaded GPU (step 4 of the `balanced` planner): swaps and
replica count changes, one per row and iteration, scored exactly (swaps) or by an upper
bound (count changes). No two replicas of one expert ever end up on one GPU. The pair
exchanges of step 3 are in `pairs`."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.core.policy.balanced.rows import REL_EPS, argsort_rows, counts_of, gpu_sums, lexmin, presence, take


_MAX_CANDIDATES = 5_000  # candidate moves per kind and max-GPU iteration, all rows together


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
    that get lighter are counted at their old load), so an accepted move never raises the
    row's max: it lowers it, or keeps it and lowers the sum of squares (plateau swaps).
    Rows stop when no move improves or, with `target` [R], once their max GPU load is at
    most the target. Returns (p2l [R, p], moves [R] made per row).

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
