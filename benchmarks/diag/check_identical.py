"""Bit-for-bit check of two versions of the planner: same physical_to_logical and shares.

    python check_identical.py BEFORE_ROOT AFTER_ROOT [--cases 200] [--reads]

Each root holds an `eplb/` package. Cases: random loads (Zipf-like, uniform, with ties,
zero layers) over many shapes, with and without `previous` (the version's own plan of a
drifted load, or a random previous placement), tolerances 0 / default / 0.1, weighted or
not; then every real trace of ../shared/traces/npy at EP 8, 16 and 32, hierarchical and global,
with the previous window as `previous`. Prints the number of cases and of mismatches.
With --reads every plan is decode-aware (`reads`: read_tokens, tokens per GPU 1-128,
tile_rows 0 / 64 / 128, dispatch_tokens 1 / inf), and a previous placement may also be the
start-up one (`Placement.initial`): the decode-aware pass and its catch-up.
"""
import argparse
import importlib
import os
import pickle
import sys

import numpy as np


def load_version(root):
    for k in [k for k in sys.modules if k == "eplb" or k.startswith("eplb.")]:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        try:  # the layout since 0.2, else the flat one of older trees
            planning = importlib.import_module("eplb.core.planning")
        except ImportError:
            planning = importlib.import_module("eplb.planning")
        placement = importlib.import_module(planning.__name__.replace("planning", "placement"))
    finally:
        sys.path.remove(root)
    return planning.plan, placement.Placement


def random_load(rng, L, N):
    kind = rng.integers(4)
    if kind == 0:  # Zipf-like
        ranks = np.argsort(rng.random((L, N)), 1) + 1.0
        w = np.round(1e5 / ranks ** rng.uniform(0.5, 1.5) * rng.uniform(0.5, 1.5, (L, N)))
    elif kind == 1:
        w = rng.uniform(0, 1000, (L, N))
    elif kind == 2:  # many ties
        w = rng.integers(0, 4, (L, N)).astype(np.float64)
    else:  # heavy hitters and a zero layer
        w = rng.exponential(1.0, (L, N)) ** 3
        w[rng.integers(L)] = 0
    return w


SHAPES = [  # L, N, P, M, nodes, groups
    (58, 256, 288, 32, 4, 8), (58, 256, 288, 32, 1, 1), (4, 256, 512, 256, 1, 1),
    (26, 64, 80, 16, 1, 1), (26, 64, 80, 16, 2, 8), (26, 64, 72, 8, 2, 8), (16, 64, 64, 8, 1, 1),
    (16, 64, 128, 64, 8, 8), (8, 8, 16, 8, 1, 1), (6, 16, 24, 4, 2, 4), (12, 32, 48, 8, 4, 8),
    (5, 10, 12, 4, 1, 1), (3, 7, 7, 7, 1, 1), (20, 128, 160, 32, 4, 8), (10, 60, 64, 16, 4, 4),
    (10, 256, 288, 32, 4, 8), (30, 256, 288, 32, 4, 8), (7, 16, 32, 16, 2, 2),
]


def reads(rng, M):
    """Decode-aware options of one case (plan's keywords)."""
    return dict(read_tokens=float(rng.choice([30.0, 100.0, 300.0])),
                step_choices=float(M * rng.choice([1, 4, 16, 128]) * 8),
                tile_rows=float(rng.choice([0.0, 64.0, 128.0])),
                dispatch_tokens=float(rng.choice([1.0, np.inf])))


