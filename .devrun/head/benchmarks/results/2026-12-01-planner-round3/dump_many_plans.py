"""Dump many default plans (speed shapes + random small/medium problems, with and without
previous, hierarchical and global, weighted too) to OUT.npz. Run with PYTHONPATH=<checkout>:
python dump_many_plans.py OUT.npz"""
import sys
import numpy as np
sys.path.insert(0, "benchmarks")
from dump_plans import speed_plans  # this folder: the speed shapes' plans
from eplb import plan

out = speed_plans()
rng = np.random.default_rng(0)
shapes = [(8, 64, 72, 8, 1, 1), (8, 64, 80, 8, 2, 4), (4, 32, 48, 8, 1, 1), (6, 128, 144, 16, 1, 1),
          (6, 128, 160, 16, 4, 8), (12, 64, 64, 8, 1, 1), (5, 16, 32, 16, 1, 1), (3, 256, 288, 32, 4, 8),
          (20, 256, 288, 32, 1, 1), (10, 160, 192, 32, 1, 1), (7, 64, 96, 32, 1, 1), (30, 64, 128, 16, 2, 8)]
for i in range(60):
    L, N, P, M, nodes, groups = shapes[i % len(shapes)]
    kind = i % 3
    if kind == 0:
        load = rng.zipf(1.5, (L, N)).astype(float)
    elif kind == 1:
        load = np.round(rng.lognormal(0, 1.5, (L, N)) * 100)
    else:
        load = rng.integers(0, 50, (L, N)).astype(float)
        load[:, rng.integers(0, N)] *= 40
    drift = load * rng.uniform(0.7, 1.3, load.shape)
    prev = plan(load, M, P, nodes, groups)
    out[f"r{i}_plan"] = prev.physical_to_logical
    out[f"r{i}_prev"] = plan(drift, M, P, nodes, groups, previous=prev).physical_to_logical
    if i % 4 == 0:
        wp = plan(drift, M, P, nodes, groups, previous=prev, weighted=True)
        out[f"r{i}_w"] = wp.physical_to_logical
        out[f"r{i}_ws"] = wp.shares
np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in out.items()})
print(len(out), "plans written")
