"""A transformers Qwen3-MoE model (Qwen3-30B-A3B layer shapes, random weights, reduced
depth) made expert-parallel with `moe.hf.expert_parallel`: prefill tokens/s with EPLB
against the same model with a static placement, against the original model replicated on
every GPU, and against transformers' own expert parallelism, side by side in one run;
outputs checked against the original model in the same run.

    torchrun --nproc-per-node 2 benchmarks/hf_throughput.py     # 2 GPUs (NCCL), bf16
    python benchmarks/hf_throughput.py                          # 1 GPU, 1 process
    python benchmarks/hf_throughput.py --device cpu --nproc 2   # tiny, 2 gloo ranks (smoke)

Model: `moe.hf.configs.tiny_config("qwen3_moe", ...)` with Qwen3-30B-A3B's shapes
(hidden 2048, 128 experts, top-8, expert intermediate 768, 32 heads, 4 KV heads,
head_dim 128, vocab 151936, norm_topk_prob) and `--layers` of its 48 layers, built on
every rank from the same seed directly on the device (checked equal across ranks), routers
random as in `tiny_model`.

Workload (skewed routing without real text): token ids drawn from a Zipf law over the
vocabulary (p(k-th most frequent) ~ 1/k^a, `--zipf`, over a seeded permutation of the
non-special ids), each rank and step its own sample; the same batches in every mode.
Frequent tokens route to the same few experts, so the expert load is skewed (the run
prints how much).

Modes, in this order, each timed on the same batches:
  original   the unmodified model, a full replica on every GPU (data parallel, no
             communication): the reference the others are checked against
  ep-static  `expert_parallel(model, R)`: slot p holds expert p mod N (R = redundant slots
             in all, `--redundant-per-rank` x W), `EplbRuntime.step()` after every forward,
             never rebalanced; its timed steps are also EPLB's window
  ep-eplb    the same model after one `runtime.rebalance()` planned on that window
  hf-tp      W > 1: transformers' own EP, `DistributedConfig(tp_size=W, ep_size=W)`:
             attention tensor-parallel, every rank holds the same (global) batch, experts
             over an all-reduce (transformers' "auto" choice for a shared batch)
  hf-fsdp    W > 1: `DistributedConfig(fsdp_size=W, ep_size=W)`: each rank its own batch,
             experts over all-to-all, dense weights FSDP2-sharded (gathered per forward)
A transformers mode that fails to load or run is reported with its error.

Timing: prefill of `--batch` x `--seq` tokens per rank (hf-tp: the W ranks' batches
concatenated on every rank), `logits_to_keep=1` (the logits a server keeps after
prefill); per repetition, synchronize + barrier, then wall time to the end of the forward
and (EP modes) `runtime.step()` with a synchronize; the slower rank's time; `--warmup`
untimed repetitions first; tokens/s = tokens of all ranks / median time.
Decode: `generate()` of `--decode-new` greedy tokens after a `--decode-prompt`-token
prompt, batch `--batch` per rank, median of `--decode-reps`.

Checks (every mode, against the original model on the same GPU, same inputs): max abs
difference of the full logits of a `--check-batch` x `--seq` batch, the largest |logit|,
the share of positions whose argmax agrees; greedy `generate()` of `--gen-new` tokens from
a 32-token prompt per rank: tokens equal or not. In bf16 the EP paths sum in another order
(expert outputs weighted in fp32), so small differences, and rare argmax flips, are
expected. Balancedness (mean / max of per-GPU (token, k) counts, mean over layers) comes
from the load the EP model records (`expert_load_view` folded per rank), summed over
ranks and over the timed steps.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eplb.core.config import EplbConfig  # noqa: E402
from eplb.core.placement import balancedness_of_gpu_loads  # noqa: E402
from eplb.runtime import EplbRuntime  # noqa: E402
from eplb.ops.launch import free_port, launch_command  # noqa: E402

# Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B), depth reduced
GPU_DEFAULTS = dict(layers=12, hidden=2048, experts=128, top_k=8, intermediate=768, heads=32,
                    kv_heads=4, head_dim=128, vocab=151936, batch=8, seq=512, reps=10, warmup=3,
                    check_batch=2, gen_new=8, decode_prompt=128, decode_new=32, decode_reps=3,
                    dtype="bfloat16")
CPU_DEFAULTS = dict(layers=2, hidden=64, experts=16, top_k=4, intermediate=32, heads=4,
                    kv_heads=2, head_dim=16, vocab=512, batch=2, seq=32, reps=3, warmup=1,
                    check_batch=2, gen_new=4, decode_prompt=8, decode_new=4, decode_reps=1,
                    dtype="float32")
HF_MODES = ("tp", "fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo, tiny default sizes")
    p.add_argument("--nproc", type=int, default=1, help="ranks to start when not under torchrun")
    for name in GPU_DEFAULTS:
        if name == "dtype":
            continue
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {GPU_DEFAULTS[name]} (--device cpu: {CPU_DEFAULTS[name]})")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument("--redundant-per-rank", type=int, default=2,
                   help="redundant slots per GPU: R = this x W (default 2)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the token ids")
    p.add_argument("--min-gain", type=float, default=EplbConfig.min_gain,
                   help="EplbConfig.min_gain of the rebalance")
    p.add_argument("--hf-ep", default=",".join(HF_MODES),
                   help="transformers EP modes to run when W > 1, comma-separated ('' = none)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--watchdog", type=float, default=0, metavar="SECONDS",
                   help="dump every thread's stack and exit if a rank runs longer (0 = off)")
    a = p.parse_args(argv)
    defaults = CPU_DEFAULTS if a.device == "cpu" else GPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    for name in ("layers", "hidden", "experts", "top_k", "intermediate", "heads", "kv_heads",
                 "head_dim", "vocab", "batch", "seq", "reps", "check_batch", "gen_new",
                 "decode_prompt", "decode_new", "decode_reps", "nproc"):
        if getattr(a, name) < 1:
            raise SystemExit(f"hf_throughput: --{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0 or a.redundant_per_rank < 0:
        raise SystemExit("hf_throughput: --warmup and --redundant-per-rank must be >= 0")
    if a.zipf <= 0:
        raise SystemExit("hf_throughput: --zipf must be > 0")
    a.hf_ep = [m for m in a.hf_ep.split(",") if m]
    bad = [m for m in a.hf_ep if m not in HF_MODES]
    if bad:
        raise SystemExit(f"hf_throughput: --hf-ep: unknown {bad}, choose from {list(HF_MODES)}")
    return a


# ---- model and workload ---------------------------------------------------------------
def model_config(a: argparse.Namespace):
    from moe.hf.configs import tiny_config

    return tiny_config("qwen3_moe", hidden_size=a.hidden, num_layers=a.layers,
                       num_experts=a.experts, top_k=a.top_k, intermediate_size=a.intermediate,
                       vocab_size=a.vocab, num_heads=a.heads, num_kv_heads=a.kv_heads,
                       head_dim=a.head_dim,
                       max_position_embeddings=max(a.seq, a.decode_prompt + a.decode_new, 64) + 64)


def build_model(config, seed: int, device: torch.device, dtype: torch.dtype):
    """`moe.hf.configs.tiny_model`'s model, built on `device` in `dtype` (tiny_model builds
    on the CPU in fp32 first: minutes and 4x the memory at these shapes). The same on
    every rank of one device type for one seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if "router" in type(module).__name__.lower():
                for p in module.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


