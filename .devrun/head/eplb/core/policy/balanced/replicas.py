"""Replica counts: how many slots every expert gets (step 1 of the `balanced` planner),
and the count search that fits them to a packing of two slots per GPU."""
from __future__ import annotations

from typing import Optional

import numpy as np

from eplb.core.policy.balanced.rows import REL_EPS, argsort_rows, sort_keys, take


def replica_counts(w: np.ndarray, p: int, cap: int) -> np.ndarray:
    """Replicas per expert [R, n] (sum p per row, each in [1, cap]): the next replica
    always goes to the expert with the highest load per replica (DeepSeek's rule).

    That greedy picks the p - n largest values of {w_e / k : 1 <= k < cap} (ties: the
    lower expert id, then the lower k). The k-th value of the i-th heaviest expert
    (i from 0) comes after at least (i + 1) k - 1 others (those of the i heavier experts
    and its own smaller k), so only the pairs with (i + 1) k <= p - n can be picked:
    about (p - n) ln(p - n) candidates per row, of which a partition keeps the p - n
    largest."""
    R, n = w.shape
    extra = p - n
    c = np.ones((R, n), dtype=np.int64)
    if extra <= 0 or R == 0:
        return c
    kmax = min(extra, cap - 1)  # most replicas one expert can add
    heavy = argsort_rows(w, descending=True)[:, :min(extra, n)]  # [R, K] experts, heaviest first
    i_of, k_of = _candidates(heavy.shape[1], extra, kmax)  # [C] rank and k of every candidate
    C = i_of.size
    ib = max(1, int(n * kmax).bit_length())
    hw = take(w, heavy)  # [R, K] their loads
    htie = heavy * kmax  # [R, K] the expert's part of the tie-break
    k_tie = k_of - 1  # [C] and the replica's
    # a chunk of rows at a time, so that the [r, C] temporaries stay small (C is in the
    # thousands at EP256: whole [R, C] arrays fall out of cache and can cost page faults)
    step = max(1, _CHUNK // C)
    for a in range(0, R, step):
        b = min(R, a + step)
        value = hw[a:b, i_of] / k_of  # [r, C] w_e / k
        tie = htie[a:b, i_of]  # [r, C] expert * kmax + (k - 1)
        tie += k_tie
        # unique integer keys: value descending, then expert id and k ascending
        key = sort_keys(value, tie, ib, descending=True)  # [r, C]
        if C > extra:
            key = np.partition(key, extra - 1, axis=1)[:, :extra]  # [r, extra] the picks, any order
        picked = (key & ((1 << ib) - 1)) // kmax  # [r, extra] expert of every pick
        picked += (np.arange(b - a) * n)[:, None]
        c[a:b] += np.bincount(picked.ravel(), minlength=(b - a) * n).reshape(b - a, n)
    return c


_CHUNK = 16384  # replica_counts: candidate values per chunk of rows
_CANDIDATES: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}


