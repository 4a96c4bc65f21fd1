"""Write the default plans of the speed shapes (plan() and plan(previous)) to an .npz, to
check that a speed change keeps them bit for bit: python dump_plans.py OUT.npz"""
import sys

import numpy as np

sys.path.insert(0, "benchmarks")
from planner import speed_loads  # noqa: E402

from eplb import plan  # noqa: E402


def speed_plans() -> dict:
    """plan() and plan(previous) of the three speed shapes of benchmarks/planner.py."""
    out = {}
    for name, L, N, P, M, nodes, groups in [("v3h", 58, 256, 288, 32, 4, 8), ("v3g", 58, 256, 288, 32, 1, 1),
                                            ("ep256", 58, 256, 512, 256, 1, 1)]:
        load = speed_loads(L, N, seed=1)
        drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
        prev = plan(load, M, P, nodes, groups)
        out[name + "_plan"] = plan(drift, M, P, nodes, groups).physical_to_logical
        out[name + "_prev"] = plan(drift, M, P, nodes, groups, previous=prev).physical_to_logical
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in speed_plans().items()})
