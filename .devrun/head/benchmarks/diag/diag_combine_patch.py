"""Diagnostic run (1 GPU, no process group), after diag_ep_overhead.py: does the moe.hf
wrapper's W=1 overhead go away when its combine and gate-weighted sum are done the way
transformers' own grouped_mm experts do them? Patches ExpertParallelExperts.forward in
this process only (the code under test is not changed):

  * repeat_interleave with output_size (no host sync),
  * combine by gathering with the inverse permutation (`y[inv]`) instead of the
    index_put scatter `y[order] = y_sorted` (W=1 only: no exchange),
  * gate weights applied in the model dtype, `(y * w).sum(1)` (transformers'
    grouped_mm does this), instead of `weighted_sum`'s float32 copy of [T, K, H].

    python3 benchmarks/diag/diag_combine_patch.py
"""
import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import hf_throughput as hb  # noqa: E402
from moe.dispatch import count_slots, dispatch, map_to_physical  # noqa: E402
from moe.hf import expert_parallel  # noqa: E402

CUDA = torch.cuda.is_available()
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")  # cpu: tiny, to test this script
a = hb.parse_args([] if CUDA else ["--device", "cpu"])
cfg = hb.model_config(a)
work = hb.Workload(a.vocab, a.zipf, a.seed, dev)
batches = [work.batch(0, i, a.batch, a.seq) for i in range(23)]


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, label):
    for ids in batches[:3]:
        fn(ids)
    ms = []
    for ids in batches[3:]:
        sync()
        t0 = time.perf_counter()
        fn(ids)
        sync()
        ms.append(1e3 * (time.perf_counter() - t0))
    ms.sort()
    print(f"{label}: median {ms[len(ms) // 2]:.2f} ms per forward ({len(ms)} timed), "
          f"{a.batch * a.seq / ms[len(ms) // 2] * 1e3:,.0f} tokens/s", flush=True)


def patched_forward(self, hidden_states, top_k_index, top_k_weights):
    """ExpertParallelExperts.forward for a group of one, combine and weighting as in
    transformers' grouped_mm_experts_forward."""
    S, P = self.num_local_physical_experts, self.num_physical_experts
    T, K = top_k_index.shape
    physical = map_to_physical(top_k_index.long(), self.logical_to_physical_map,
                               self.logical_replica_count, self.logical_replica_cdf)
    slot_counts = count_slots(physical, P)
    if self.record_load:
        self.expert_load_view.add_(slot_counts.to(self.expert_load_view.dtype))
    x_local, counts, _, state = dispatch(hidden_states, physical, S, None, slot_counts, "exact")
    local_slot = torch.repeat_interleave(torch.arange(S, device=counts.device), counts.long(),
                                         output_size=x_local.shape[0])
    ones = torch.ones(x_local.shape[0], 1, dtype=top_k_weights.dtype, device=x_local.device)
    y_local = self._expert_forward(self.module, x_local, local_slot.unsqueeze(1), ones)
    inv = torch.empty_like(state.order)
    inv[state.order] = torch.arange(state.order.numel(), device=inv.device)
    y = y_local[inv].view(T, K, -1)  # [T, K, H] gather, not scatter
    return (y * top_k_weights.to(y.dtype).unsqueeze(-1)).sum(1).to(hidden_states.dtype)


@torch.no_grad()
def main():
    ref = hb.build_model(cfg, a.seed, dev, torch.bfloat16)
    ep = expert_parallel(copy.deepcopy(ref), 0, None)
    f_ref = lambda ids: ref(input_ids=ids, logits_to_keep=1)  # noqa: E731
    f_ep = lambda ids: ep(input_ids=ids, logits_to_keep=1)  # noqa: E731
    ids = work.batch(0, 90_000, 2, a.seq)
    want = ref(input_ids=ids).logits.float()

    def check(label):
        got = ep(input_ids=ids).logits.float()
        print(f"{label}: logits max abs diff vs original {(got - want).abs().max().item():.4g}, "
              f"argmax agree {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.4f}", flush=True)

    for rnd in (1, 2):
        timed(f_ref, f"[{rnd}] original")
        timed(f_ep, f"[{rnd}] expert_parallel as committed")
    check("expert_parallel as committed")
    for layer in ep.moe_layers:
        layer.module.forward = lambda h, i, w, _l=layer: patched_forward(_l, h, i, w)
    for rnd in (1, 2):
        timed(f_ep, f"[{rnd}] expert_parallel, patched combine + bf16 weighting")
    timed(f_ref, "[3] original")
    check("expert_parallel, patched")


main()
