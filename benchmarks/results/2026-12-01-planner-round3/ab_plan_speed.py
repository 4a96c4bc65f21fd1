"""Interleaved A/B of plan() timings of two checkouts: one case per subprocess, old and new
alternated per case, pinned to core $CORE (default 1), wall and process CPU medians.
python ab_plan_speed.py OLD_DIR NEW_DIR [alternations] [cases comma-separated]"""
import subprocess, sys, json, os, numpy as np
old, new = sys.argv[1], sys.argv[2]
K = int(sys.argv[3]) if len(sys.argv) > 3 else 4
cases = sys.argv[4].split(",") if len(sys.argv) > 4 else ["v3h_prev", "v3g_prev", "v3h_plan", "v3g_plan", "ep256_prev", "ep256_plan"]
child = r'''
import sys, time, json, numpy as np
sys.path.insert(0, "benchmarks")
from planner import speed_loads
from eplb import plan
case = sys.argv[1]
name, tag = case.split("_")
L, N, P, M, nodes, groups, reps = {"v3h": (58, 256, 288, 32, 4, 8, 41), "v3g": (58, 256, 288, 32, 1, 1, 41), "ep256": (58, 256, 512, 256, 1, 1, 11)}[name]
load = speed_loads(L, N, seed=1)
drift = load * np.random.default_rng(2).uniform(0.8, 1.2, load.shape)
prev = plan(load, M, P, nodes, groups)
fn = (lambda: plan(drift, M, P, nodes, groups)) if tag == "plan" else (lambda: plan(drift, M, P, nodes, groups, previous=prev))
fn(); fn(); tw = []; tc = []
for _ in range(reps):
    a = time.perf_counter(); b = time.process_time(); fn(); tc.append(time.process_time() - b); tw.append(time.perf_counter() - a)
print(json.dumps([1e3 * float(np.median(tw)), 1e3 * float(np.median(tc))]))
'''
env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
py = sys.executable
print(f"{'case':11s} {'old wall med':>12s} {'new wall med':>12s} {'ratio wall':>10s} {'ratio cpu':>9s}   (per-alternation wall ratios)")
for case in cases:
    R = {"old": [], "new": []}
    for i in range(K):
        for tag, d in (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old)):
            out = subprocess.run(["taskset", "-c", os.environ.get("CORE", "1"), py, "-c", child, case], cwd=d, env=dict(env, PYTHONPATH=d), capture_output=True, text=True, check=True).stdout
            R[tag].append(json.loads(out.strip().splitlines()[-1]))
    o, n = np.array(R["old"]), np.array(R["new"])
    rw, rc = n[:, 0] / o[:, 0], n[:, 1] / o[:, 1]
    print(f"{case:11s} {np.median(o[:, 0]):12.2f} {np.median(n[:, 0]):12.2f} {np.median(rw):10.3f} {np.median(rc):9.3f}   " + " ".join(f"{r:.2f}" for r in rw), flush=True)