def _candidates(K: int, extra: int, kmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank i, k) of every (expert, replica) value `replica_counts` may pick: i < K,
    1 <= k <= kmax, (i + 1) k <= extra. Two int64 arrays [C] in a fixed scrambled order:
    i ascending then k would give keys in nearly sorted runs, on which np.partition is
    several times slower (the picks do not depend on the order)."""
    key = (K, extra, kmax)
    if key not in _CANDIDATES:
        i_of, k_of = [], []
        for i in range(K):
            ks = range(1, min(kmax, extra // (i + 1)) + 1)
            i_of += [i] * len(ks)
            k_of += list(ks)
        # a fixed scramble (no randomness): positions ordered by a multiplicative hash
        scramble = np.argsort((np.arange(len(i_of), dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(1 << 32),
                              kind="stable")
        _CANDIDATES[key] = (np.array(i_of, dtype=np.int64)[scramble], np.array(k_of, dtype=np.int64)[scramble])
    return _CANDIDATES[key]


def expand(c: np.ndarray, experts: Optional[np.ndarray] = None) -> np.ndarray:
    """Items [R, p]: expert experts[r, i] repeated c[r, i] times, row by row (every row of
    c sums to p). experts defaults to 0..n-1 (expert-major order)."""
    R, n = c.shape
    if experts is None:
        experts = np.broadcast_to(np.arange(n), (R, n))
    return np.repeat(experts.ravel(), c.ravel()).reshape(R, -1)


def pairing_max(vals: np.ndarray, m: int) -> np.ndarray:
    """Max GPU load of the best packing of 2m items onto m GPUs of two slots: the i-th
    heaviest item with the i-th lightest. Blind to duplicates (it may pair two replicas
    of one expert), so callers compare the real packings afterwards. [..., 2m] -> [...]."""
    v = np.sort(vals, axis=-1)
    return (v[..., :m] + v[..., ::-1][..., :m]).max(-1)


def count_search_pairs(w: np.ndarray, c: np.ndarray, m: int, cap: int, steps: int) -> np.ndarray:
    """Replica counts for two slots per GPU. With two items per GPU the best packing
    pairs the i-th heaviest item with the i-th lightest, so the max GPU load of a count
    vector is cheap to score exactly (ignoring duplicates, see `pairing_max`). Hill-climb: each step tries moving one replica from expert a to expert
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
        items = expand(cc)  # [A, p] expert-major
        vals = take(ww / cc, items)  # [A, p]
        order = argsort_rows(vals, descending=True)
        sv = take(vals, order)
        se = take(items, order)
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
        c_src, c_dst = take(cc, src), take(cc, dst)
        ok = (src != dst) & (c_src >= 2) & (c_dst < cap)
        new_src = take(ww, src) / np.maximum(c_src - 1, 1)  # [A, K]
        new_dst = take(ww, dst) / (c_dst + 1)
        is_src = items[:, None, :] == src[:, :, None]  # [A, K, p]
        is_dst = items[:, None, :] == dst[:, :, None]
        first_src = is_src & (np.cumsum(is_src, -1) == 1)  # this item becomes a dst replica
        nv = np.where(is_src, new_src[..., None], vals[:, None, :])
        nv = np.where(is_dst | first_src, new_dst[..., None], nv)  # [A, K, p]
        f = np.where(ok, pairing_max(nv, m), np.inf)  # [A, K]
        k = f.argmin(1)
        fb = f[ar, k]
        mean = ww.sum(1) / m
        better = fb < cur - REL_EPS * mean
        r = ra[better]
        kb = k[better]
        c[r, src[better, kb]] -= 1
        c[r, dst[better, kb]] += 1
        active[ra[~better]] = False
    return c


_COMPOSITIONS: dict[tuple[int, int, int], Optional[np.ndarray]] = {}


def compositions(total: int, parts: int, cap: int, limit: int) -> Optional[np.ndarray]:
    """Every vector of `parts` integers in [1, cap] that sums to `total`, in
    lexicographic order: [X, parts] int64; None when there are more than `limit`."""
    key = (total, parts, cap)
    if key not in _COMPOSITIONS:
        # ways[j][t]: vectors of j parts in [1, cap] summing to t
        ways = [[1] + [0] * total]
        for _ in range(parts):
            prev = ways[-1]
            ways.append([sum(prev[t - x] for x in range(1, min(cap, t) + 1)) for t in range(total + 1)])
        if ways[parts][total] > limit:
            _COMPOSITIONS[key] = None
        else:
            out = []

            def rec(prefix: list, left: int, j: int) -> None:
                if j == 0:
                    out.append(list(prefix))
                    return
                for x in range(1, min(cap, left) + 1):
                    if ways[j - 1][left - x]:
                        prefix.append(x)
                        rec(prefix, left - x, j - 1)
                        prefix.pop()

            rec([], total, parts)
            _COMPOSITIONS[key] = np.array(out, dtype=np.int64).reshape(-1, parts)
    return _COMPOSITIONS[key]


def exact_counts_pairs(w: np.ndarray, m: int, comps: np.ndarray, chunk_elems: int = 4_000_000) -> np.ndarray:
    """Replica counts [R, n] with the lowest best-pairing max (`pairing_max`) over every
    count vector of `comps` [X, n] (each summing to 2m): exhaustive, so it does not stop
    at a local optimum as `count_search_pairs` can. Ties go to the first vector of comps.
    Rows are processed in chunks of about `chunk_elems` item values."""
    R, n = w.shape
    X = comps.shape[0]
    p = 2 * m
    idx = np.repeat(np.tile(np.arange(n), X), comps.ravel()).reshape(X, p)  # [X, p] expert of every item
    cnt = np.take_along_axis(comps, idx, 1).astype(np.float64)  # [X, p] its replica count
    best = np.empty(R, dtype=np.int64)
    step = max(1, chunk_elems // (X * p))
    for a in range(0, R, step):
        v = w[a:a + step][:, idx] / cnt  # [r, X, p] item loads
        f = pairing_max(v, m)  # [r, X]
        best[a:a + step] = f.argmin(1)
    return comps[best]
