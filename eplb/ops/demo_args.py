"""The arguments of the demo job (`eplb demo`, `python -m eplb.ops.demo`) and their checks:
every impossible value is one ValueError naming its flag, raised by `eplb demo` before
any rank starts. Importing this needs no `moe` (the parser of `eplb` is built from it;
torch comes in with the `eplb` package).

`--model NAME` (a tiny transformers model, eplb.ops.demo_hf): HF_ARCHITECTURES lists the
architectures of moe.hf.configs, kept here so that the parser needs no import of moe
(tests/test_hf_demo.py checks they are the same).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from eplb.core.config import LAUNCH_MODES, TRANSPORTS, EplbConfig
from eplb.ops.settings_args import Setting, on_off


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments shared by `eplb demo` and `python -m eplb.ops.demo`."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo ranks; cuda: one rank per GPU on NCCL")
    p.add_argument("--steps", type=int, default=300, help="forward steps to run (default 300)")
    p.add_argument("--rebalance-interval", "--rebalance-every", action=Setting, type=int, default=50,
                   help="rebalance every K steps (default 50; 0 = never)")
    p.add_argument("--window-size", "--window", action=Setting, type=int, default=None,
                   help="steps of load each plan sees (default: the rebalance interval)")
    p.add_argument("--async-rebalance", "--async", action=Setting, nargs=0, const=True,
                   default=EplbConfig.async_rebalance,
                   help="rebalance in the background while serving")
    p.add_argument("--verify", action="store_true",
                   help="after every rebalance check outputs against the dense reference "
                        "and every slot bitwise against its expert's weights (with --model: "
                        "see --model)")
    p.add_argument("--json", metavar="FILE", help="write per-step records to FILE")
    p.add_argument("--trace", metavar="NAME|PATH",
                   help="replay a measured [T, L, N] trace ('esft' is packaged) instead of "
                        "the synthetic drifting workload")
    p.add_argument("--trace-window", type=int, default=8,
                   help="trace entries (sequences) summed per step, sliding by one (default 8)")
    p.add_argument("--layers", type=int, default=4, help="MoE layers (default 4)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per layer (default 32; 64 with --trace)")
    p.add_argument("--num-redundant-experts", "--redundant", action=Setting, type=int, default=None,
                   help="redundant slots per layer (default: one per rank, rounded up so that "
                        "experts + redundant divides by the number of ranks)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default 4; 6 with a trace)")
    p.add_argument("--groups", type=int, default=1, help="expert groups (group-limited top-k)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--intermediate", type=int, default=64, help="expert intermediate size (default 64)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank per step (default 256)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--policy", default="default", help="planner (default: default)")
    p.add_argument("--min-gain", type=float, default=EplbConfig.min_gain, metavar="G",
                   help="skip a rebalance whose plan raises the predicted balancedness by less "
                        f"than G (default {EplbConfig.min_gain}; 0 = any change moves)")
    p.add_argument("--load-decay", type=float, default=EplbConfig.load_decay, metavar="D",
                   help="weight of a step k steps older than the newest in the window: D**k "
                        f"(default {EplbConfig.load_decay:g} = plain sum)")
    p.add_argument("--move-tolerance", type=float, default=EplbConfig.move_tolerance, metavar="T",
                   help="extra predicted imbalance the planner accepts to keep experts in place "
                        f"(default {EplbConfig.move_tolerance:g})")
    p.add_argument("--weighted-replicas", action="store_true",
                   help="let the planner give replicas unequal shares of their expert's tokens")
    p.add_argument("--shift-threshold", type=float, default=EplbConfig.shift_threshold, metavar="G",
                   help="shift-aware rebalancing: a drop of the placement in force below its plan's "
                        "predicted balancedness by more than G beyond the noise re-plans with move "
                        f"tolerance 0 and may rebalance early (default {EplbConfig.shift_threshold:g}; 0 = off)")
    p.add_argument("--steady-windows", type=int, default=EplbConfig.steady_windows, metavar="K",
                   help="with shift detection on: a plan on a steady load adds up to K earlier windows "
                        f"to its own (default {EplbConfig.steady_windows}; 0 = the window alone)")
    p.add_argument("--drift-trend", type=on_off, default=EplbConfig.drift_trend, metavar="on|off",
                   help="with shift detection on: plans on a drifting load follow the window's trend "
                        f"where it predicted well (default {'on' if EplbConfig.drift_trend else 'off'})")
    p.add_argument("--control-interval", type=int, default=EplbConfig.control_interval, metavar="C",
                   help="steps between the ranks' checks for requested rebalances and load shifts "
                        f"(default {EplbConfig.control_interval}; 0 = never)")
    p.add_argument("--verify-transfers", action="store_true",
                   help="checksum every moved slot against its expert before committing a layer")
    p.add_argument("--transport", choices=TRANSPORTS, default=EplbConfig.transport,
                   help=f"how expert weights travel between ranks (default {EplbConfig.transport})")
    p.add_argument("--exchange-launch", choices=LAUNCH_MODES, default=EplbConfig.exchange_launch,
                   help="with --async-rebalance: where weight exchanges are launched "
                        f"(default {EplbConfig.exchange_launch})")
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the synthetic load")
    p.add_argument("--drift-period", type=int, default=200,
                   help="steps per regime of the synthetic load (default 200)")
    p.add_argument("--seed", type=int, default=0)
    h = p.add_argument_group("a transformers model instead of the reference model (needs "
                             "pip install -e '.[hf]')")
    h.add_argument("--model", metavar="NAME", default=None,
                   help="run a tiny random transformers MoE model of architecture NAME (one of "
                        f"{', '.join(HF_ARCHITECTURES)}) made expert-parallel by moe.hf; its "
                        "sizes are --layers --experts --top-k --hidden --intermediate; the "
                        "load is token ids drawn from a drifting Zipf distribution over the "
                        "vocabulary (--skew, --drift-period); --verify compares the logits with "
                        f"the unmodified model at every step (max |diff| <= {HF_FP32_TOLERANCE:g} in "
                        f"float32; <= {HF_BF16_TOLERANCE:g} in bfloat16, which leaves room for the unmodified "
                        "model's own distance from its float32 logits, see benchmarks/README.md), "
                        "every slot bitwise after "
                        "each rebalance, and a greedy generate() of 8 tokens at the end (token for "
                        "token in float32; bfloat16 flips near-tie tokens of a random model, so "
                        "there they are only counted)")
    h.add_argument("--seq-len", type=int, default=32,
                   help="with --model: tokens per sequence; --tokens / --seq-len sequences per "
                        "rank per step (default 32)")
    m = p.add_argument_group("metrics and HTTP trigger (rank 0 serves them)")
    m.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics, /healthz, /placement, GET /load and POST "
                        "/rebalance on PORT (0 = any free port; the URL is printed)")
    m.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    m.add_argument("--metrics-interval", type=int, default=10, metavar="STEPS",
                   help="steps between load-gauge updates (one all-reduce each; default 10)")
    m.add_argument("--metrics-replicas", action="store_true",
                   help="also export eplb_expert_replicas{layer,expert} (L x N series)")
    m.add_argument("--metrics-per-layer", action="store_true",
                   help="also export eplb_gpu_layer_load_tokens{layer,gpu} (L x M series; the "
                        "dashboard's layer x GPU heatmap)")
    m.add_argument("--metrics-hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep serving SECONDS after the last step, so a scraper reads the final values")
    m.add_argument("--token-file", default=None, metavar="FILE",
                   help="bearer token for POST /rebalance (else $EPLB_TOKEN / $EPLB_TOKEN_FILE; "
                        "with none, POST /rebalance is refused with 403)")


def check_demo_arguments(a: argparse.Namespace) -> None:
    """Fill defaults and reject impossible values with a one-line ValueError naming the
    flag. Both `eplb demo` (before launching) and every rank (under plain torchrun) run it."""
    for name in ("steps", "layers", "hidden", "intermediate", "tokens", "groups", "trace_window",
                 "seq_len", "drift_period", "experts", "top_k", "window_size"):
        value = getattr(a, name)  # experts, top_k, window_size: None until defaulted below
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if not math.isfinite(a.skew) or a.skew < 0:
        raise ValueError(f"--skew: must be a finite number >= 0, got {a.skew:g}")
    if a.json is not None:  # else the run would fail only at its end, writing the records
        out = Path(a.json)
        if not out.resolve().parent.is_dir():
            raise ValueError(f"--json: directory does not exist: {out.parent}")
        if out.is_dir():
            raise ValueError(f"--json: {out} is a directory")
    if a.model is not None:
        check_model_arguments(a)
    if a.rebalance_interval < 0:
        raise ValueError(f"--rebalance-interval: must be >= 0 (0 = never), got {a.rebalance_interval}")
    if a.metrics_port is None:
        for flag, value in (("--token-file", a.token_file), ("--metrics-hold", a.metrics_hold),
                            ("--metrics-replicas", a.metrics_replicas),
                            ("--metrics-per-layer", a.metrics_per_layer)):
            if value:
                raise ValueError(f"{flag} needs --metrics-port")
    else:
        if not 0 <= a.metrics_port <= 65535:
            raise ValueError(f"--metrics-port: must be in 0..65535, got {a.metrics_port}")
        if a.metrics_interval < 1:
            raise ValueError(f"--metrics-interval: must be >= 1, got {a.metrics_interval}")
        if not 0 <= a.metrics_hold <= 86400:
            raise ValueError(f"--metrics-hold: must be in 0..86400 seconds, got {a.metrics_hold:g}")
        from eplb.ops.server import load_token

        load_token(token_file=a.token_file)  # unreadable or empty token file: one line, early
    if a.experts is None:
        a.experts = 64 if a.trace else 32
    if a.top_k is None:
        a.top_k = 6 if a.trace else 4
    if a.window_size is None:
        a.window_size = max(1, a.rebalance_interval)
    check_routing_arguments(a)


def topk_groups(groups: int) -> int:
    """Groups kept per token in the reference model's group-limited top-k: half of
    --groups (1 without groups)."""
    return max(1, groups // 2)


def check_routing_arguments(a: argparse.Namespace) -> None:
    """--experts, --top-k, --groups against each other, as moe.MoEArgs.validate checks
    them, but naming the flags."""
    N, K, G = a.experts, a.top_k, a.groups
    if K > N:
        raise ValueError(f"--top-k: {K} exceeds --experts ({N})")
    if N % G:
        raise ValueError(f"--groups: --experts ({N}) must be divisible by --groups ({G})")
    kept = topk_groups(G) * (N // G)
    if kept < K:
        raise ValueError(f"--groups: each token keeps {topk_groups(G)} of {G} groups, {kept} "
                         f"experts, fewer than --top-k ({K}); use fewer groups or a smaller --top-k")


# `eplb demo --model NAME`: the architectures of moe.hf.configs (kept here so that the
# parser needs no import of moe; tests/test_hf_demo.py checks they are the same)
HF_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
# --verify with --model: logits max |diff|. In bfloat16 the unmodified model itself is this
# far from its float32 self (measured per architecture by benchmarks/diag/hf_bf16_gap.py,
# figures in benchmarks/README.md, "Demo constants")
HF_FP32_TOLERANCE, HF_BF16_TOLERANCE = 1e-5, 0.25
HF_INSTALL = "pip install -e '.[hf]'"


def check_model_arguments(a: argparse.Namespace) -> None:
    """--model: a known architecture, transformers 5 importable, options that apply."""
    if a.model not in HF_ARCHITECTURES:
        raise ValueError(f"--model: {a.model!r} is not one of {', '.join(HF_ARCHITECTURES)}")
    if a.trace:
        raise ValueError("--trace replays expert loads into the reference model's router; "
                         "with --model the load comes from the token ids (--skew, --drift-period)")
    if a.groups != 1:
        raise ValueError("--groups: the transformers model routes as its config says "
                         "(deepseek_v3: 4 groups when --experts is a multiple of 4); drop --groups")
    if a.device != "cpu":
        raise ValueError("--model runs on --device cpu only")
    if a.hidden % 4:
        raise ValueError(f"--hidden: must be a multiple of 4 (attention heads) with --model, got {a.hidden}")
    if a.tokens % a.seq_len:
        raise ValueError(f"--tokens {a.tokens} is not a multiple of --seq-len {a.seq_len}")
    if a.seq_len > 500:  # the tiny configs have 512 positions; --verify generates 8 more
        raise ValueError(f"--seq-len: at most 500 with --model, got {a.seq_len}")
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"--model needs transformers, which is not installed: {HF_INSTALL}")
    try:
        major = int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        major = None
    if major is not None and major < 5:
        raise ValueError(f"--model needs transformers >= 5, found {version('transformers')}: "
                         f"{HF_INSTALL}")
