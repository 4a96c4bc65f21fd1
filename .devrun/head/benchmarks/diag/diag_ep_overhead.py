"""Diagnostic run beside benchmarks/hf_throughput.py (1 GPU, no process group): where the
moe.hf expert-parallel wrapper's overhead at W=1 goes, and the bf16 noise floor of the
logits check.

    python3 benchmarks/diag/diag_ep_overhead.py

1. prefill time (8 x 512 tokens, logits_to_keep=1) of the original model and of
   expert_parallel(model, 0) (group None), with the host time of the forward call;
2. host synchronisations inside one forward of each (torch.cuda.set_sync_debug_mode),
   counted per source line;
3. torch.profiler: the top CUDA kernels of 3 forwards of each;
4. the same EP timing with `torch.repeat_interleave` given `output_size` in
   ExpertParallelExperts.forward (a patch applied in this process only, to test the
   cause; the code under test is not changed);
5. bf16 noise floor: logits of the original model with transformers' own "eager"
   experts against its "grouped_mm" experts (both transformers' code); and the EP check
   in fp32 (original vs EP, same weights in fp32).
"""
import collections
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import hf_throughput as hb  # noqa: E402
import moe.hf.experts as hfe  # noqa: E402
from moe.hf import expert_parallel  # noqa: E402

CUDA = torch.cuda.is_available()
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")  # cpu: tiny, to test this script
a = hb.parse_args([] if CUDA else ["--device", "cpu"])
cfg = hb.model_config(a)
work = hb.Workload(a.vocab, a.zipf, a.seed, dev)
batches = [work.batch(0, i, a.batch, a.seq) for i in range(13)]


def timed(fn, label):
    if not CUDA:
        torch.cuda.synchronize = lambda *x: None
    for ids in batches[:3]:
        fn(ids)
    torch.cuda.synchronize()
    dev_ms, host_ms = [], []
    for ids in batches[3:]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(ids)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        dev_ms.append(1e3 * (time.perf_counter() - t0))
        host_ms.append(1e3 * (t1 - t0))
    dev_ms.sort()
    host_ms.sort()
    print(f"{label}: median {dev_ms[len(dev_ms) // 2]:.2f} ms per forward (host call returns after "
          f"{host_ms[len(host_ms) // 2]:.2f} ms)", flush=True)


def syncs(fn, label):
    if not CUDA:
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn(batches[0])
    torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{Path(x.filename).name}:{x.lineno}" for x in w
                                if "synchroniz" in str(x.message))
    print(f"{label}: {sum(where.values())} host syncs in one forward: {dict(where)}", flush=True)


def profile(fn, label):
    from torch.profiler import ProfilerActivity, profile as prof
    if not CUDA:
        return
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for ids in batches[:3]:
            fn(ids)
        torch.cuda.synchronize()
    print(f"--- {label}: profiler, 3 forwards, by CUDA time")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


@torch.no_grad()
def main():
    ref = hb.build_model(cfg, a.seed, dev, torch.bfloat16)
    ep = expert_parallel(copy.deepcopy(ref), 0, None)
    f_ref = lambda ids: ref(input_ids=ids, logits_to_keep=1)  # noqa: E731
    f_ep = lambda ids: ep(input_ids=ids, logits_to_keep=1)  # noqa: E731
    timed(f_ref, "original (grouped_mm experts)")
    timed(f_ep, "expert_parallel(model, 0), W=1")
    syncs(f_ref, "original")
    syncs(f_ep, "expert_parallel")
    profile(f_ref, "original")
    profile(f_ep, "expert_parallel")

    # 4. the cause under test: repeat_interleave without output_size (a host sync per layer)
    real = torch.repeat_interleave

    class _Patched:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def repeat_interleave(x, repeats, *args, **kw):
            if "output_size" not in kw and isinstance(repeats, torch.Tensor) and x.dim() == 1:
                kw["output_size"] = _Patched.rows
            return real(x, repeats, *args, **kw)

    orig_forward = hfe.ExpertParallelExperts.forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        _Patched.rows = hidden_states.shape[0] * top_k_index.shape[1]  # W=1: every copy is local
        return orig_forward(self, hidden_states, top_k_index, top_k_weights)

    hfe.torch = _Patched()
    hfe.ExpertParallelExperts.forward = forward
    for layer in ep.moe_layers:
        layer.module.forward = lambda h, i, w, _l=layer: forward(_l, h, i, w)
    syncs(f_ep, "expert_parallel, repeat_interleave with output_size (patched here)")
    timed(f_ep, "expert_parallel, repeat_interleave with output_size (patched here)")
    ids = batches[0][:2]
    want = ref(input_ids=ids).logits.float()
    print("patched EP logits max abs diff vs original:",
          (ep(input_ids=ids).logits.float() - want).abs().max().item())
    hfe.torch = torch
    hfe.ExpertParallelExperts.forward = orig_forward
    del ep
    torch.cuda.empty_cache()

    # 5. bf16 noise floor: transformers' eager experts vs its grouped_mm experts
    ids = work.batch(0, 90_000, 2, a.seq)
    want = ref(input_ids=ids).logits.float()
    ref.set_experts_implementation("eager")
    got = ref(input_ids=ids).logits.float()
    print(f"bf16 original, transformers 'eager' vs 'grouped_mm' experts: logits max abs diff "
          f"{(got - want).abs().max().item():.4g}, max |logit| {want.abs().max().item():.4g}, "
          f"argmax agree {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.4f}", flush=True)
    del ref, got, want
    torch.cuda.empty_cache()

    # fp32: the EP wrapper against the original, same weights
    ref32 = hb.build_model(cfg, a.seed, dev, torch.float32)
    ep32 = expert_parallel(copy.deepcopy(ref32), 0, None)
    want = ref32(input_ids=ids).logits
    got = ep32(input_ids=ids).logits
    print(f"fp32 original vs expert_parallel (W=1): logits max abs diff "
          f"{(got - want).abs().max().item():.4g}, max |logit| {want.abs().max().item():.4g}, "
          f"argmax agree {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.4f}", flush=True)
    prompt = work.batch(0, 95_000, 1, 32)
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt))
    same = torch.equal(ep32.generate(prompt, **kw), ref32.generate(prompt, **kw))
    print(f"fp32 greedy generate, 16 tokens: equal {same}", flush=True)


main()