def check_same_on_ranks(model, group) -> float:
    """Largest difference across ranks of per-tensor float64 sums (0: same model)."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])  # [n]
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return float((hi - lo).abs().max())


class Workload:
    """Token ids from a Zipf law over a seeded permutation of the non-special vocabulary."""

    def __init__(self, vocab: int, exponent: float, seed: int, device: torch.device):
        gen = torch.Generator().manual_seed(seed + 7)
        ids = torch.randperm(vocab - 3, generator=gen) + 3  # 0-2: pad, bos, eos
        p = 1.0 / torch.arange(1, vocab - 2, dtype=torch.float64) ** exponent
        self.ids, self.p = ids, (p / p.sum()).float()
        self.seed, self.device = seed, device

    def batch(self, rank: int, index: int, batch: int, seq: int) -> torch.Tensor:  # [B, T]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + index)
        draw = torch.multinomial(self.p, batch * seq, replacement=True, generator=gen)
        return self.ids[draw].view(batch, seq).to(self.device)

    def global_batch(self, world: int, index: int, batch: int, seq: int) -> torch.Tensor:
        return torch.cat([self.batch(r, index, batch, seq) for r in range(world)])  # [W*B, T]


# ---- measurement ------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _local(t):
    """A DTensor's full value; a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class Bench:
    def __init__(self, a: argparse.Namespace, device: torch.device):
        self.a, self.device = a, device
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.work = Workload(a.vocab, a.zipf, a.seed, device)

    def inputs(self, index: int, shared: bool, batch: int | None = None, seq: int | None = None):
        batch, seq = batch or self.a.batch, seq or self.a.seq
        if shared:
            return self.work.global_batch(self.world, index, batch, seq)
        return self.work.batch(self.rank, index, batch, seq)

    def timed(self, forward, shared: bool, after=None, load=None) -> dict:
        """`--warmup` + `--reps` prefill forwards on batches 0.. (the same in every mode);
        per repetition the slower rank's seconds. `after()` runs after each forward
        (runtime.step); `load` (the EP model's load view [L, P]) is summed over the timed
        repetitions before `after()` zeroes it."""
        a, dev = self.a, self.device
        seconds = torch.zeros(a.reps, dtype=torch.float64, device=dev)
        total = None if load is None else torch.zeros_like(load)
        for i in range(a.warmup + a.reps):
            ids = self.inputs(i, shared)
            _sync(dev)
            dist.barrier(group=self.group)
            t0 = time.perf_counter()
            with torch.no_grad():
                forward(ids)
            if i >= a.warmup and total is not None:
                total += load
            if after is not None:
                after()
            _sync(dev)
            if i >= a.warmup:
                seconds[i - a.warmup] = time.perf_counter() - t0
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)
        sec = seconds.cpu().numpy()
        tokens = self.world * a.batch * a.seq  # hf-tp: the global batch on every rank
        out = {"tokens_per_s": tokens / float(np.median(sec)), "ms_median": 1e3 * float(np.median(sec)),
               "ms_min": 1e3 * float(sec.min()), "ms_max": 1e3 * float(sec.max()),
               "ms_all": [round(1e3 * float(s), 3) for s in sec], "tokens_per_rep": tokens}
        if total is not None:
            dist.all_reduce(total, group=self.group)
            out["load"] = total.cpu().numpy()  # [L, P] all ranks, timed repetitions
        return out

    def decode(self, model, shared: bool) -> dict | None:
        """Median seconds of generate(decode_new greedy tokens) after a decode_prompt prompt."""
        a, dev = self.a, self.device
        if a.no_decode:
            return None
        prompt = self.inputs(50_000, shared, seq=a.decode_prompt)
        kw = dict(max_new_tokens=a.decode_new, min_new_tokens=a.decode_new, do_sample=False,
                  attention_mask=torch.ones_like(prompt))
        seconds = torch.zeros(a.decode_reps, dtype=torch.float64, device=dev)
        for i in range(1 + a.decode_reps):  # one untimed
            _sync(dev)
            dist.barrier(group=self.group)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, **kw)
            _sync(dev)
            if i:
                seconds[i - 1] = time.perf_counter() - t0
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)
        med = float(np.median(seconds.cpu().numpy()))
        new = self.world * a.batch * a.decode_new
        return {"new_tokens_per_s": new / med, "ms_median": 1e3 * med, "new_tokens": new}

    def check(self, model, ref, shared: bool) -> dict:
        """Logits and greedy tokens of `model` against the original `ref` (local, same GPU)."""
        a = self.a
        ids = self.inputs(90_000, shared, batch=a.check_batch)
        with torch.no_grad():
            got = _local(model(input_ids=ids).logits).float()  # [B, T, V]
            want = ref(input_ids=ids).logits.float()
            diff = (got - want).abs().max()
            scale = want.abs().max()
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
        del got, want
        prompt = self.inputs(95_000, shared, batch=1, seq=32)
        kw = dict(max_new_tokens=a.gen_new, min_new_tokens=a.gen_new, do_sample=False,
                  attention_mask=torch.ones_like(prompt))
        with torch.no_grad():
            out = model.generate(prompt, **kw)[:, prompt.shape[1]:]
            exp = ref.generate(prompt, **kw)[:, prompt.shape[1]:]
        same = (out == exp).float()  # [1, gen_new]
        first_diff = int(same[0].argmin()) if not bool(same.all()) else -1
        stats = torch.stack([diff, scale, -agree, -same.mean(), torch.tensor(
            float(first_diff if first_diff >= 0 else a.gen_new), device=diff.device).neg()]).double()
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group)  # worst rank
        diff, scale, agree, gen_same, first = stats.tolist()
        return {"logits_max_abs_diff": diff, "logits_max_abs": scale, "argmax_agree": -agree,
                "generate_tokens_equal_share": -gen_same,
                "generate_first_difference": None if -first >= a.gen_new else int(-first),
                "generate_all_equal": -gen_same == 1.0}


