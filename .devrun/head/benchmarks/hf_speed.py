"""What `moe.hf.expert_parallel` costs on one GPU (W = 1): a transformers Qwen3-MoE model
(Qwen3-30B-A3B layer shapes, random weights, `--layers` of 48) against the same model
wrapped, side by side, interleaved round by round so a drift of the machine hits both.

    python benchmarks/hf_speed.py --json $OUT/speed.json            # one H200, bf16
    python benchmarks/hf_speed.py --device cpu --rounds 1           # tiny, smoke

Per round (the two models alternate which goes first):
  prefill  `--batch` x `--seq` tokens, `logits_to_keep=1`, median of `--reps` after
           `--warmup`; the wrapped model also runs `runtime.step()` after each forward
  decode   eager `generate()` of `--decode-new` greedy tokens after a `--decode-prompt`
           prompt, batch `--batch`, median of `--decode-reps`; the two models alternate
           call by call (a host-bound decode drifts with the host over seconds)
  graphs   (cuda, unless --no-graphs) the same decode with transformers' static cache,
           which compiles the decode step (torch.compile, CUDA graphs)
The figure of each kind is the median over rounds of (wrapped / original) tokens/s.

Checks, printed and in the JSON: logits of a `--check-batch` x `--seq` batch (max abs
difference and bitwise equality), greedy tokens equal (eager and compiled), host syncs
of one wrapped decode forward (CUDA sync debug mode), and, with CUDA graphs: a placement
change applied through the runtime (weights and maps rewritten in place) between two
compiled decodes must leave the tokens the original's, cause no recompilation, and the
load recorded inside the graph must follow the new maps.
`--profile`: the 12 CUDA ops that take the most time in one prefill forward of each.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_throughput import CPU_DEFAULTS, GPU_DEFAULTS, Workload, build_model, model_config  # noqa: E402

from eplb.core.config import EplbConfig  # noqa: E402
from eplb.core.placement import Placement  # noqa: E402
from eplb.ops.launch import free_port  # noqa: E402
from eplb.runtime import EplbRuntime  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--redundant", type=int, default=2, help="redundant slots R (default 2)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--decode-reps", type=int, default=None)
    p.add_argument("--no-graphs", action="store_true", help="skip the compiled decode")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    base = dict(CPU_DEFAULTS if a.device == "cpu" else GPU_DEFAULTS)
    for k in ("layers", "reps", "decode_reps"):
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    base.update(zipf=1.0, seed=0, dtype=base["dtype"])
    a.m = argparse.Namespace(**base)
    if a.rounds < 1:
        raise SystemExit("hf_speed: --rounds must be >= 1")
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_ms(model, batches, warmup: int, after=None) -> list[float]:
    """Wall ms of each forward after `warmup` (with `after()` inside the timing)."""
    out = []
    dev = batches[0].device
    for i, ids in enumerate(batches):
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
        if after is not None:
            after()
        sync(dev)
        if i >= warmup:
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def generate(model, prompt, new: int, static: bool):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
              attention_mask=torch.ones_like(prompt))
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(prompt, **kw)


def decode_ms(model, prompt, new: int, reps: int, static: bool) -> list[float]:
    """Wall ms of `reps` generate() calls after one untimed."""
    out = []
    for i in range(reps + 1):
        sync(prompt.device)
        t0 = time.perf_counter()
        generate(model, prompt, new, static)
        sync(prompt.device)
        if i:
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def paired_decode_ms(models, prompt, new: int, reps: int, static: bool,
                     flip: bool) -> dict[str, list[float]]:
    """Wall ms of `reps` generate() calls of each of `models` ({name: model}, after one
    untimed each), the models alternating call by call (order reversed every rep, and
    by `flip`), so that the host's drift over seconds, which dominates a host-bound
    decode, hits both alike; garbage is collected before each timed call."""
    names = list(models)
    for name in names:
        generate(models[name], prompt, new, static)
    out = {name: [] for name in names}
    for i in range(reps):
        for name in (names if (i % 2 == 0) != flip else names[::-1]):
            gc.collect()
            sync(prompt.device)
            t0 = time.perf_counter()
            generate(models[name], prompt, new, static)
            sync(prompt.device)
            out[name].append(1e3 * (time.perf_counter() - t0))
    return out


def host_syncs(fn) -> int:
    """Host syncs `fn()` makes on CUDA (sync debug mode "warn" counts them), -1 on CPU."""
    if not torch.cuda.is_available():
        return -1
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_top(model, ids, after=None, rows: int = 25) -> str:
    """The `rows` ops with the most self device time (CPU time on the CPU) of one
    forward of `ids`, and the op count."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
        sync(ids.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
        with profile(activities=acts) as prof:
            model(input_ids=ids, logits_to_keep=1)
            if after is not None:
                after()
            sync(ids.device)
    avg = prof.key_averages()
    calls = sum(e.count for e in avg if e.key.startswith("aten::"))
    key = "self_cuda_time_total" if ids.is_cuda else "self_cpu_time_total"
    return f"aten calls {calls}\n" + avg.table(sort_by=key, row_limit=rows)


def step_ms(model, ids, n: int = 50) -> float:
    """Median wall ms of one forward of `ids` (no cache), over `n` after 5 warm-ups."""
    out = []
    with torch.no_grad():
        for i in range(n + 5):
            sync(ids.device)
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            sync(ids.device)
            out.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(out[5:]))