def cases(n_random, seed=0, with_reads=False):
    rng = np.random.default_rng(seed)
    for i in range(n_random):
        L, N, P, M, k, G = SHAPES[i % len(SHAPES)]
        w = random_load(rng, L, N)
        drift = w * rng.uniform(0.6, 1.4, w.shape)
        tol = [0.0, 0.03, 0.1][rng.integers(3)]
        weighted = bool(rng.integers(4) == 0) and not with_reads
        kinds = ["none", "plan", "plan", "random"] + (["initial"] if with_reads else [])
        prev_kind = kinds[rng.integers(len(kinds))]
        kw = reads(rng, M) if with_reads else {}
        rand_prev = None
        if prev_kind == "random":  # a valid previous placement that need not respect groups
            rand_prev = np.concatenate([np.tile(np.arange(N), (L, 1)), rng.integers(0, N, (L, P - N))], 1)
            rand_prev = np.take_along_axis(rand_prev, np.argsort(rng.random((L, P)), 1), 1)
        yield f"random {i} {SHAPES[i % len(SHAPES)]} prev={prev_kind} tol={tol} w={weighted} {kw}", \
            (w, drift, M, P, k, G, prev_kind, rand_prev, tol, weighted, kw)
    root = os.path.join(os.path.dirname(__file__), "../../../shared/traces/npy")
    for f in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not f.endswith(".npy"):
            continue
        t = np.load(os.path.join(root, f)).astype(np.float64)
        if t.ndim == 3:  # [T, L, N]: two windows of half the sequences
            h = t.shape[0] // 2
            a, b = t[:h].sum(0), t[h:].sum(0)
        else:
            a, b = t, t * np.random.default_rng(1).uniform(0.8, 1.2, t.shape)
        N = a.shape[1]
        for M, P, k, G, weighted in ((8, N + 8, 1, 1, False), (16, N + 16, 2, 8, False),
                                     (32, N, 4, 8, False), (32, N + 32, 4, 8, False),
                                     (32, N + 32, 1, 1, False), (32, N + 32, 4, 8, True)):
            if with_reads and weighted:
                continue
            kw = reads(rng, M) if with_reads else {}
            yield f"{f} M={M} P={P} nodes={k} G={G} w={weighted} {kw}", \
                (a, b, M, P, k, G, "plan", None, 0.03, weighted, kw)


def run(version, case):
    plan, Placement = version
    w, drift, M, P, k, G, prev_kind, rand_prev, tol, weighted, kw = case
    prev = None
    if prev_kind == "plan":
        prev = plan(w, M, P, k, G, **kw)
    elif prev_kind == "random":
        prev = Placement(rand_prev, w.shape[1], M, k)
    elif prev_kind == "initial":
        prev = Placement.initial(w.shape[0], w.shape[1], P, M, k)
    out = [plan(drift, M, P, k, G, previous=prev, move_tolerance=tol, weighted=weighted, **kw)]
    out.append(plan(drift, M, P, k, G, move_tolerance=tol, weighted=weighted, **kw))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--cache", help="pickle of BEFORE's plans: written if missing, else read")
    ap.add_argument("--reads", action="store_true", help="decode-aware plans (see the docstring)")
    args = ap.parse_args()
    results = {}
    for name, root in (("before", args.before), ("after", args.after)):
        if name == "before" and args.cache and os.path.exists(args.cache):
            with open(args.cache, "rb") as f:
                results[name] = pickle.load(f)
            continue
        version = load_version(root)
        results[name] = [(label, [(x.physical_to_logical, x.shares) for x in run(version, c)])
                         for label, c in cases(args.cases, with_reads=args.reads)]
        if name == "before" and args.cache:
            with open(args.cache, "wb") as f:
                pickle.dump(results[name], f)
    bad = 0
    for (label, a), (_, b) in zip(results["before"], results["after"]):
        for x, y in zip(a, b):
            same = np.array_equal(x[0], y[0]) and x[0].dtype == y[0].dtype
            same &= (x[1] is None) == (y[1] is None)
            if same and x[1] is not None:
                same &= x[1].tobytes() == y[1].tobytes()
            if not same:
                bad += 1
                print("MISMATCH", label)
    print(f"{len(results['before'])} cases ({2 * len(results['before'])} plans, with and without previous): "
          f"{bad} mismatches")
    return bad


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