def balance(load: np.ndarray, world: int) -> dict:  # load [L, P] all ranks
    L, P = load.shape
    gpu = load.reshape(L, world, P // world).sum(-1)  # [L, W]
    per_layer = balancedness_of_gpu_loads(gpu)
    return {"balancedness": float(per_layer.mean()), "balancedness_min_layer": float(per_layer.min()),
            "gpu_share_max": float((gpu.max(-1) / np.maximum(gpu.sum(-1), 1)).mean())}


def skew(load: np.ndarray, physical_to_logical: np.ndarray, N: int, top_k: int,
         world: int) -> dict:
    """How skewed the workload's routing is, from the logical load per expert [L, N];
    and the balancedness the contiguous placement without redundant slots (expert e on
    rank e // (N / W), transformers' EP layout) would have had on the same load."""
    L = load.shape[0]
    logical = np.zeros((L, N))
    np.add.at(logical, (np.arange(L)[:, None], physical_to_logical), load)
    share = logical / np.maximum(logical.sum(-1, keepdims=True), 1)
    top = np.sort(share, -1)[:, ::-1]
    out = {"expert_max_over_mean": float((logical.max(-1) / np.maximum(logical.mean(-1), 1e-9)).mean()),
           f"top{top_k}_experts_share": float(top[:, :top_k].sum(-1).mean()),
           "experts_unused_per_layer": float((logical == 0).sum(-1).mean())}
    if N % world == 0:
        contiguous = logical.reshape(L, world, N // world).sum(-1)  # [L, W]
        out["balancedness_contiguous_no_redundancy"] = float(balancedness_of_gpu_loads(contiguous).mean())
    out["logical"] = logical
    return out


def what_if(logical: np.ndarray, per_rank: int, worlds=(2, 4, 8)) -> dict:
    """Computed, not run: on this measured logical load [L, N], the balancedness of the
    start-up placement and of the placement the planner makes (in-sample: planned and
    scored on the same load) for other GPU counts, `per_rank` redundant slots per GPU."""
    from eplb.core.placement import Placement
    from eplb.core.planning import plan

    L, N = logical.shape
    out = {}
    for m in worlds:
        P = N + per_rank * m
        if P % m:
            continue
        start = Placement.initial(L, N, P, m)
        planned = plan(logical, m, P, 1, 1, "default", previous=start,
                       move_tolerance=EplbConfig.move_tolerance)
        out[str(m)] = {"static": float(start.balancedness(logical).mean()),
                       "planned": float(planned.balancedness(logical).mean())}
    return out


# ---- the modes --------------------------------------------------------------------------
def run_ep(b: Bench, ref, results: dict, progress) -> None:
    from moe.hf import expert_parallel

    a, W = b.a, b.world
    R = a.redundant_per_rank * W
    ep = expert_parallel(copy.deepcopy(ref), R, b.group)
    cfg = EplbConfig(num_redundant_experts=R, window_size=a.warmup + a.reps, rebalance_interval=0,
                     control_interval=0, min_gain=a.min_gain)
    runtime = EplbRuntime(ep, cfg, group=b.group)
    progress("EP model built")
    try:
        def forward(ids):
            ep(input_ids=ids, logits_to_keep=1)

        ep.set_record_load(False)
        chk = b.check(ep, ref, shared=False)
        ep.set_record_load(True)
        static = b.timed(forward, False, after=runtime.step, load=ep.expert_load_view)
        p2l = runtime.placement.physical_to_logical.copy()
        ep.set_record_load(False)
        static["decode"] = b.decode(ep, shared=False)
        ep.set_record_load(True)
        load_static = static.pop("load")
        static.update(check=chk, **balance(load_static, W))
        static["workload_skew"] = skew(load_static, p2l, a.experts, a.top_k, W)
        static["what_if_gpus"] = what_if(static["workload_skew"].pop("logical"),
                                         a.redundant_per_rank)
        results["ep-static"] = static
        progress("ep-static done")

        t0 = time.perf_counter()
        event = runtime.rebalance()
        rebalance_s = time.perf_counter() - t0
        ev = event.summary() if event is not None else None
        progress(f"rebalance: {event.describe() if event is not None else 'none'}")
        ep.set_record_load(False)
        chk = b.check(ep, ref, shared=False)
        ep.set_record_load(True)
        eplb = b.timed(forward, False, after=runtime.step, load=ep.expert_load_view)
        ep.set_record_load(False)
        eplb["decode"] = b.decode(ep, shared=False)
        eplb.update(check=chk, **balance(eplb.pop("load"), W))
        eplb["rebalance"] = {"event": ev, "wall_s": rebalance_s,
                             "replicas_max": int(runtime.placement.replica_count().max())}
        results["ep-eplb"] = eplb
        results["_ep"] = {"R": R, "P": ep.num_physical_experts, "S": ep.num_local_physical_experts}
        progress("ep-eplb done")
    finally:
        runtime.close()
        del runtime, ep
        if b.device.type == "cuda":
            torch.cuda.empty_cache()


def load_hf_ep(b: Bench, mode: str, ref):
    """The original weights loaded with transformers' own EP (`distributed_config`)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    W = b.world
    dc = (DistributedConfig(tp_size=W, ep_size=W) if mode == "tp"
          else DistributedConfig(fsdp_size=W, ep_size=W))
    kw = dict(distributed_config=dc, dtype=ref.dtype)
    try:  # the weights in memory, no checkpoint
        model = type(ref).from_pretrained(None, config=copy.deepcopy(ref.config),
                                          state_dict=ref.state_dict(), **kw)
        how = "state_dict"
    except Exception as e:  # noqa: BLE001 - fall back to a checkpoint on disk
        first = f"{type(e).__name__}: {e}"
        path = os.path.join(tempfile.gettempdir(), f"hf_throughput_ckpt_{os.getpid() if W == 1 else 'shared'}")
        if b.rank == 0:
            ref.save_pretrained(path)
        dist.barrier(group=b.group)
        model = type(ref).from_pretrained(path, **kw)
        how = f"checkpoint {path} (state_dict failed: {first[:300]})"
    return model.eval(), how


def run_hf(b: Bench, mode: str, ref, results: dict, progress) -> None:
    shared = mode == "tp"
    name = f"hf-{mode}"
    model = None
    try:
        model, how = load_hf_ep(b, mode, ref)
        progress(f"{name} loaded ({how.split(' (')[0]})")
        chk = b.check(model, ref, shared=shared)
        r = b.timed(lambda ids: model(input_ids=ids, logits_to_keep=1), shared)
        r["decode"] = b.decode(model, shared=shared)
        r.update(check=chk, loaded_from=how)
        results[name] = r
        progress(f"{name} done")
    except Exception as e:  # noqa: BLE001 - reported in the results
        import traceback

        results[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                         "traceback": traceback.format_exc()[-3000:]}
        progress(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}")
    finally:
        del model
        if b.device.type == "cuda":
            torch.cuda.empty_cache()


def worker(a: argparse.Namespace) -> int:
    import transformers

    rank = dist.get_rank()
    device = (torch.device("cpu") if a.device == "cpu"
              else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    dtype = getattr(torch, a.dtype)
    t_start = time.perf_counter()

    def progress(what: str) -> None:
        if rank == 0:
            print(f"hf_throughput: {what} ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr,
                  flush=True)

    b = Bench(a, device)
    config = model_config(a)
    ref = build_model(config, a.seed, device, dtype)
    spread = check_same_on_ranks(ref, b.group)
    params = sum(p.numel() for p in ref.parameters())
    progress(f"model built: {params / 1e9:.2f} B parameters, cross-rank spread {spread}")
    results: dict = {}
    r = b.timed(lambda ids: ref(input_ids=ids, logits_to_keep=1), False)
    r["decode"] = b.decode(ref, shared=False)
    results["original"] = r
    progress("original done")
    run_ep(b, ref, results, progress)
    for mode in a.hf_ep:
        if b.world < 2:
            results[f"hf-{mode}"] = {"skipped": "transformers EP needs W > 1 (ep_size = W)"}
            continue
        run_hf(b, mode, ref, results, progress)
    if rank == 0:
        record = {"benchmark": "hf_throughput", "date": datetime.date.today().isoformat(),
                  "args": vars(a), "world": b.world,
                  "device": "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "experts_implementation": getattr(ref.config, "_experts_implementation", None),
                  "model_dtype": str(ref.dtype), "parameters": params,
                  "cross_rank_weight_spread": spread,
                  "seconds_total": time.perf_counter() - t_start, "results": results}
        report(record)
        print("HF_JSON " + json.dumps(record, default=_json_default))
        if a.json:
            Path(a.json).write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
    return 0


def _json_default(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return str(o)


def report(rec: dict) -> None:
    a = rec["args"]
    res = rec["results"]
    ep = res.get("_ep", {})
    print(f"hf_throughput: {rec['world']} rank(s) on {rec['device']}, torch {rec['torch']}, "
          f"transformers {rec['transformers']} (experts: {rec['experts_implementation']}); "
          f"qwen3_moe {a['layers']} layers, H={a['hidden']}, N={a['experts']} top-{a['top_k']}, "
          f"I={a['intermediate']}, heads {a['heads']}/{a['kv_heads']}x{a['head_dim']}, "
          f"vocab {a['vocab']}, {rec['model_dtype']}, {rec['parameters'] / 1e9:.2f} B parameters; "
          f"R={ep.get('R')} redundant (P={ep.get('P')}, S={ep.get('S')}); prefill "
          f"{a['batch']}x{a['seq']} tokens/rank, Zipf a={a['zipf']}; {a['warmup']} warm-up + "
          f"{a['reps']} timed reps; total {rec['seconds_total']:.1f} s")
    sk = res.get("ep-static", {}).get("workload_skew")
    if sk:
        print("workload skew (static timed steps, mean over layers): " +
              ", ".join(f"{k} {v:.3f}" for k, v in sk.items()))
    wi = res.get("ep-static", {}).get("what_if_gpus")
    if wi:
        print("computed, not run: balancedness on this measured load, start-up placement -> "
              "planner's placement (in-sample): " + "; ".join(
                  f"{m} GPUs {v['static']:.4f} -> {v['planned']:.4f}" for m, v in wi.items()))
    head = (f"{'mode':<10} {'tokens/s':>12} {'vs orig':>8} {'ms med':>9} {'balanced':>9} "
            f"{'dec tok/s':>10} {'logit maxdiff':>13} {'argmax':>7} {'gen equal':>9}")
    print(head)
    print("-" * len(head))
    base = res.get("original", {}).get("tokens_per_s")
    for mode, r in res.items():
        if mode.startswith("_"):
            continue
        if "tokens_per_s" not in r:
            print(f"{mode:<10} {r.get('error') or r.get('skipped')}")
            continue
        c = r.get("check") or {}
        d = r.get("decode") or {}
        print(f"{mode:<10} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s'] / base:>8.3f} "
              f"{r['ms_median']:>9.2f} {r.get('balancedness', float('nan')):>9.4f} "
              f"{d.get('new_tokens_per_s', float('nan')):>10,.0f} "
              f"{c.get('logits_max_abs_diff', float('nan')):>13.4g} "
              f"{c.get('argmax_agree', float('nan')):>7.4f} "
              f"{c.get('generate_tokens_equal_share', float('nan')):>9.3f}")
    ev = res.get("ep-eplb", {}).get("rebalance", {}).get("event")
    if ev:
        print(f"rebalance: {ev['outcome']}, predicted balancedness {ev['balancedness_before']:.4f} -> "
              f"{ev['balancedness_after']:.4f}, {ev.get('experts_moved')} experts moved, "
              f"{res['ep-eplb']['rebalance']['wall_s'] * 1e3:.1f} ms")


# ---- launch -----------------------------------------------------------------------------
def main_rank(argv: list[str] | None) -> int:
    a = parse_args(argv)
    if a.watchdog > 0:
        import faulthandler

        faulthandler.dump_traceback_later(a.watchdog, exit=True)
    if a.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if a.device == "cpu" else "nccl")
    try:
        return worker(a)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        return main_rank(argv)
    a = parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < a.nproc:
        raise SystemExit(f"hf_throughput: needs {a.nproc} GPUs, {torch.cuda.device_count()} visible")
    if a.nproc == 1:  # in this process, as rank 0 of 1
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        return main_rank(argv)
    # one process per rank with torchrun's variables, as `eplb demo --nproc` starts them
    return launch_command([sys.executable, str(Path(__file__).resolve()), *argv], a.nproc)


if __name__ == "__main__":
    sys.exit(main())
