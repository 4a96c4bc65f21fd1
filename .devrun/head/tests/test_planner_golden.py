"""The default planner's plans, bit for bit, on fixed inputs: a guard for speed work.

Speed changes to eplb/core/policy must not change a single plan. This test plans a fixed
set of problems (the DeepSeek-V3 speed shapes of benchmarks/planner.py with and without
`previous`, and small problems of every kind: global and hierarchical, spare slots or
none, hot experts, weighted) and compares a SHA-256 of every plan with the value the
planner gave when the digests were written (commit a592d56, before the speed work of
planner round 3). Loads come from integer arithmetic, not from a random generator, so
they are the same with every numpy version.

An intended change of the plans (a better planner) must rewrite the digests:
`python tests/test_planner_golden.py` prints the new table to paste below.
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np

from eplb import plan


def _load(L: int, N: int, seed: int, kind: int) -> np.ndarray:
    """A deterministic skewed load [L, N] from integer hashing (no RNG)."""
    i = np.arange(L, dtype=np.uint64)[:, None]
    j = np.arange(N, dtype=np.uint64)[None, :]
    h = (i * np.uint64(2654435761) + j * np.uint64(40503) + np.uint64(seed * 7919 + 17)) % np.uint64(1 << 31)
    h = (h * np.uint64(1103515245) + np.uint64(12345)) % np.uint64(1 << 31)
    u = (h.astype(np.float64) + 0.5) / float(1 << 31)  # (0, 1)
    if kind == 0:  # Zipf-like: a few hot experts
        return np.round(1e4 / (1.0 + 40 * u) ** 2)
    if kind == 1:  # heavy tail with ties (integers)
        return np.floor(1.0 / u).clip(max=5000)
    out = np.round(100 * u)  # flat with one expert hotter than a GPU's share
    out[:, seed % N] *= 3 * N // 4
    return out


def _drift(load: np.ndarray, seed: int) -> np.ndarray:
    """The next window: every expert's load x (0.5 .. 1.5), and a quarter of the load
    moved to a differently ordered copy of it (hot experts change), deterministic."""
    L, N = load.shape
    f = _load(L, N, seed + 1000, 1)
    shifted = np.roll(load, 1 + seed % 5, axis=1)
    return np.round(0.75 * load * (0.5 + (f % 97) / 96) + 0.25 * shifted)


_SMALL = [  # L, N, P, M, nodes, groups
    (8, 64, 72, 8, 1, 1), (8, 64, 80, 8, 2, 4), (4, 32, 48, 8, 1, 1), (6, 128, 144, 16, 1, 1),
    (6, 128, 160, 16, 4, 8), (12, 64, 64, 8, 1, 1), (5, 16, 32, 16, 1, 1), (3, 256, 288, 32, 4, 8),
    (20, 256, 288, 32, 1, 1), (10, 160, 192, 32, 1, 1), (7, 64, 96, 32, 1, 1), (30, 64, 128, 16, 2, 8),
]


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes() if a.dtype.kind in "iu"
                 else np.round(np.ascontiguousarray(a, dtype="<f8"), 9).tobytes())
    return h.hexdigest()[:16]


def plans() -> dict[str, str]:
    """Digest of every plan of the fixed set."""
    out = {}
    for name, L, N, P, M, nodes, groups in [("v3h", 58, 256, 288, 32, 4, 8), ("v3g", 58, 256, 288, 32, 1, 1)]:
        load = _load(L, N, 1, 0)
        prev = plan(load, M, P, nodes, groups)
        out[name] = _digest(prev.physical_to_logical)
        out[name + "_prev"] = _digest(plan(_drift(load, 1), M, P, nodes, groups, previous=prev).physical_to_logical)
    for i, (L, N, P, M, nodes, groups) in enumerate(_SMALL):
        load = _load(L, N, i, i % 3)
        prev = plan(load, M, P, nodes, groups)
        drift = _drift(load, i)
        out[f"s{i}"] = _digest(prev.physical_to_logical)
        out[f"s{i}_prev"] = _digest(plan(drift, M, P, nodes, groups, previous=prev).physical_to_logical)
        if i % 3 == 0:
            wp = plan(drift, M, P, nodes, groups, previous=prev, weighted=True)
            out[f"s{i}_weighted"] = _digest(wp.physical_to_logical, wp.shares)
    return out


EXPECTED = {
    'v3h': 'bfd6857b43031130',
    'v3h_prev': '9e8b95b6bab49073',
    'v3g': 'd92722f5120b7561',
    'v3g_prev': 'a94ce014392ba55c',
    's0': 'f9474af7d9249af8',
    's0_prev': '56ad64c36dee954c',
    's0_weighted': 'edd50e1bc23d7947',
    's1': '3d047a429fc2a915',
    's1_prev': 'bf6721aa571697a7',
    's2': '6bd6f8936ea54cdd',
    's2_prev': 'c6b16107b31a7f47',
    's3': '1bb4b44baa1f99b3',
    's3_prev': 'c354b4ba23f97867',
    's3_weighted': '6abb1cd665b98263',
    's4': 'f8feebc2b1887e5b',
    's4_prev': 'aed789ce68ed7827',
    's5': '5861f9758de174fa',
    's5_prev': 'b2446d2ba2f73ce6',
    's6': '41e981c6e54f164d',
    's6_prev': '2a7ee504980ca5f7',
    's6_weighted': '3f56e8ca56b8bc42',
    's7': '52cc6ee85faa76ba',
    's7_prev': '9b96f8c737475a13',
    's8': '54e0b0c05414446b',
    's8_prev': '73e482e3a05494a3',
    's9': 'e64c91a4ac054f6a',
    's9_prev': '1db8df276adef950',
    's9_weighted': 'c4710e7bab3a24c0',
    's10': '93181132d11dce87',
    's10_prev': 'a7784a8d964c6322',
    's11': '90632fb41cdd7e05',
    's11_prev': 'ae223fa87b36bc19',
}


def test_plans_are_bit_for_bit_those_of_the_reference_planner():
    got = plans()
    assert got.keys() == EXPECTED.keys()
    changed = [k for k in EXPECTED if got[k] != EXPECTED[k]]
    assert not changed, f"plans changed: {changed} (see this module's docstring)"


if __name__ == "__main__":
    sys.stdout.write("EXPECTED = {\n")
    for k, v in plans().items():
        sys.stdout.write(f"    {k!r}: {v!r},\n")
    sys.stdout.write("}\n")
