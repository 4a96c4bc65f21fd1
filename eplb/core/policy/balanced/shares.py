"""Weighted replicas: per-slot shares of an expert's tokens that even out GPU loads
(water-filling), placement tweaks that give the shares room to work, and a placement
built for shares (the wrap-around chain)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.core.policy.balanced.rows import argsort_rows, counts_of, gpu_sums, presence, slot_loads, take


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
    c = counts_of(p2l, n)  # [R, n]
    x = slot_loads(w, p2l, c)  # [R, p] tokens per slot
    cmax = int(c.max())
    share_even = 1.0 / take(c, p2l)
    if cmax < 2 or R == 0:
        return share_even
    # slots of every expert [R, n, cmax], -1 padded (ascending slot order)
    order = argsort_rows(p2l.astype(np.float64))  # [R, p]
    e_sorted = take(p2l, order)
    start = np.cumsum(c, 1) - c  # [R, n]
    rank = np.arange(p)[None, :] - take(start, e_sorted)
    slots = np.full((R, n, cmax), -1, dtype=np.int64)
    slots[rows[:, None], e_sorted, rank] = order
    valid = slots >= 0  # [R, n, cmax]
    multi = c >= 2  # [R, n]
    safe = np.where(valid, slots, 0)
    gpu_of = safe // s  # [R, n, cmax]
    we = w[..., None]
    best_x = x.copy()
    load = gpu_sums(x, m)
    best_max = load.max(1)
    kk = np.arange(1, cmax + 1)
    flat_slots = (safe + (rows * p)[:, None, None]).ravel()  # padded entries add 0 to slot 0
    stall = 0
    for _ in range(iters):
        load = gpu_sums(x, m)
        mx = load.max(1)
        better = mx < best_max * (1 - 1e-10)
        stall = 0 if better.any() else stall + 1
        if stall > 25:  # no row improved for a while: converged
            break
        best_max = np.where(better, mx, best_max)
        best_x[better] = x[better]
        xs = take(x, safe.reshape(R, -1)).reshape(R, n, cmax)
        other = take(load, gpu_of.reshape(R, -1)).reshape(R, n, cmax) - xs  # load without e
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
    load = gpu_sums(x, m)
    mx = load.max(1)
    better = mx < best_max
    best_x[better] = x[better]
    we_slot = take(w, p2l)  # [R, p]
    shares = np.where(we_slot > 0, best_x / np.where(we_slot > 0, we_slot, 1.0), share_even)
    shares = np.maximum(shares, 0.0)
    # exact normalisation per expert
    tot = np.zeros(R * n)
    np.add.at(tot, (p2l + (rows * n)[:, None]).ravel(), shares.ravel())
    shares = shares / take(tot.reshape(R, n), p2l)
    return shares


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


def connect_for_shares(w: np.ndarray, p2l: np.ndarray, m: int, max_iters: int = 64) -> np.ndarray:
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
        c = counts_of(P_, n)
        x = slot_loads(w[ra], P_, c)
        load = gpu_sums(x, m)  # [A, m]
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
        multi = take(c, P_) >= 2  # [A, p]
        on = presence(P_, m, n)
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


def break_tight_sets(w: np.ndarray, p2l: np.ndarray, m: int, rounds: int = 24) -> tuple[np.ndarray, np.ndarray]:
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
        x = take(w, p2l) * shares  # [R, p] tokens per slot
        load = gpu_sums(x, m)
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
        closed = take(outside, p2l) == 0  # [R, p] slot of an expert with no replica outside S
        c = counts_of(p2l, n)
        wt = (load * tight).sum(1)  # [R] load of S
        on = presence(p2l, m, n)
        u_ok = in_t & closed  # candidate slots inside S
        v_ok = ~in_t  # candidate slots outside S
        a, b = p2l[:, :, None], p2l[:, None, :]  # [R, p, 1], [R, 1, p]
        ok = u_ok[:, :, None] & v_ok[:, None, :]
        ok &= ~on[rows[:, None, None], gpu[None, None, :], a]  # a not on v's GPU
        ok &= ~on[rows[:, None, None], gpu[None, :, None], b]  # b not on u's GPU
        wa = take(w, p2l)  # [R, p]
        b_closed_after = (take(c, p2l) == 1)[:, None, :] | (take(outside, p2l) == 1)[:, None, :]
        w_s_after = wt[:, None, None] - wa[:, :, None] + np.where(b_closed_after, wa[:, None, :], 0.0)
        recv = load[rows[:, None], gpu[None, :]][:, None, :] - x[:, None, :] + np.where(
            (take(c, p2l) == 1)[:, :, None], wa[:, :, None], x[:, :, None])
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
        t_max = gpu_sums(take(w[r], trial[r]) * t_shares, m).max(1)
        keep = t_max < top[r] * (1 - 1e-9)
        if not keep.any():
            break
        p2l[r[keep]] = trial[r[keep]]
        shares[r[keep]] = t_shares[keep]
    return p2l, shares


def plan_shares(w: np.ndarray, p2l: np.ndarray, m: int, nodes: int, hierarchical: bool,
                prev: Optional[np.ndarray] = None, tol: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Shares for the placement p2l [L, P] of loads w [L, N] on m GPUs. Two candidates
    per layer: (a) p2l itself with water-filled shares, or a variant that links isolated
    GPUs (inside every node when `hierarchical`, so that replicas stay on their node) and,
    in the global case, breaks tight GPU sets; (b) the wrap-around chain (`chain_shares`, per node when
    hierarchical, on p2l's assignment of groups to nodes), which reaches the mean GPU
    load exactly whenever its greedy order succeeds; it needs s >= 2 slots per GPU and
    (m / nodes)(s - 1) >= the experts of a node. The lower max GPU load wins; with a
    previous placement prev [L, P] the chain is relabelled to keep experts where they
    were (`moves.align`) and (a), which started from prev, is kept while within
    (1 + tol) of it. Returns (p2l [L, P], shares [L, P])."""
    L, P = p2l.shape
    N = w.shape[1]
    if P == N:
        return p2l, replica_shares(w, p2l, m)  # one replica per expert: nothing to share
    a_p2l, a_shares = _improved_shares(w, p2l, m, nodes, hierarchical)
    k = nodes if hierarchical else 1
    s = P // m
    if s < 2 or (m // k) * (s - 1) < N // k:
        return a_p2l, a_shares
    b_p2l, b_shares = _chain_on_nodes(w, p2l, m, k, s, prev)
    a = gpu_sums(take(w, a_p2l) * a_shares, m).max(1)  # [L]
    b = gpu_sums(take(w, b_p2l) * b_shares, m).max(1)
    # the chain's greedy order can fail when one expert outweighs several GPUs' targets: it
    # then leaves experts without a slot, and such a row is never used
    complete = (np.sort(b_p2l, 1)[:, None, :] == np.arange(N)[None, :, None]).any(-1).all(-1)  # [L]
    use = complete & (b * (1 + (tol if prev is not None else 0.0)) < a * (1 - 1e-12))
    return np.where(use[:, None], b_p2l, a_p2l), np.where(use[:, None], b_shares, a_shares)


def _improved_shares(w, p2l, m, nodes, hierarchical):
    """Candidate (a) of `plan_shares`: water-filling on p2l and on a variant that links
    isolated GPUs, then (global case) swaps that break tight GPU sets."""
    L, P = p2l.shape
    shares = replica_shares(w, p2l, m)
    if hierarchical:
        sub = p2l.reshape(L * nodes, P // nodes)
        linked = connect_for_shares(np.repeat(w, nodes, axis=0), sub, m // nodes).reshape(L, P)
    else:
        linked = connect_for_shares(w, p2l, m)
    linked_shares = replica_shares(w, linked, m)
    a = gpu_sums(take(w, p2l) * shares, m).max(1)  # [L]
    b = gpu_sums(take(w, linked) * linked_shares, m).max(1)
    use = b < a
    p2l = np.where(use[:, None], linked, p2l)
    if hierarchical:  # (swaps across nodes would break locality)
        return p2l, np.where(use[:, None], linked_shares, shares)
    return break_tight_sets(w, p2l, m)


def _chain_on_nodes(w, p2l, m, k, s, prev):
    """Candidate (b) of `plan_shares`: `chain_shares` for every (layer, node) row, the
    experts of a node being those p2l [L, P] places there (k = 1: the whole layer);
    relabelled inside every node towards prev [L, P] when given."""
    L, N = w.shape
    P = p2l.shape[1]
    nk = N // k
    # experts of every (layer, node), ascending: [L k, N/k]
    slot_node = np.arange(P) // (P // k)
    expert_node = np.zeros((L, N), dtype=np.int64)
    expert_node[np.arange(L)[:, None], p2l] = slot_node[None, :]
    order = argsort_rows(expert_node.astype(np.float64)).reshape(L * k, nk)  # [L k, N/k]
    sub_w = take(w, order.reshape(L, N)).reshape(L * k, nk)
    local, shares = chain_shares(sub_w, m // k, s)  # [L k, P/k] local ids
    glob = np.take_along_axis(order, local, 1)  # [L k, P/k]
    if prev is not None:
        from eplb.core.policy.balanced.moves import align

        glob, src = align(glob, prev.reshape(L * k, P // k), m // k, N, with_source=True)
        shares = np.take_along_axis(shares, src, 1)
    return glob.reshape(L, P), shares.reshape(L, P)


def chain_shares(w: np.ndarray, m: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Placement and shares built for weighted replicas: a wrap-around chain.

    With shares, balance is a flow problem: expert e sends w_e tokens to the GPUs that
    hold it, every GPU takes at most the target T = sum(w) / m, and a placement can reach
    T exactly iff no set of GPUs holds all the replicas of more than T per GPU (Hall).
    The chain meets it by construction, in the spirit of McNaughton's wrap-around rule
    for preemptive scheduling: the experts are first packed (`solve`, no shares) into m
    groups of q = s - 1 items, each group with load S_g; the groups are then laid out on
    the GPUs one after the other, and the slot left on every GPU holds the carry, the
    part of one expert that did not fit on the previous GPU. With D_g the carry out of
    GPU g (D_g = D_{g-1} + S_g - T), a GPU is filled to exactly T when 0 <= D_g and
    either D_g <= D_{g-1} (the carried expert absorbs the difference and carries on: a
    hot expert spans as many GPUs as it needs) or D_g <= the group's largest item (that
    item is split with the next GPU). The order is greedy, all rows at once, m steps:
    the next group is the one with the smallest carry D_g >= 0 among those that satisfy
    this and do not hold the carried expert (else the least violating one). Every GPU
    gets s slots (the first one, and any GPU entered without carry, one spare slot: a
    zero-share replica of the heaviest expert it lacks). Items: with more slots than
    N + m, the heaviest experts get several (`replica_counts`), one item per replica.

    w [R, n], s slots per GPU (s >= 2, m (s - 1) >= n) -> p2l [R, m s], shares [R, m s]."""
    from eplb.core.policy.balanced.solve import solve  # (solve imports nothing from this module)

    R, n = w.shape
    q = s - 1
    rows = np.arange(R)
    grp = solve(w, m * q, m).reshape(R, m, q)  # [R, m, q] expert of every item, grouped by GPU
    c = counts_of(grp.reshape(R, -1), n)  # [R, n]
    item = take(w / c, grp.reshape(R, -1)).reshape(R, m, q)  # [R, m, q] item loads
    S = item[..., 0].copy()  # [R, m] group loads, item by item
    for u in range(1, q):
        S += item[..., u]
    top = item.argmax(2)  # [R, m] the split item of every group
    wmax = np.take_along_axis(item, top[..., None], 2)[..., 0]  # [R, m]
    T = w.sum(1) / m  # [R]
    eps = 1e-12 * np.maximum(T, 1e-300)
    on = np.zeros((R, m, n), dtype=bool)  # group g holds expert e
    on[rows[:, None, None], np.arange(m)[None, :, None], grp] = True
    used = np.zeros((R, m), dtype=bool)
    D = np.zeros(R)  # carry into the next GPU
    x = np.full(R, -1, dtype=np.int64)  # carried expert, -1 none
    p2l = np.empty((R, m, s), dtype=np.int64)  # chain position k = GPU k
    load = np.zeros((R, m, s))  # tokens of every slot
    for k in range(m):
        nd = D[:, None] + S - T[:, None]  # [R, m] carry out with each group next
        clash = (x[:, None] >= 0) & on[rows[:, None], np.arange(m)[None, :], np.maximum(x, 0)[:, None]]
        cont = (nd <= D[:, None] + eps[:, None]) & (x[:, None] >= 0)  # carried expert absorbs
        split = nd <= wmax + eps[:, None]  # the group's largest item is split
        ok = (nd >= -eps[:, None]) & (cont | split) & ~clash & ~used
        if k == m - 1:
            ok = ~used  # the last group closes the chain (nd = 0 up to rounding)
        viol = np.where(ok, 0.0, np.maximum(-nd, 0) + np.maximum(nd - np.maximum(np.where(x[:, None] >= 0, D[:, None], 0), wmax), 0)
                        + np.where(clash, np.inf, 0.0))
        viol = np.where(used, np.inf, viol)
        key = np.where(ok, np.maximum(nd, 0), np.inf)
        # smallest carry among the valid groups, else the least violating one (lowest index on ties)
        g = np.where(ok.any(1), key.argmin(1), viol.argmin(1))  # [R]
        ndg = np.maximum(nd[rows, g], 0.0) if k < m - 1 else np.zeros(R)
        is_cont = cont[rows, g] & (ndg <= D + eps) & ~clash[rows, g]
        carry_in = D.copy()
        # slot 0: the carried expert (its piece here) or a spare replica with no tokens
        has_x = (x >= 0) & ~clash[rows, g]
        spare_w = np.where(on[rows, g], -1.0, w)  # the heaviest expert the group lacks
        spare = spare_w.argmax(1)
        p2l[:, k, 0] = np.where(has_x, x, spare)
        load[:, k, 0] = np.where(has_x, np.where(is_cont, carry_in - ndg, carry_in), 0.0)
        p2l[:, k, 1:] = grp[rows, g]
        load[:, k, 1:] = item[rows, g]
        # chain mode: the group's largest item keeps all but the carry out
        chain = ~is_cont & (ndg > 0)
        tg = top[rows, g]
        load[rows[chain], k, 1 + tg[chain]] -= ndg[chain]
        x = np.where(is_cont, x, np.where(ndg > 0, grp[rows, g, tg], -1))
        x = np.where(ndg > 0, x, -1)
        D = ndg
        used[rows, g] = True
    p2l = p2l.reshape(R, m * s)
    load = np.maximum(load.reshape(R, m * s), 0.0)  # (rounding)
    # per-slot tokens -> shares of each expert (exact normalisation)
    tot = np.zeros(R * n)
    flat = (p2l + (rows * n)[:, None]).ravel()
    np.add.at(tot, flat, load.ravel())
    tot = tot.reshape(R, n)
    cnt = counts_of(p2l, n)
    shares = np.where(take(tot, p2l) > 0, load / np.where(take(tot, p2l) > 0, take(tot, p2l), 1.0), 1.0 / take(cnt, p2l))
    return p2l, shares
