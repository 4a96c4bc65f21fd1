"""`eplb` command line: `eplb demo` (launch the demo job), `eplb plan` (plan a placement) and
`eplb simulate` (replay a load trace under policies, offline); `eplb trigger` (ask a running
job's server to rebalance) and `eplb record` (save its recorded load, GET /load).

Every bad input exits with status 2 and one line on stderr naming the problem. A flag of
an EplbConfig setting is the field name with dashes (`Setting`; old spellings still parse,
with a deprecation warning).

This module holds every subcommand's parser and the argument checks that turn each bad
input into one line naming its flag; the work itself lives in eplb.core, eplb.ops.demo,
eplb.ops.record (`eplb record`) and eplb.ops.simulate_report (`eplb simulate`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

from eplb.ops.settings_args import _ALIASES_IN_ERROR, Setting, SettingsParser, canonical_argv, on_off


class _Parser(SettingsParser):
    """argparse that reports usage errors as one line, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        message = _ALIASES_IN_ERROR.sub(r"argument \1:", message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(name: str, low: int):
    """An integer >= `low`, else an argparse error naming `name`."""
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {v}")
        return v
    return conv


def _positive(name: str):
    return _at_least(name, 1)


def _count(name: str):
    return _at_least(name, 0)


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
    from eplb.ops.demo import setup
    from eplb.ops.demo_args import check_demo_arguments
    from eplb.ops.launch import launch

    for name, limit in _DEMO_LIMITS.items():  # sizes the ranks would allocate: refuse early
        value = getattr(a, name, None)
        if value is not None and value > limit:
            raise ValueError(f"--{name.replace('_', '-')}: {value} is more than the supported {limit}")
    check_demo_arguments(a)  # the ranks run it again (plain torchrun has no launcher)
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


def _float(name: str):
    def conv(s: str) -> float:
        try:
            return float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
    return conv


def cmd_record(a: argparse.Namespace) -> int:
    from eplb.ops.record import record

    return record(a)


def cmd_simulate(a: argparse.Namespace) -> int:
    from eplb.ops.simulate_report import run_simulate

    return run_simulate(a)


def build_parser() -> argparse.ArgumentParser:
    from eplb.core.config import EplbConfig

    from eplb.ops.demo_args import add_demo_arguments

    from eplb import __version__
    from eplb.core.policy.registry import available_policies

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
    sm.add_argument("--steady-windows", type=_count("--steady-windows"), default=EplbConfig.steady_windows,
                    metavar="K", help="with shift detection on: a plan on a steady load adds up to K earlier "
                                      "windows to its own (when --window-size <= --rebalance-interval "
                                      f"and --load-decay 1; default {EplbConfig.steady_windows}, as "
                                      "EplbConfig; 0 = the window alone)")
    sm.add_argument("--drift-trend", type=on_off, default=EplbConfig.drift_trend, metavar="on|off",
                    help="with shift detection on: a scheduled plan on a drifting load moves its load along "
                         "the window's trend (each expert's count extrapolated to the interval served) in "
                         "the layers where the last trend predicted better than the window (--load-decay 1; "
                         "default "
                         f"{'on' if EplbConfig.drift_trend else 'off'}, as EplbConfig)")
    sm.add_argument("--control-interval", type=_count("--control-interval"), default=None, metavar="C",
                    help="with --cost: shift checks every C model steps, as the runtime (an interval of "
                         "--rebalance-interval trace steps is --serving-steps model steps; default "
                         f"{EplbConfig.control_interval}, as EplbConfig; 0 = no early rebalances)")
    sm.add_argument("--read-tokens", type=_float("--read-tokens"), default=None, metavar="R",
                    help="with --cost: decode-aware packing, a slot's weight read costs R tokens when "
                         "the slot gets a token in a step (token count from --tokens-per-gpu; "
                         f"default {EplbConfig.read_tokens:g}, as EplbConfig; 0 = off)")
    sm.add_argument("--dispatch-tokens", type=_float("--dispatch-tokens"), default=None,
                    metavar="D", help="with --cost: a token more on the busiest GPU costs D tokens in "
                                      "its dispatch and combine (inf: decode-aware packing never "
                                      f"raises it; default {EplbConfig.dispatch_tokens:g}, as EplbConfig)")
    sm.add_argument("--tile-rows", type=_float("--tile-rows"), default=None, metavar="T",
                    help="with --cost: decode-aware packing counts a weight read per T tokens of a slot "
                         f"(the grouped GEMM's row tile; default {EplbConfig.tile_rows:g}, as EplbConfig; "
                         "0 = one read per slot with tokens)")
    sm.add_argument("--min-gain", type=_float("--min-gain"), default=EplbConfig.min_gain, metavar="G",
                    help=f"skip a rebalance whose plan raises the window's predicted balancedness "
                         f"by less than G (default {EplbConfig.min_gain}, as EplbConfig; 0 = any change moves)")
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
