"""Where the planner process's extra time goes: the same decode-aware DeepSeek-V3 plan (4 nodes,
16 tokens/GPU) timed in this process, inside a child that times its own loop (the planner
process's malloc settings), and through `PlannerProcess` (the round trip). Run from any folder:
`OMP_NUM_THREADS=1 taskset -c 1 python child_timing.py`."""
import sys, time, pickle, os, subprocess, numpy as np
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4] / 'benchmarks'))
from planner import speed_loads, plan, DEFAULT_READ_TOKENS
from eplb.runtime import planner_process as pp
L,N,P,M=58,256,288,32
load = speed_loads(L,N,1); drift = load*np.random.default_rng(2).uniform(0.8,1.2,load.shape)
prev = plan(load,M,P,4,8)
kw=dict(load=drift, num_gpus=M, num_slots=P, num_nodes=4, num_groups=8, previous=prev, read_tokens=DEFAULT_READ_TOKENS, step_choices=float(M*16*8))
child_code = r'''
import sys, pickle, time, numpy as np
from eplb.core.planning import plan
req = pickle.loads(sys.stdin.buffer.read())
for _ in range(5): plan(**req)
ts=[]
for _ in range(81):
    t=time.perf_counter(); plan(**req); ts.append(time.perf_counter()-t)
print(f"{1e3*np.median(ts):.2f}")
'''
env = dict(os.environ, **pp.MALLOC_SETTINGS)
def child():
    r = subprocess.run([sys.executable, "-c", child_code], input=pickle.dumps(kw, protocol=5), capture_output=True, env=env)
    return r.stdout.decode().strip() or r.stderr.decode()[-300:]
def inproc():
    for _ in range(5): plan(**kw)
    ts=[]
    for _ in range(81):
        t=time.perf_counter(); plan(**kw); ts.append(time.perf_counter()-t)
    return f"{1e3*np.median(ts):.2f}"
pc = pp.PlannerProcess()
def viaproc():
    for _ in range(5): pc.plan(**kw)
    ts=[]
    for _ in range(81):
        t=time.perf_counter(); pc.plan(**kw); ts.append(time.perf_counter()-t)
    return f"{1e3*np.median(ts):.2f}"
for i in range(3):
    print("in-process", inproc(), "child-internal", child(), "planner-process round trip", viaproc())
pc.close()
