"""Page faults and wall time per plan() call, V3 shape, in a fresh process: python speed_faults.py ROOT
(ROOT holds eplb/). BIGFREE=BYTES first allocates and frees one numpy array of that size,
which raises glibc's dynamic mmap/trim thresholds as any earlier large free in a long-running
process does."""
import sys, time, resource
import numpy as np, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
try:  # the layout since 0.2, else the flat one of older trees
    from eplb.core.planning import plan
except ImportError:
    from eplb.planning import plan
import os
if os.environ.get("BIGFREE"): x = np.ones(int(os.environ["BIGFREE"]) // 8); del x
def speed_loads(L, N, seed):
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((L, N)), 1) + 1.0
    return np.round(1e5 / ranks ** 0.9 * rng.uniform(0.5, 1.5, (L, N)))
L,N,P,M=58,256,288,32
load=speed_loads(L,N,1); drift=load*np.random.default_rng(2).uniform(0.8,1.2,load.shape)
for nodes, groups in ((4,8),(1,1)):
    prev=plan(load,M,P,nodes,groups)
    for prv in (None, prev):
        f=lambda: plan(drift,M,P,nodes,groups,previous=prv)
        for _ in range(5): f()
        r0=resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ts=[]
        for _ in range(40):
            t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
        r1=resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        print(nodes, "prev" if prv is not None else "none", "faults/call %.0f  median %.2f min %.2f"%((r1-r0)/40, 1e3*np.median(ts), 1e3*min(ts)))
