"""`eplb` command line: `eplb demo` (launch the demo job) and `eplb plan` (plan a placement).

Every bad input exits with status 2 and one line on stderr naming the problem.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line, exit 2."""

    def error(self, message: str):  # type: ignore[override]
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


def cmd_demo(a: argparse.Namespace) -> int:
    import torch

    from eplb.demo import check_demo_arguments, setup
    from eplb.launch import launch

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
    forwarded = a.argv[a.argv.index("demo") + 1:]
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
    return launch("eplb.demo", out, nproc)


def cmd_plan(a: argparse.Namespace) -> int:
    from eplb.loadio import read_load
    from eplb.placement import Placement
    from eplb.planning import plan

    load = read_load(a.load)  # [L, N]
    previous = None
    if a.previous:
        previous = Placement.load(a.previous, num_logical_experts=load.shape[1], num_gpus=a.num_gpus)
    placement = plan(load, num_gpus=a.num_gpus, num_slots=a.num_slots, num_nodes=a.num_nodes,
                     num_groups=a.num_groups, policy=a.policy, previous=previous)
    out = Path(a.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out: directory does not exist: {out.parent}")
    d = placement.to_dict()
    d["replica_count"] = placement.replica_count().tolist()
    bal = placement.balancedness(load)  # [L]
    d["balancedness"] = bal.round(6).tolist()
    if out.suffix in (".npy", ".pt"):
        placement.save(out)
    else:
        out.write_text(json.dumps(d) + "\n")
    print(f"planned {placement.num_layers} layers x {placement.num_slots} slots on {a.num_gpus} GPUs "
          f"({a.num_nodes} nodes, policy {a.policy}): balancedness {bal.mean():.4f} "
          f"(imbalance {1 / bal.mean():.4f}); wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eplb.demo import add_demo_arguments

    p = _Parser(prog="eplb", description="Expert-parallel load balancer for MoE models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="run the reference MoE model under a skewed load with EPLB",
                       description="Launch N ranks (like torchrun) running the reference MoE model "
                                   "under a skewed, drifting routing load, rebalanced on schedule.")
    d.add_argument("--nproc", type=_positive("--nproc"), default=None,
                   help="ranks to launch (default 4 on cpu, one per visible GPU on cuda)")
    add_demo_arguments(d)
    d.set_defaults(func=cmd_demo)

    pl = sub.add_parser("plan", help="plan a placement from recorded expert load",
                        description="Plan a placement from a load file: .npy [L, N] or [T, L, N] "
                                    "(summed over T), or .json/.pt holding 'logical_count'.")
    pl.add_argument("load", help="load file (.npy, .json or .pt)")
    pl.add_argument("--num-gpus", type=_positive("--num-gpus"), required=True)
    pl.add_argument("--num-slots", type=_positive("--num-slots"), required=True,
                    help="physical slots per layer (N + redundant), divisible by --num-gpus")
    pl.add_argument("--num-nodes", type=_positive("--num-nodes"), default=1)
    pl.add_argument("--num-groups", type=_positive("--num-groups"), default=1)
    pl.add_argument("--policy", default="default")
    pl.add_argument("--previous", metavar="FILE", help="current placement (keeps experts in place)")
    pl.add_argument("--out", required=True, metavar="FILE", help="output .json (or .npy/.pt)")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    a = parser.parse_args(argv)
    a.argv = argv
    try:
        return a.func(a)
    except ValueError as e:
        print(f"eplb {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
