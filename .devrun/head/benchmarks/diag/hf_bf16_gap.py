"""How far the *unmodified* tiny HF models of `eplb demo --model NAME` are, in bfloat16,
from their own float32 logits (what `HF_BF16_TOLERANCE` in eplb/ops/demo_args.py must leave
room for), and how skewed the demo's synthetic routing is at `DEMO_BIAS_STRENGTH`.

    python benchmarks/diag/hf_bf16_gap.py          # CPU, about a minute

Each architecture is built as the demo builds it (its default sizes, seed 0); one batch of
the demo's size (256 tokens as 8 sequences of 32 random ids) goes through the float32 model
and a bfloat16 copy; the line is the largest |logit difference|. Then the reference
model's realised routing under the synthetic workload's bias: hottest expert's tokens /
the mean, per layer, over 20 steps (`eplb demo` defaults).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eplb.ops.demo import DEMO_BIAS_STRENGTH, build_parser  # noqa: E402
from eplb.ops.demo_args import HF_ARCHITECTURES, HF_BF16_TOLERANCE, check_demo_arguments  # noqa: E402


def bf16_gaps() -> None:
    import transformers

    from moe.hf.configs import tiny_model
    transformers.logging.set_verbosity_error()
    for arch in HF_ARCHITECTURES:
        a = build_parser().parse_args(["--model", arch])
        check_demo_arguments(a)
        model = tiny_model(arch, seed=a.seed, dtype=torch.float32, num_layers=a.layers,
                           num_experts=a.experts, top_k=a.top_k, hidden_size=a.hidden,
                           intermediate_size=a.intermediate)
        half = copy.deepcopy(model).to(torch.bfloat16)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (8, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            d = (half(ids).logits.float() - model(ids).logits).abs().max().item()
        print(f"{arch:<12} bfloat16 vs float32 logits: max |diff| {d:.3f} "
              f"(HF_BF16_TOLERANCE {HF_BF16_TOLERANCE:g})", flush=True)


def routing_skew() -> None:
    import numpy as np

    from eplb.core.workload import routing_bias
    from eplb.ops.demo import setup
    from moe.reference import DenseMoEModel

    a = build_parser().parse_args([])
    check_demo_arguments(a)
    _, args, workload = setup(a, 1)
    model = DenseMoEModel(args)
    ratios = []
    for step in range(20):
        bias = torch.from_numpy(routing_bias(workload.popularity(step), DEMO_BIAS_STRENGTH)).float()
        model.set_routing_bias(bias)
        model.reset_load()
        x = torch.randn(a.tokens, a.hidden, generator=torch.Generator().manual_seed(step))
        model(x.to(args.dtype) if hasattr(args, "dtype") and isinstance(args.dtype, torch.dtype) else x)
        counts = model.logical_load.float()  # [L, N] tokens per expert
        ratios.append((counts.max(1).values / counts.mean(1)).numpy())
    r = np.stack(ratios)  # [steps, L]
    print(f"demo routing at bias strength {DEMO_BIAS_STRENGTH}: hottest expert / mean, median "
          f"{np.median(r):.2f} (min {r.min():.2f}, max {r.max():.2f}) over {r.size} layer-steps")


if __name__ == "__main__":
    bf16_gaps()
    routing_skew()
