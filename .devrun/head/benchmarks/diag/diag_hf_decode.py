"""Eager decode of the original Qwen3-MoE model (Qwen3-30B-A3B layer shapes, `--layers`)
against `moe.hf.expert_parallel` of it at W = 1: generate() wall time interleaved, with
and without an EplbRuntime and load recording, and cProfile's top functions of one
generate() of each (where the host time goes).

    python benchmarks/diag/diag_hf_decode.py [--layers 12] [--device cpu]
"""
import argparse
import copy
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_throughput import GPU_DEFAULTS, CPU_DEFAULTS, Workload, build_model, model_config  # noqa: E402

from eplb import EplbConfig, EplbRuntime  # noqa: E402
from eplb.ops.launch import free_port  # noqa: E402
from moe.hf import expert_parallel  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=12)
    a = p.parse_args()
    m = argparse.Namespace(**(GPU_DEFAULTS if a.device == "cuda" else CPU_DEFAULTS))
    m.layers = a.layers
    dev = torch.device(a.device)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ref = build_model(model_config(m), 0, dev, getattr(torch, m.dtype))
    ep = expert_parallel(copy.deepcopy(ref), 2)
    prompt = Workload(m.vocab, 1.0, 0, dev).batch(0, 50_000, m.batch, m.decode_prompt)
    kw = dict(max_new_tokens=m.decode_new, min_new_tokens=m.decode_new, do_sample=False,
              attention_mask=torch.ones_like(prompt))

    def gen(model):
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, **kw)
        torch.cuda.synchronize() if dev.type == "cuda" else None
        return 1e3 * (time.perf_counter() - t0)

    def record_off(model):
        model.set_record_load(False)
        try:
            return gen(model)
        finally:
            model.set_record_load(True)

    cases = {"original": lambda: gen(ref), "wrapped, no runtime": lambda: gen(ep),
             "wrapped, record off": lambda: record_off(ep)}
    times = {k: [] for k in cases}
    for k in cases:
        cases[k]()
    for r in range(3):
        for k, fn in cases.items():
            times[k].append(fn())
    runtime = EplbRuntime(ep, EplbConfig(rebalance_interval=0, control_interval=0))
    times["wrapped, with runtime"] = [gen(ep) for _ in range(3)]
    for k, v in times.items():
        print(f"{k:24s} generate ms median {np.median(v):8.1f}  all {[round(x, 1) for x in v]}")
    for name, model in (("original", ref), ("wrapped", ep)):
        prof = cProfile.Profile()
        prof.enable()
        gen(model)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(f"--- cProfile {name} (tottime)\n" + "\n".join(s.getvalue().splitlines()[:45]))
    runtime.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
