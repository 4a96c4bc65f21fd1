"""The scoring block of `reads.swap_down` (the torch passes and the argmin) on random inputs of the
DeepSeek-V3 catch-up shape (32 rows, 32 GPUs, 9 slots), in float64 and float32: microseconds per call.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/results/2026-12-06-issue29-speed/swap_block_f32.py
"""
import torch, numpy as np, time
torch.set_num_threads(1)
A,m,s=32,32,9
def block(dt):
    rng=np.random.default_rng(0)
    xh=torch.from_numpy(rng.random((A,s))).to(dt); X=torch.from_numpy(rng.random((A,m,s))).to(dt)
    LDh=torch.from_numpy(rng.random(A)).to(dt); LD_ex=torch.from_numpy(rng.random((A,m,s))).to(dt)
    th=xh.clone(); T=X.clone(); TKh=LDh.clone(); TK=torch.from_numpy(rng.random((A,m))).to(dt); cap=LDh.clone()
    score=torch.empty(A,m,s,s,dtype=dt); d=torch.empty_like(score); top=torch.empty_like(score)
    def f():
        torch.sub(xh[:, None, :, None], X[:, :, None, :], out=d)
        torch.sub(LDh[:, None, None, None], d, out=score)
        torch.add(LD_ex[..., None], d, out=top)
        torch.maximum(score, top, out=score)
        torch.sub(th[:, None, :, None], T[:, :, None, :], out=d)
        torch.sub(TKh[:, None, None, None], d, out=top)
        torch.add(TK[:, :, None, None], d, out=d)
        torch.maximum(top, d, out=top)
        top.sub_(cap[:, None, None, None]); top.clamp_(min=0.0); score.add_(top)
        return score.numpy().reshape(A,-1).argmin(1)
    f(); t=time.perf_counter()
    for _ in range(1000): f()
    return (time.perf_counter()-t)/1000*1e6
print("f64 block us", block(torch.float64)); print("f32 block us", block(torch.float32))
