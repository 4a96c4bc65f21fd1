"""Interleaved A/B of plan() timings of two or more checkouts: one case per subprocess,
the checkouts alternated per case (the order rotates every alternation), pinned to core
$CORE (default 1), wall and process CPU medians; ratios are each checkout / the first.
python ab_plan_speed.py OLD_DIR NEW_DIR [MORE_DIRS ...] [alternations] [cases comma-separated]"""
import subprocess, sys, json, os, numpy as np
args = sys.argv[1:]
dirs = []
while args and os.path.isdir(args[0]):
    dirs.append(os.path.abspath(args.pop(0)))
if len(dirs) < 2:
    sys.exit("give at least two checkout directories")
K = int(args[0]) if args else 4
cases = args[1].split(",") if len(args) > 1 else ["v3h_prev", "v3g_prev", "v3h_plan", "v3g_plan", "ep256_prev", "ep256_plan"]
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
names = [os.path.basename(os.path.normpath(d)) for d in dirs]
if len(dirs) == 2:
    print(f"{'case':11s} {'old wall med':>12s} {'new wall med':>12s} {'ratio wall':>10s} {'ratio cpu':>9s}   (per-alternation wall ratios)")
else:
    print("checkouts: " + ", ".join(f"{i}: {d}" for i, d in enumerate(dirs)))
    print(f"{'case':11s} " + " ".join(f"{'wall med ' + str(i):>11s}" for i in range(len(dirs)))
          + " " + " ".join(f"{'wall ' + str(i) + '/0':>9s} {'cpu ' + str(i) + '/0':>8s}" for i in range(1, len(dirs))))
for case in cases:
    R = [[] for _ in dirs]
    for i in range(K):
        for j in range(len(dirs)):
            d = (i + j) % len(dirs)  # rotate: every checkout runs first, second, ... alike
            out = subprocess.run(["taskset", "-c", os.environ.get("CORE", "1"), py, "-c", child, case], cwd=dirs[d], env=dict(env, PYTHONPATH=dirs[d]), capture_output=True, text=True, check=True).stdout
            R[d].append(json.loads(out.strip().splitlines()[-1]))
    A = [np.array(r) for r in R]  # [K, 2] wall, cpu of every checkout
    if len(dirs) == 2:
        o, n = A
        rw, rc = n[:, 0] / o[:, 0], n[:, 1] / o[:, 1]
        print(f"{case:11s} {np.median(o[:, 0]):12.2f} {np.median(n[:, 0]):12.2f} {np.median(rw):10.3f} {np.median(rc):9.3f}   " + " ".join(f"{r:.2f}" for r in rw), flush=True)
    else:
        cells = [f"{np.median(a[:, 0]):11.2f}" for a in A]
        for a in A[1:]:
            cells.append(f"{np.median(a[:, 0] / A[0][:, 0]):9.3f} {np.median(a[:, 1] / A[0][:, 1]):8.3f}")
        print(f"{case:11s} " + " ".join(cells), flush=True)