def moved_placement(runtime, load) -> Placement:
    """The start-up placement with its redundant slots (the last R) re-pointed at the R
    most loaded experts of each layer (load [L, P] recorded on the start-up placement):
    a change that moves weights even on one GPU."""
    old = runtime.placement
    p2l = old.physical_to_logical.copy()  # [L, P]
    L, P = p2l.shape
    N = old.num_logical_experts
    logical = np.zeros((L, N))
    np.add.at(logical, (np.arange(L)[:, None], p2l), load)
    hot = np.argsort(-logical, axis=1)[:, :P - N]  # [L, R]
    p2l[:, N:] = hot
    return Placement(p2l, N, old.num_gpus)


def main(argv=None) -> int:
    a = parse_args(argv)
    m = a.m
    import transformers

    from moe.hf import expert_parallel

    device = torch.device(a.device)
    dtype = getattr(torch, m.dtype)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    res = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "transformers": transformers.__version__, "args": vars(m) | {"rounds": a.rounds,
                                                                         "R": a.redundant},
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    print(f"hf_speed: {res['device']}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {m.layers} layers, bf16={dtype == torch.bfloat16}",
          flush=True)
    ref = build_model(model_config(m), m.seed, device, dtype)
    ep = expert_parallel(copy.deepcopy(ref), a.redundant)
    runtime = EplbRuntime(ep, EplbConfig(num_redundant_experts=a.redundant, rebalance_interval=0,
                                         control_interval=0))
    work = Workload(m.vocab, 1.0, m.seed, device)
    try:
        # ---- checks ----
        ids = work.batch(0, 90_000, m.check_batch, m.seq)
        with torch.no_grad():
            got, want = ep(input_ids=ids).logits, ref(input_ids=ids).logits
        prompt = work.batch(0, 95_000, 1, 32)
        res["check"] = {"logits_max_abs_diff": float((got.float() - want.float()).abs().max()),
                        "logits_bitwise_equal": bool(torch.equal(got, want)),
                        "generate_equal": bool(torch.equal(generate(ep, prompt, m.gen_new, False),
                                                           generate(ref, prompt, m.gen_new, False)))}
        del got, want
        step_ids = work.batch(0, 96_000, m.batch, 1)
        with torch.no_grad():
            ep(input_ids=step_ids)
            res["check"]["host_syncs_one_decode_forward"] = {
                "original": host_syncs(lambda: ref(input_ids=step_ids)),
                "wrapped": host_syncs(lambda: ep(input_ids=step_ids))}
        print("check:", json.dumps(res["check"]), flush=True)

        # ---- interleaved timing ----
        batches = [work.batch(0, i, m.batch, m.seq) for i in range(m.warmup + m.reps)]
        dprompt = work.batch(0, 50_000, m.batch, m.decode_prompt)
        kinds = ["prefill", "decode"]
        rounds = []
        for r in range(a.rounds):
            one = {}
            order = [("original", ref, None), ("wrapped", ep, runtime.step)]
            for name, model, after in (order if r % 2 == 0 else order[::-1]):
                ms = prefill_ms(model, batches, m.warmup, after)
                one[name] = {"prefill_tok_s": m.batch * m.seq / (np.median(ms) / 1e3),
                             "prefill_ms": ms}
            dms = paired_decode_ms({"original": ref, "wrapped": ep}, dprompt, m.decode_new,
                                   m.decode_reps, False, flip=r % 2 == 1)
            for name, ms in dms.items():
                one[name] |= {"decode_tok_s": m.batch * m.decode_new / (np.median(ms) / 1e3),
                              "decode_ms": ms}
            for k in kinds:
                one[f"{k}_ratio"] = one["wrapped"][f"{k}_tok_s"] / one["original"][f"{k}_tok_s"]
            rounds.append(one)
            print(f"round {r + 1}: prefill {one['original']['prefill_tok_s']:,.0f} vs "
                  f"{one['wrapped']['prefill_tok_s']:,.0f} tok/s (x{one['prefill_ratio']:.3f}); "
                  f"decode {one['original']['decode_tok_s']:,.1f} vs "
                  f"{one['wrapped']['decode_tok_s']:,.1f} tok/s (x{one['decode_ratio']:.3f})",
                  flush=True)
        res["rounds"] = rounds
        res["median_ratio"] = {k: float(np.median([o[f"{k}_ratio"] for o in rounds])) for k in kinds}

        if a.profile:
            ids = batches[0]
            res["profile"] = {"prefill original": profile_top(ref, ids),
                              "prefill wrapped": profile_top(ep, ids, runtime.step),
                              "decode-size original": profile_top(ref, step_ids),
                              "decode-size wrapped": profile_top(ep, step_ids)}
            for k, v in res["profile"].items():
                print(f"--- profile, one forward: {k}\n{v}", flush=True)
            ep.set_record_load(False)
            unrecorded = step_ms(ep, step_ids)
            ep.set_record_load(True)
            res["decode_size_forward_ms"] = {"original": step_ms(ref, step_ids),
                                             "wrapped": step_ms(ep, step_ids),
                                             "wrapped, record_load off": unrecorded}
            print("one decode-size forward (ms):", json.dumps(res["decode_size_forward_ms"]),
                  flush=True)

        if device.type == "cuda" and not a.no_graphs:
            res["graphs"] = graphs(a, m, ref, ep, runtime, work, dprompt)
        print("median ratios (wrapped / original):", json.dumps(res["median_ratio"]), flush=True)
    finally:
        runtime.close()
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        dist.destroy_process_group()
    return 0


