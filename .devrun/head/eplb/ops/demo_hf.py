"""`eplb demo --model NAME`: a tiny random transformers MoE model (moe.hf.configs), made
expert-parallel by `moe.hf.expert_parallel`, served under EplbRuntime by the demo loop.

The load: each step every rank feeds token ids [B, T] drawn from a Zipf distribution over
the vocabulary whose ranking drifts (`SkewedDriftWorkload` with one "layer" of V
entries: --skew, --drift-period), so the router's choices, and with them the experts'
load, are skewed and shift over time. `--verify` runs an unmodified copy of the model
on the same ids: logits at every step, slots bitwise after every rebalance, and a greedy
`generate()` token for token at the end.

transformers is imported only here and in moe.hf, on the ranks of a `--model` run.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.runtime import EplbRuntime
from eplb.core.workload import SkewedDriftWorkload

GENERATE_TOKENS = 8  # new tokens of the final greedy generate() under --verify


class HFJob:
    """One rank's transformers model, its runtime, the unmodified copy (--verify) and the
    token-id workload; the same interface as `eplb.ops.demo.ReferenceJob`."""

    def __init__(self, a: argparse.Namespace, config: EplbConfig, tolerance: float, group,
                 device: torch.device):
        import transformers

        from moe.hf import expert_parallel
        from moe.hf.configs import tiny_model

        transformers.logging.set_verbosity_error()  # config notes, once per rank: not ours
        dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
        model = tiny_model(a.model, seed=a.seed, dtype=dtype, num_layers=a.layers,
                           num_experts=a.experts, top_k=a.top_k, hidden_size=a.hidden,
                           intermediate_size=a.intermediate)
        self.a, self.device, self.dtype = a, device, dtype
        self.name = type(model).__name__
        self.vocab = model.config.get_text_config().vocab_size
        self.reference = copy.deepcopy(model) if a.verify else None  # unmodified
        self.model = expert_parallel(model, config.num_redundant_experts, group)
        self.runtime = EplbRuntime(self.model, config, group=group)
        self.tolerance = tolerance  # logits max |diff|
        self.workload = SkewedDriftWorkload(1, self.vocab, zipf_s=a.skew, period=a.drift_period,
                                            seed=a.seed)
        self.gen = torch.Generator(device="cpu").manual_seed(a.seed * 100_003 + self.runtime.rank)
        self.diff_since_verify = 0.0  # largest per-step logits diff since the last verify()
        self.diff_all = 0.0  # ... over the whole run

    def describe(self) -> str:
        a, m = self.a, self.model
        return (f"{a.model} ({self.name}, random tiny config, {a.dtype}): {m.num_moe_layers} MoE "
                f"layers x {m.num_logical_experts} experts (top-{a.top_k}), "
                f"{m.num_physical_experts} slots, {a.tokens} tokens/rank/step "
                f"({a.tokens // a.seq_len} x {a.seq_len}), workload=drifting Zipf token ids "
                f"(s={a.skew:g}, vocab {self.vocab})")

    def sample(self, step: int) -> torch.Tensor:  # [B, T] token ids
        p = torch.from_numpy(self.workload.popularity(step)[0])  # [V]
        B, T = self.a.tokens // self.a.seq_len, self.a.seq_len
        return torch.multinomial(p, B * T, replacement=True, generator=self.gen).view(B, T)

    def forward(self, step: int) -> float | None:
        """One forward of this step's ids; with --verify the largest |logits - unmodified
        model's logits| over all ranks (a collective), else None."""
        ids = self.sample(step).to(self.device)  # [B, T]
        with torch.no_grad():
            logits = self.model(ids).logits  # [B, T, V]
            if self.reference is None:
                return None
            want = self.reference(ids).logits  # [B, T, V]
        diff = torch.tensor([(logits.float() - want.float()).abs().max().item()],
                            dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        d = float(diff[0])
        self.diff_since_verify = max(self.diff_since_verify, d)
        self.diff_all = max(self.diff_all, d)
        return d

    def verify(self) -> tuple[float, int]:
        """After a rebalance: (largest logits diff since the previous call, slots of this
        rank whose tensors differ bitwise from their expert's rows in the unmodified model)."""
        from moe.hf import find_experts_modules

        diff, self.diff_since_verify = self.diff_since_verify, 0.0
        ref_layers = [m for _, m in find_experts_modules(self.reference)]
        S = self.model.num_local_physical_experts
        p2l = self.runtime.placement.physical_to_logical  # [L, P]
        bad = 0
        for layer, (ep_layer, ref) in enumerate(zip(self.model.moe_layers, ref_layers)):
            weights = self.runtime.expert_weights[layer]  # each [S, ...]
            for s in range(S):
                expert = int(p2l[layer, self.runtime.rank * S + s])
                bad += any(not torch.equal(w[s], getattr(ref, n)[expert])
                           for n, w in zip(ep_layer.names, weights))
        return diff, bad

    def finish(self) -> tuple[str, bool, dict] | None:
        """--verify: a greedy generate() of GENERATE_TOKENS tokens on a fresh batch, the
        expert-parallel model against the unmodified one (collective); (line, ok, record)."""
        if self.reference is None:
            return None
        ids = self.sample(self.a.steps).to(self.device)  # [B, T] prompt
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS)  # no early stop
        self.model.set_record_load(False)
        with torch.no_grad():
            got = self.model.generate(ids, **kw)[:, ids.shape[1]:]  # [B, GENERATE_TOKENS]
            want = self.reference.generate(ids, **kw)[:, ids.shape[1]:]  # [B, GENERATE_TOKENS]
        self.model.set_record_load(True)
        t = torch.tensor([int((got != want).sum()), got.numel()], dtype=torch.int64)
        dist.all_reduce(t)
        mismatched, total = int(t[0]), int(t[1])
        world = dist.get_world_size(self.runtime.group)
        # bfloat16 rounding flips near-tie argmaxes of a random model: tokens reported only
        exact = self.dtype == torch.float32
        ok = self.diff_all <= self.tolerance and (mismatched == 0 or not exact)
        line = (f"verify: logits max |diff| {self.diff_all:.1e} over {self.a.steps} steps "
                f"(tolerance {self.tolerance:g}); greedy generate() of {GENERATE_TOKENS} tokens "
                f"x {ids.shape[0]} sequences x {world} ranks: {total - mismatched}/{total} tokens "
                f"as the unmodified model{'' if exact else ' (bfloat16: not checked)'} "
                f"{'OK' if ok else 'FAILED'}")
        record = {"logits_max_abs_diff": self.diff_all, "tolerance": self.tolerance,
                  "generate_tokens": total, "generate_mismatched": mismatched,
                  "generate_checked": exact, "ok": ok}
        return line, ok, record
