"""The planner process's round trip for requests that fail at once (so the reply is small): a
null request, the DeepSeek-V3 load with and without a previous placement, a tiny load.
`OMP_NUM_THREADS=1 taskset -c 1 python transfer.py`."""
import sys, time, numpy as np
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4] / 'benchmarks'))
from planner import speed_loads, plan
from eplb.runtime import planner_process as pp
L,N,P,M=58,256,288,32
load = speed_loads(L,N,1)
prev = plan(load,M,P,4,8)
pc = pp.PlannerProcess()
def t(req, n=200):
    for _ in range(5):
        try: pc._call(req)
        except Exception: pass
    ts=[]
    for _ in range(n):
        t0=time.perf_counter()
        try: pc._call(req)
        except Exception: pass
        ts.append(time.perf_counter()-t0)
    return f"{1e3*np.median(ts):.3f}"
print("null", t(None))
print("bad request with load+prev (error reply)", t(dict(load=load, num_gpus=-1, num_slots=P, previous=prev)))
print("bad request, load only", t(dict(load=load, num_gpus=-1, num_slots=P)))
print("bad request, tiny", t(dict(load=load[:1,:4], num_gpus=-1, num_slots=P)))
pc.close()