def graphs(a, m, ref, ep, runtime, work, dprompt) -> dict:
    """Compiled decode (static cache: transformers compiles the decode step with CUDA
    graphs): timing interleaved, then a placement change between two compiled decodes."""
    import torch._dynamo.utils as dyn

    out = {"rounds": []}
    prompt = work.batch(0, 97_000, 1, 32)
    want = generate(ref, prompt, m.gen_new, True)
    got = generate(ep, prompt, m.gen_new, True)
    out["generate_equal_before_change"] = bool(torch.equal(got, want))
    for r in range(a.rounds):
        order = [("original", ref), ("wrapped", ep)]
        one = {}
        for name, model in (order if r % 2 == 0 else order[::-1]):
            dms = decode_ms(model, dprompt, m.decode_new, m.decode_reps, True)
            one[name] = {"decode_tok_s": m.batch * m.decode_new / (np.median(dms) / 1e3),
                         "decode_ms": dms}
        one["ratio"] = one["wrapped"]["decode_tok_s"] / one["original"]["decode_tok_s"]
        out["rounds"].append(one)
        print(f"graphs round {r + 1}: decode {one['original']['decode_tok_s']:,.1f} vs "
              f"{one['wrapped']['decode_tok_s']:,.1f} tok/s (x{one['ratio']:.3f})", flush=True)
    out["median_ratio"] = float(np.median([o["ratio"] for o in out["rounds"]]))

    # a placement change between compiled decodes: weights and maps rewritten in place
    ep.expert_load_view.zero_()
    generate(ep, prompt, m.gen_new, True)
    load = ep.expert_load_view.cpu().numpy().copy()  # [L, P]
    new = moved_placement(runtime, load)
    frames = dict(dyn.counters["stats"])
    start = runtime.placement.physical_to_logical.copy()  # [L, P]
    event = runtime.apply_placement(new)
    ep.expert_load_view.zero_()
    got = generate(ep, prompt, m.gen_new, True)
    compiled = ep.expert_load_view.cpu().numpy().copy()  # [L, P] recorded inside the graphs
    ep.expert_load_view.zero_()
    generate(ep, prompt, m.gen_new, False)  # the same tokens, eager: the maps read anew
    eager = ep.expert_load_view.cpu().numpy()  # [L, P]
    out["change"] = {
        "event": event.describe() if event is not None else None,
        "slots_changed": int((new.physical_to_logical != start).sum()),
        "generate_equal_after_change": bool(torch.equal(got, want)),
        "dynamo_stats_before": frames, "dynamo_stats_after": dict(dyn.counters["stats"]),
        "recompiled": dict(dyn.counters["stats"]) != frames,
        # per-slot load recorded inside the CUDA graphs against the eager run on the new
        # maps: equal when the graphs read the maps in force, not those of the capture
        "load_compiled_vs_eager_l1": float(np.abs(compiled - eager).sum() / max(eager.sum(), 1)),
        "load_on_changed_slots": int(compiled[new.physical_to_logical != start].sum()),
    }
    print("graphs change:", json.dumps({k: v for k, v in out["change"].items()
                                        if not k.startswith("dynamo")}), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
