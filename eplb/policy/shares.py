"""Weighted replicas: per-slot shares of an expert's tokens that even out GPU loads
(water-filling), and placement tweaks that give the shares room to work."""
from __future__ import annotations

import numpy as np

from eplb.policy.rows import argsort_rows, counts_of, gpu_sums, presence, slot_loads, take


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


def plan_shares(w: np.ndarray, p2l: np.ndarray, m: int, nodes: int, hierarchical: bool) -> tuple[np.ndarray, np.ndarray]:
    """Shares for the placement p2l [L, P] of loads w [L, N] on m GPUs: water-filling on
    p2l, and on a variant that links isolated GPUs (inside every node when
    `hierarchical`, so that replicas stay on their node); per layer the better one is
    kept. Returns (p2l [L, P], shares [L, P])."""
    L, P = p2l.shape
    N = w.shape[1]
    shares = replica_shares(w, p2l, m)
    if P == N:
        return p2l, shares  # one replica per expert: nothing to share
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
