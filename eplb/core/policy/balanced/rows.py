"""Row-wise array helpers shared by the `balanced` planner's steps.

A row is one MoE layer (global placement) or one (layer, node) pair (hierarchical). All
helpers work on every row at once: w [R, n] loads, p2l [R, p] expert of every slot,
m GPUs per row, s = p / m slots per GPU. Orders and sums are fixed so that the same input
gives the same result on every machine.
"""
from __future__ import annotations

import numpy as np


REL_EPS = 1e-9  # improvements smaller than this fraction of the mean GPU load are ignored


def take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Row-wise gather: out[r, ...] = a[r, idx[r, ...]] for a [R, X], idx [R, ...]."""
    R, X = a.shape
    off = (np.arange(R, dtype=np.int64) * X).reshape((R,) + (1,) * (idx.ndim - 1))
    return a.ravel()[idx + off]


def sort_keys(v: np.ndarray, tie: np.ndarray, ib: int, descending: bool = False) -> np.ndarray:
    """Integer keys that order like the non-negative floats v, then like the integers
    tie (0 <= tie < 2**ib, broadcast against v): the value's bits without their ib lowest,
    shifted, with tie in the low bits. Unique keys sort the same on every machine; values
    closer than about 2**(ib - 52) relative count as ties."""
    bits = (np.maximum(v, 0.0) + 0.0).view(np.int64) >> ib  # monotone in v for v >= 0
    if descending:
        bits = ((1 << (63 - ib)) - 1) - bits
    bits <<= ib
    bits |= tie
    return bits


def argsort_rows(v: np.ndarray, descending: bool = False) -> np.ndarray:
    """Order of every row of the non-negative float array v [R, X], ties broken by the
    lower index: the same permutation on every machine. Each row sorts unique integer
    keys (`sort_keys`: value bits, then index), which is faster than an argsort and as
    deterministic (values closer than about 2**(bit_length(X) - 52) relative, ~1e-13 at
    X = 256, count as ties and keep index order)."""
    R, X = v.shape
    ib = max(1, int(X).bit_length())
    key = sort_keys(v, np.arange(X, dtype=np.int64), ib, descending)
    return np.sort(key, axis=1) & ((1 << ib) - 1)


def counts_of(p2l: np.ndarray, n: int) -> np.ndarray:
    """Replica count [R, n] of a placement p2l [R, p]."""
    R, p = p2l.shape
    flat = (p2l + (np.arange(R, dtype=np.int64) * n)[:, None]).ravel()
    return np.bincount(flat, minlength=R * n).reshape(R, n)


def slot_loads(w: np.ndarray, p2l: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Tokens per slot [R, p] with even split over replicas."""
    return take(w / np.maximum(c, 1), p2l)


def gpu_sums(x: np.ndarray, m: int) -> np.ndarray:
    """Sum of slot values x [R, p] per GPU -> [R, m], slot by slot in a fixed order (no
    BLAS: its summation order depends on the CPU, and plans must not)."""
    R, p = x.shape
    x3 = x.reshape(R, m, p // m)
    out = x3[..., 0].copy()
    for k in range(1, p // m):
        out += x3[..., k]
    return out


def presence(p2l: np.ndarray, m: int, n: int) -> np.ndarray:
    """on [R, m, n] bool: GPU g holds expert e."""
    R, p = p2l.shape
    on = np.zeros((R, m, n), dtype=bool)
    gpu = np.arange(p) // (p // m)
    on[np.arange(R)[:, None], gpu[None, :], p2l] = True
    return on


def has_duplicates(p2l: np.ndarray, m: int) -> np.ndarray:
    """[R] bool: some GPU of the row holds two replicas of one expert. Expert ids fit in
    int32 (n <= MAX_SLOTS): the sort runs on half the bytes, and one flat comparison
    covers every GPU."""
    R, p = p2l.shape
    s = p // m
    if s < 2 or R == 0:
        return np.zeros(R, dtype=bool)
    g = np.sort(p2l.astype(np.int32).reshape(R * m, s), axis=1).ravel()  # [R * p] equal experts side by side
    eq = np.zeros(R * p, dtype=bool)  # [R * p] item i equals item i - 1 of its GPU
    np.equal(g[1:], g[:-1], out=eq[1:])
    eq[::s] = False  # a GPU's first item vs the previous GPU's last
    return eq.reshape(R, p).any(1)


def max_load(w: np.ndarray, p2l: np.ndarray, m: int) -> np.ndarray:
    """Max GPU load per row [R] with even split."""
    c = counts_of(p2l, w.shape[1])
    return gpu_sums(slot_loads(w, p2l, c), m).max(1)


def lexmin(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """Per row, the index of the smallest `primary`, ties broken by the smallest
    `secondary`, then by the lowest index. primary, secondary [A, K] -> [A]."""
    best = primary.min(1, keepdims=True)
    sec = np.where(primary <= best, secondary, np.inf)
    return sec.argmin(1)
