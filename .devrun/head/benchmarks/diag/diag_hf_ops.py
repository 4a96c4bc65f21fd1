"""The aten ops (TorchDispatchMode) and wall time of one transformers experts call and
one decode-size forward (8 tokens, no cache): the original Qwen3-MoE model against
`moe.hf.expert_parallel` of it, 2 layers, Qwen3-30B-A3B layer shapes, W = 1.

    python benchmarks/diag/diag_hf_ops.py [--device cpu]
"""
import collections
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moe.hf import expert_parallel  # noqa: E402
from moe.hf.configs import tiny_config  # noqa: E402


class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def wall_us(fn, n=300):
    out = []
    for _ in range(n):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        out.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(out[20:]))


def main():
    from transformers import AutoModelForCausalLM

    dev = "cpu" if "--device" in sys.argv and "cpu" in sys.argv else "cuda"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = tiny_config("qwen3_moe", hidden_size=2048, num_layers=2, num_experts=128, top_k=8,
                      intermediate_size=768, num_heads=32, num_kv_heads=4, head_dim=128,
                      vocab_size=151936)
    torch.manual_seed(0)
    with torch.device(dev):
        ref = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ep = expert_parallel(copy.deepcopy(ref), 2)
    ids = torch.randint(3, 1000, (8, 1), device=dev)
    for name, m in (("original", ref), ("wrapped", ep)):
        ex = [x for x in m.modules() if type(x).__name__.endswith("Experts")][0]
        cap = {}
        h = ex.register_forward_pre_hook(lambda mod, a: cap.setdefault("a", a))
        with torch.no_grad():
            m(input_ids=ids)
        h.remove()
        with torch.no_grad(), Log() as log:
            ex(*cap["a"])
        print(f"{name} experts call: {len(log.ops)} ops {log.ops}")
        with torch.no_grad(), Log() as log:
            m(input_ids=ids, logits_to_keep=1)
        print(f"{name} forward: {len(log.ops)} ops {collections.Counter(log.ops).most_common()}")
        with torch.no_grad():
            print(f"{name} experts call {wall_us(lambda: ex(*cap['a'])):.1f} us, forward "
                  f"{wall_us(lambda: m(input_ids=ids, logits_to_keep=1)):.1f} us", flush=True)


if __name__ == "__main__":
    main()
