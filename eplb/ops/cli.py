"""`eplb` command line: `eplb demo` (launch the demo job), `eplb plan` (plan a placement) and
`eplb simulate` (replay a load trace under policies, offline); `eplb trigger` (ask a running
job's server to rebalance) and `eplb record` (save its recorded load, GET /load).

Every bad input exits with status 2 and one line on stderr naming the problem. A flag of
an EplbConfig setting is the field name with dashes (`Setting`; old spellings still parse,
with a deprecation warning).

Longer than 400 lines because it holds every subcommand's parser and the argument checks
that turn each bad input into one line naming its flag; the work itself lives in eplb.core,
eplb.ops.client and eplb.ops.demo.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path

from eplb.ops.settings_args import _ALIASES_IN_ERROR, Setting, SettingsParser, canonical_argv


class _Parser(SettingsParser):
    """argparse that reports usage errors as one line, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        message = _ALIASES_IN_ERROR.sub(r"argument \1:", message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(name: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return conv


def _positive_list(name: str):
    """'8' or '8,16,32' -> [8] or [8, 16, 32], each >= 1."""
    one = _positive(name)

    def conv(s: str) -> list[int]:
        parts = [x for x in s.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{name} must be an integer or a comma-separated list, got {s!r}")
        return [one(x.strip()) for x in parts]
    return conv


_DEMO_LIMITS = {"steps": 10**7, "layers": 1024, "experts": 4096, "num_redundant_experts": 4096, "hidden": 1 << 16,
                "intermediate": 1 << 16, "tokens": 1 << 20, "trace_window": 10**6, "nproc": 1024}


def cmd_demo(a: argparse.Namespace) -> int:
    import torch

    from eplb.ops.demo import build_parser as demo_parser
    from eplb.ops.demo import check_demo_arguments, setup
    from eplb.ops.launch import launch

    for name, limit in _DEMO_LIMITS.items():  # sizes the ranks would allocate: refuse early
        value = getattr(a, name, None)
        if value is not None and value > limit:
            raise ValueError(f"--{name.replace('_', '-')}: {value} is more than the supported {limit}")
    if a.drift_period < 1:
        raise ValueError(f"--drift-period: must be >= 1, got {a.drift_period}")
    if not math.isfinite(a.skew) or a.skew < 0:
        raise ValueError(f"--skew: must be a finite number >= 0, got {a.skew:g}")
    check_demo_arguments(a)
    if a.device == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError("--device cuda: no CUDA device is visible")
        nproc = a.nproc or n
        if nproc > n:
            raise ValueError(f"--nproc {nproc}: only {n} CUDA devices are visible")
    else:
        nproc = a.nproc or 4
    setup(a, nproc)  # bad sizes or trace: one line here, before any rank starts
    # the ranks get the canonical flags: the deprecated spellings were warned about here
    forwarded = canonical_argv(demo_parser(), a.argv[a.argv.index("demo") + 1:])
    # strip --nproc (the launcher's, not the rank's), also as argparse's abbreviations --np, ...
    out, skip = [], False
    for arg in forwarded:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if len(name) >= 3 and "--nproc".startswith(name):
            skip = "=" not in arg
            continue
        out.append(arg)
    return launch("eplb.ops.demo", out, nproc)


def cmd_plan(a: argparse.Namespace) -> int:
    from eplb.core.loadio import read_load
    from eplb.core.placement import Placement
    from eplb.core.planning import plan

    load = read_load(a.load)  # [L, N]
    previous = None
    if a.previous:
        previous = Placement.load(a.previous, num_logical_experts=load.shape[1], num_gpus=a.num_gpus)
    placement = plan(load, num_gpus=a.num_gpus, num_slots=a.num_slots, num_nodes=a.num_nodes,
                     num_groups=a.num_groups, policy=a.policy, previous=previous)
    out = Path(a.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out: directory does not exist: {out.parent}")
    if out.is_dir():
        raise ValueError(f"--out: {out} is a directory")
    d = placement.to_dict()
    d["replica_count"] = placement.replica_count().tolist()
    bal = placement.balancedness(load)  # [L]
    d["balancedness"] = bal.round(6).tolist()
    try:
        if out.suffix in (".npy", ".pt"):
            placement.save(out)
        else:
            out.write_text(json.dumps(d) + "\n")
    except OSError as e:
        raise ValueError(f"--out: cannot write {out} ({e.strerror or e.__class__.__name__})") from None
    print(f"planned {placement.num_layers} layers x {placement.num_slots} slots on {a.num_gpus} GPUs "
          f"({a.num_nodes} nodes, policy {a.policy}): balancedness {bal.mean():.4f} "
          f"(imbalance {1 / bal.mean():.4f}); wrote {out}")
    return 0


def cmd_trigger(a: argparse.Namespace) -> int:
    from eplb.ops.client import TriggerError, describe_status, trigger_rebalance, wait_for_rebalance
    from eplb.ops.server import load_token

    if a.wait is not None and not 0 <= a.wait <= 86400:
        raise ValueError(f"--wait must be between 0 and 86400 seconds, got {a.wait:g}")
    try:
        token = load_token(a.token, a.token_file)  # else $EPLB_TOKEN / $EPLB_TOKEN_FILE
        reply = trigger_rebalance(a.url, token)
        print(reply["id"], flush=True)
        if a.wait is None:
            return 0
        status = wait_for_rebalance(a.url, reply["id"], a.wait)
    except TriggerError as e:
        raise ValueError(str(e)) from None
    print(describe_status(status))
    return 0 if status.get("state") == "done" else 1


def _record_write(out: Path, snaps: dict, trace: bool) -> None:
    """Write one /load snapshot (`trace` False: the answer as JSON, or logical_count as an
    [L, N] .npy) or a trace (`snaps`: counts [T, L, N], steps, step, time, meta)."""
    import numpy as np

    try:
        if not trace:
            if out.suffix.lower() == ".npy":
                np.save(out, snaps["counts"])
            else:
                out.write_text(json.dumps(snaps["answer"]) + "\n")
        elif out.suffix.lower() == ".npy":
            np.save(out, snaps["counts"])
        elif out.suffix.lower() == ".npz":
            np.savez(out, counts=snaps["counts"], steps=np.asarray(snaps["steps"], np.int64),
                     step=np.asarray(snaps["step"], np.int64), time=np.asarray(snaps["time"]))
        else:
            out.write_text(json.dumps(dict(snaps["meta"], logical_count=snaps["counts"].tolist(),
                                           steps=snaps["steps"], step=snaps["step"],
                                           time=snaps["time"])) + "\n")
    except OSError as e:
        raise ValueError(f"--out: cannot write {out} ({e.strerror or e.__class__.__name__})") from None


def _record_counts(d: dict, key: str, url: str):
    """`d[key]` of a /load answer as a checked [L, N] array (int64 when all integral)."""
    import numpy as np

    from eplb.core.loadio import as_load

    if key not in d:
        raise ValueError(f"{url}: the answer has no {key} (an eplb older than the load export?)")
    arr = np.asarray(d[key]) if isinstance(d[key], list) else None
    if arr is None or arr.ndim != 2:
        raise ValueError(f"{url}: {key} is not an [L, N] array")
    load = as_load(arr, f"{url}: {key}")  # numeric, finite, non-negative: [L, N] float64
    return load.astype(np.int64) if np.array_equal(load, np.round(load)) else load


def cmd_record(a: argparse.Namespace) -> int:
    import numpy as np

    from eplb.core.loadio import MAX_LOAD_ELEMENTS
    from eplb.ops.client import TriggerError, fetch_load

    out = Path(a.out)
    trace = a.count is not None or a.every is not None
    if trace and (a.count is None or a.every is None):
        raise ValueError("--every and --count go together (K snapshots S seconds apart)")
    kinds = (".json", ".npy", ".npz") if trace else (".json", ".npy")
    if out.suffix.lower() not in kinds:
        raise ValueError(f"--out: {out.name} must end in {', '.join(kinds)}"
                         + ("" if trace else " (.npz with --every/--count)"))
    if not out.resolve().parent.is_dir():
        raise ValueError(f"--out: directory does not exist: {out.parent}")
    if out.is_dir():
        raise ValueError(f"--out: {out} is a directory")
    if not 0 < a.timeout <= 3600:
        raise ValueError(f"--timeout must be in (0, 3600] seconds, got {a.timeout:g}")
    if trace and not 0 < a.every <= 86400:
        raise ValueError(f"--every must be in (0, 86400] seconds, got {a.every:g}")
    if trace and a.count > 10**6:
        raise ValueError(f"--count: {a.count} is more than the supported {10**6}")

    def fetch() -> dict:
        try:
            return fetch_load(a.url, a.timeout)
        except TriggerError as e:
            raise ValueError(str(e)) from None

    first = fetch()
    if not trace:
        counts = _record_counts(first, "logical_count", a.url)  # [L, N]
        _record_write(out, {"answer": first, "counts": counts}, trace=False)
        L, N = counts.shape
        print(f"wrote {out}: {L} layers x {N} experts, the window of {first.get('steps')} steps "
              f"at step {first.get('step')}")
        return 0

    total = _record_counts(first, "total_logical_count", a.url)  # [L, N] since metrics attached
    if "total_steps" not in first:
        raise ValueError(f"{a.url}: the answer has no total_steps (an eplb older than the load export?)")
    L, N = total.shape
    if a.count * L * N > MAX_LOAD_ELEMENTS:
        raise ValueError(f"--count {a.count}: {a.count} x {L} x {N} counts are more than the "
                         f"supported {MAX_LOAD_ELEMENTS}")
    prev_steps, prev_step = int(first["total_steps"]), first.get("step")
    entries, steps, at_step, times = [], [], [], []
    meta = {"layers": L, "experts": N, "gpus": first.get("gpus"), "every": a.every, "url": a.url,
            "start_step": prev_step}
    print(f"eplb record: {a.url} at step {prev_step}; {a.count} snapshots every {a.every:g} s",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        for k in range(1, a.count + 1):
            time.sleep(max(0.0, t0 + k * a.every - time.monotonic()))
            d = fetch()
            now = _record_counts(d, "total_logical_count", a.url)
            n = int(d.get("total_steps", -1))
            if now.shape != (L, N):
                raise ValueError(f"{a.url}: the job changed between snapshots ({L} x {N} -> "
                                 f"{now.shape[0]} x {now.shape[1]} experts)")
            if n < prev_steps or (now < total).any():
                raise ValueError(f"{a.url}: the job restarted between snapshots (step "
                                 f"{prev_step} -> {d.get('step')}, counts went down)")
            entries.append(now - total)
            steps.append(n - prev_steps)
            at_step.append(int(d.get("step", -1)))
            times.append(float(d.get("time", 0.0)))
            note = "" if n > prev_steps else " (no metrics update since the last snapshot)"
            print(f"eplb record: {k}/{a.count} at step {d.get('step')}: {n - prev_steps} steps, "
                  f"{int(entries[-1].sum())} token-expert assignments{note}",
                  file=sys.stderr, flush=True)
            total, prev_steps, prev_step = now, n, d.get("step")
    except KeyboardInterrupt:
        if not entries:
            raise
        print(f"eplb record: interrupted after {len(entries)} of {a.count} snapshots", file=sys.stderr)
    counts = np.stack(entries)  # [T, L, N]
    _record_write(out, {"counts": counts, "steps": steps, "step": at_step, "time": times,
                        "meta": meta}, trace=True)
    print(f"wrote {out}: {len(entries)} snapshots {a.every:g} s apart ([T, L, N] = "
          f"[{len(entries)}, {L}, {N}]), steps {meta['start_step']}..{at_step[-1]} "
          f"({sum(steps)} steps)")
    return 0 if len(entries) == a.count else 130


def _float(name: str):
    def conv(s: str) -> float:
        try:
            return float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
    return conv


def cmd_simulate(a: argparse.Namespace) -> int:
    import importlib.util

    from eplb.ops.progress import ProgressBar
    from eplb.core.simulate import (aggregate_steps, format_table, plot_result, read_trace, rebalance_steps,
                               simulate)

    for opt, path in (("--json", a.json), ("--plot", a.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{opt}: directory does not exist: {Path(path).parent}")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'eplb[plot]' (or pip install matplotlib)")
    raw = read_trace(a.trace)  # [T, L, N]
    trace = aggregate_steps(raw, a.aggregate)  # [T // A, L, N]
    T, L, N = trace.shape
    dropped = raw.shape[0] - T * a.aggregate
    if a.cost:
        from eplb.ops.scale_report import run_cost
        return run_cost(a, trace, a.trace if a.aggregate == 1 else f"{a.trace} (aggregate {a.aggregate})")
    if len(a.num_gpus) != 1:
        raise ValueError("--num-gpus lists several EP sizes only with --cost")
    if a.num_slots is None:
        raise ValueError("--num-slots is required (without --cost)")
    a.num_gpus = a.num_gpus[0]
    start = a.start if a.start is not None else a.rebalance_interval
    n_plans = len(rebalance_steps(T, a.rebalance_interval, start)) * len(a.policy) * (1 if a.no_oracle else 2)
    bar = ProgressBar(n_plans, label="simulate") if n_plans >= 50 else None
    result = simulate(trace, a.num_gpus, a.num_slots, a.window_size, a.rebalance_interval,
                      policies=a.policy, num_nodes=a.num_nodes, num_groups=a.num_groups,
                      decay=a.load_decay, move_tolerance=a.move_tolerance,
                      weighted=a.weighted_replicas, min_gain=a.min_gain, shift_threshold=a.shift_threshold,
                      bytes_per_expert=a.bytes_per_expert, start=a.start, oracle=not a.no_oracle,
                      progress=bar.update if bar else None)
    if bar:
        bar.close()
    cfg = result.config
    steps_desc = (f"{raw.shape[0]} steps" if a.aggregate == 1 else
                  f"{raw.shape[0]} entries summed in groups of {a.aggregate} -> {T} steps"
                  + (f" (last {dropped} dropped)" if dropped else ""))
    print(f"eplb simulate: {a.trace}: {steps_desc}, {L} layers x {N} experts; {a.num_gpus} GPUs, "
          f"{a.num_slots} slots, {a.num_nodes} node(s), {a.num_groups} group(s); window {a.window_size}, "
          f"interval {a.rebalance_interval}, decay {a.load_decay:g}, move tolerance "
          f"{a.move_tolerance:g}, min gain {a.min_gain:g}, shift threshold {a.shift_threshold:g}"
          f"{', weighted' if a.weighted_replicas else ''}")
    print(f"{len(cfg['rebalance_steps'])} rebalances per policy; steps {cfg['start']}..{T - 1} scored")
    print(format_table(result))
    if a.json:
        d = result.to_dict()
        d["trace"] = {"source": a.trace, "entries": int(raw.shape[0]), "aggregate": a.aggregate,
                      "dropped": int(dropped)}
        Path(a.json).write_text(json.dumps(d) + "\n")
        print(f"wrote {a.json}")
    if a.plot:
        title = (f"{a.trace}: {steps_desc}\n{a.num_gpus} GPUs, {a.num_slots} slots, window {a.window_size}, "
                 f"interval {a.rebalance_interval}, decay {a.load_decay:g}")
        plot_result(result, a.plot, title=title,
                    step_label="step" if a.aggregate == 1 else f"step ({a.aggregate} trace entries each)")
        print(f"wrote {a.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eplb.core.config import EplbConfig

    from eplb.ops.demo import add_demo_arguments

    from eplb import __version__
    from eplb.core.policy import available_policies

    p = _Parser(prog="eplb", description="Expert-parallel load balancer for MoE models.")
    p.add_argument("--version", action="version", version=f"eplb {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="run the reference MoE model (or --model NAME, a tiny "
                                    "transformers model) under a skewed load with EPLB",
                       description="Launch N ranks (like torchrun) running the reference MoE model "
                                   "(or with --model NAME a tiny random transformers MoE model) "
                                   "under a skewed, drifting routing load, rebalanced on schedule.")
    d.add_argument("--nproc", type=_positive("--nproc"), default=None,
                   help="ranks to launch (default 4 on cpu, one per visible GPU on cuda)")
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)

    pl = sub.add_parser("plan", help="plan a placement from recorded expert load",
                        description="Plan a placement from a load file: .npy [L, N] or [T, L, N] "
                                    "(summed over T), or .json/.pt holding 'logical_count'.")
    pl.add_argument("load", help="load file (.npy, .json or .pt)")
    pl.add_argument("--num-gpus", type=_positive("--num-gpus"), required=True,
                    help="GPUs (EP ranks) the slots are spread over")
    pl.add_argument("--num-slots", type=_positive("--num-slots"), required=True,
                    help="physical slots per layer (N + redundant), divisible by --num-gpus")
    pl.add_argument("--num-nodes", type=_positive("--num-nodes"), default=1,
                    help="nodes the GPUs are on; the policy keeps expert groups inside a node "
                         "(default 1)")
    pl.add_argument("--num-groups", type=_positive("--num-groups"), default=1,
                    help="expert groups of group-limited routing, N divisible by it (default 1)")
    pl.add_argument("--policy", default="default",
                    help=f"planning policy, one of {', '.join(available_policies())} "
                         "(default: default)")
    pl.add_argument("--previous", metavar="FILE", help="current placement (keeps experts in place)")
    pl.add_argument("--out", required=True, metavar="FILE", help="output .json (or .npy/.pt)")
    pl.set_defaults(func=cmd_plan)

    tr = sub.add_parser(
        "trigger", help="ask a running job to rebalance now (POST /rebalance)",
        description="POST /rebalance to a job's eplb server (started on rank 0) and print the "
                    "request id; with --wait, poll until the rebalance is done or failed and print "
                    "the outcome. The token comes from --token, --token-file, $EPLB_TOKEN or "
                    "$EPLB_TOKEN_FILE. Exit status: 0 done (or requested), 1 the rebalance failed, "
                    "2 the request did not get through (unreachable, 401/403, timeout).")
    tr.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:9400")
    tok = tr.add_mutually_exclusive_group()
    tok.add_argument("--token", default=None,
                     help="bearer token (visible in the process list: prefer --token-file or $EPLB_TOKEN)")
    tok.add_argument("--token-file", default=None, metavar="FILE", help="file holding the bearer token")
    tr.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                    help="wait up to SECONDS for the rebalance to finish and print its outcome")
    tr.set_defaults(func=cmd_trigger)

    rc = sub.add_parser(
        "record", help="save a running job's recorded load (GET /load) to a file or a trace",
        description="Fetch GET /load from a job's eplb server (rank 0). Without --every: save "
                    "one snapshot, the planner's window as of the job's last metrics update "
                    "(.json: the server's answer, which `eplb plan` reads; .npy: logical_count "
                    "[L, N]). With --every S --count K: save a [T, L, N] trace of K entries, "
                    "entry k holding the tokens routed to each expert between snapshots k-1 "
                    "and k (S seconds apart; snapshot 0 is taken at start), for `eplb simulate` "
                    "(.npy or .npz; .npz and .json also hold the steps each entry covers). "
                    "Progress goes to stderr, one line per snapshot.")
    rc.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:9400")
    rc.add_argument("--out", required=True, metavar="FILE",
                    help="output .json or .npy (a trace: .npy, .npz or .json)")
    rc.add_argument("--every", type=_float("--every"), default=None, metavar="SECONDS",
                    help="seconds between snapshots of a trace (with --count)")
    rc.add_argument("--count", type=_positive("--count"), default=None, metavar="K",
                    help="entries of the trace (with --every; K + 1 requests, K x S seconds)")
    rc.add_argument("--timeout", type=_float("--timeout"), default=10.0, metavar="SECONDS",
                    help="seconds to wait for each answer (default 10)")
    rc.set_defaults(func=cmd_record)

    sm = sub.add_parser(
        "simulate", help="replay a [T, L, N] load trace under policies and score them out of sample",
        description="Replay a measured load trace offline: every --rebalance-interval steps each "
                    "policy plans on the last --window-size steps (older steps weighted "
                    "load_decay**age) with the placement "
                    "in force as `previous`; every following step is scored with max/mean GPU load "
                    "per layer. Also reports 'none' (start-up placement) and 'oracle' (planned on the "
                    "scored steps themselves).")
    sm.add_argument("trace", help="'esft' (packaged) or a .npy / .npz file holding [T, L, N] counts")
    sm.add_argument("--num-gpus", type=_positive_list("--num-gpus"), required=True,
                    help="EP size (with --cost: one or several, comma-separated)")
    sm.add_argument("--num-slots", type=_positive("--num-slots"), default=None,
                    help="physical slots per layer (N + redundant), divisible by --num-gpus "
                         "(required without --cost)")
    sm.add_argument("--window-size", "--window", action=Setting, type=_positive("--window-size"),
                    required=True, help="steps of load each plan sees (after --aggregate)")
    sm.add_argument("--rebalance-interval", "--interval", action=Setting,
                    type=_positive("--rebalance-interval"), required=True,
                    help="replan every this many steps (after --aggregate)")
    sm.add_argument("--policy", action="append", default=None, metavar="NAME",
                    help="policy to replay; repeat for several side by side (default: default)")
    sm.add_argument("--num-nodes", type=_positive("--num-nodes"), default=1)
    sm.add_argument("--num-groups", type=_positive("--num-groups"), default=1)
    sm.add_argument("--load-decay", "--decay", action=Setting, type=_float("--load-decay"),
                    default=EplbConfig.load_decay,
                    help="weight of a step k steps older than the newest: load_decay**k "
                         f"(default {EplbConfig.load_decay:g} = sum, as EplbConfig)")
    sm.add_argument("--move-tolerance", type=_float("--move-tolerance"), default=EplbConfig.move_tolerance,
                    help=f"extra predicted imbalance accepted to keep experts in place "
                         f"(default {EplbConfig.move_tolerance}, as EplbConfig)")
    sm.add_argument("--weighted-replicas", "--weighted", action=Setting, nargs=0, const=True,
                    default=EplbConfig.weighted_replicas, help="ask the policies for weighted replicas")
    sm.add_argument("--shift-threshold", type=_float("--shift-threshold"), default=EplbConfig.shift_threshold,
                    metavar="G", help="shift-aware rebalancing: a drop of the placement in force below its "
                                      "plan's predicted balancedness by more than G beyond the noise "
                                      "re-plans with move tolerance 0 and may rebalance early, once per "
                                      f"interval (default {EplbConfig.shift_threshold}, as EplbConfig; 0 = off)")
    sm.add_argument("--min-gain", type=_float("--min-gain"), default=EplbConfig.min_gain, metavar="G",
                    help=f"skip a rebalance whose plan raises the window's predicted balancedness "
                         f"by less than G (default {EplbConfig.min_gain}, as EplbConfig; 0 = never)")
    sm.add_argument("--aggregate", type=_positive("--aggregate"), default=1, metavar="A",
                    help="first sum every A consecutive trace entries into one step (default 1)")
    sm.add_argument("--start", type=_positive("--start"), default=None,
                    help="step of the first plan (default: --rebalance-interval, as the runtime)")
    sm.add_argument("--bytes-per-expert", type=_positive("--bytes-per-expert"), default=None,
                    help="bytes of one expert's weights, to report bytes moved")
    sm.add_argument("--no-oracle", action="store_true", help="skip the oracle reference (half the work)")
    sm.add_argument("--json", metavar="FILE", help="write every figure (per step, per rebalance) to FILE")
    sm.add_argument("--plot", metavar="PNG", help="draw imbalance over time and moves per rebalance "
                                                  "(needs matplotlib: pip install 'eplb[plot]')")
    from eplb.ops.scale_report import add_cost_arguments
    add_cost_arguments(sm)
    sm.set_defaults(func=cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # torch.load(weights_only=True) warns in several lines about a file's pickle protocol
    # before refusing it; every loader reports a refused file in one line of its own
    warnings.filterwarnings("ignore", message=r"Detected pickle protocol", category=UserWarning)
    parser = build_parser()
    a = parser.parse_args(argv)
    a.argv = argv
    if a.command == "simulate" and a.policy is None:
        a.policy = ["default"]
    try:
        return a.func(a)
    except ValueError as e:
        print(f"eplb {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
