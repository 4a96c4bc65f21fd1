"""EplbConfig: the runtime's settings, checked once by `verify()`.

Verify-and-update pattern: an invalid value raises ValueError naming the field and
what is allowed; every value the runtime fills in or adjusts is logged.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from eplb.core.policy.base import (DEFAULT_DISPATCH_TOKENS, DEFAULT_MOVE_TOLERANCE, DEFAULT_READ_TOKENS,
                                DEFAULT_TILE_ROWS)
from eplb.core.planning import DEFAULT_SHIFT_THRESHOLD, DEFAULT_STEADY_WINDOWS
from eplb.core.trend import DEFAULT_DRIFT_TREND

TRANSPORTS = ("nccl", "ipc", "auto")
"""Values of `EplbConfig.transport` (how weights travel; eplb.runtime.transports)."""

LAUNCH_MODES = ("auto", "thread", "step")
"""Values of `EplbConfig.exchange_launch` (where an asynchronous change launches each
layer's exchange; eplb.runtime.move_options.MoveOptions)."""

log = logging.getLogger("eplb.core.config")


@dataclass(frozen=True)
class EplbConfig:
    num_redundant_experts: int | None = None
    """Extra physical slots per layer beyond the N logical experts (P = N + this).
    None (not set): the model's, P - N (`verify` given `num_physical_experts`, as
    `EplbRuntime` does; 0 without it). A value set is checked against the model."""
    window_size: int = 1000
    """Steps of recorded load the planner sees."""
    rebalance_interval: int = 3000
    """Rebalance every this many `step()` calls; 0 = only when asked (`rebalance()`)."""
    policy: str = "default"
    """Planner name, see `eplb.core.policy.registry.available_policies()`."""
    num_nodes: int | None = None
    """Nodes the EP ranks span; None = the EP group's size / torchrun's LOCAL_WORLD_SIZE
    (1 when that does not divide). A value that does not divide the EP ranks plans as 1."""
    initial_placement: str | None = None
    """Optional placement file (.json/.npy/.pt) to move to when the runtime starts."""
    load_decay: float = 1.0
    """Weight of a step k steps before the newest one in the window: load_decay**k
    (1.0 = plain window sum; smaller values follow drift faster)."""
    move_tolerance: float = DEFAULT_MOVE_TOLERANCE
    """Relative extra predicted imbalance the planner accepts to keep experts where they
    are (0 = best balance whatever it moves; larger = fewer moves). The default is the
    planner's (`eplb.core.policy.base.DEFAULT_MOVE_TOLERANCE`, 0.03), chosen on the ESFT replay
    of `benchmarks/planner.py --only moves`: its copies moved and out-of-sample balance
    against DeepSeek EPLB's, per tolerance, are in benchmarks/README.md ("Planner:
    `default` (balanced) against `deepseek`", table 3. Moves; "Planner round 3", Target 3)."""
    min_gain: float = 0.01
    """The least predicted gain in balancedness (mean over layers of mean/max GPU load, on
    the window's load: planned placement minus the one in force) for which a rebalance
    moves weights; a plan that gains less is a skipped rebalance: nothing moves, and it is
    still reported (event, log, `eplb_rebalances_total{outcome="skipped"}`). 0 = move
    whenever the plan differs from the placement in force (a plan equal to it is always
    skipped: nothing to gain). Does not apply to `apply_placement()`. Default chosen on
    the shared traces (benchmarks/README.md, "Skipping rebalances that gain too little")."""
    shift_threshold: float = DEFAULT_SHIFT_THRESHOLD
    """Shift-aware rebalancing (`eplb.core.planning.ShiftState`): when the placement in
    force balances the load recorded since the last plan worse than that plan predicted
    by more than this (in balancedness), beyond the load's variation seen at earlier
    rebalances and the routing noise of the tokens checked,
    the load shifted: the next rebalance plans with move tolerance 0, and a check every
    `control_interval` steps may start one early rebalance between two other rebalances
    (bounded rate: at most one per `rebalance_interval`). A load that drifts (every
    recent check found the plan in force below its prediction by more than
    `move_tolerance` plus the routing noise of the window planned on) is also planned with
    move tolerance 0 (`planning.plan_tolerance`). 0 = off: the schedule alone, with
    `move_tolerance` always. Measured in benchmarks/README.md (issue 29)."""
    steady_windows: int = DEFAULT_STEADY_WINDOWS
    """With shift detection on: a rebalance on a steady load (no shift, no drift, see
    `shift_threshold`) plans on its window plus up to this many windows of the earlier
    steady plans (`eplb.core.planning.SteadyMemory`): more tokens, so a plan fits less of
    one window's routing noise. A shift or a drift forgets them. Applies when windows do
    not overlap and are plain sums (`window_size` <= `rebalance_interval`, `load_decay`
    1) and to a plan whose window holds only steps since the previous one; 0 = off (the
    window alone). Measured in benchmarks/README.md (issue 29, 2026-12-04, third)."""
    drift_trend: bool = DEFAULT_DRIFT_TREND
    """With shift detection on: a scheduled rebalance (not after a shift) whose window
    the last plan did not see moves its load, per layer, along the window's trend (each
    expert's count extrapolated by least squares to the middle of the `rebalance_interval`
    the plan will serve, slopes within routing noise shrunk) where the load drifts (the
    drift rule of `shift_threshold`, or the layer was on the trend at the last rebalance)
    and the trend made at the last rebalance predicted what followed better than that
    rebalance's window did (`eplb.core.trend.DriftTrend`); a steady or jumpy load keeps
    its window. Plain sums only (`load_decay` 1); the window's age-weighted sum rides in
    the same all-reduce. False: the window alone. Measured in benchmarks/README.md (issue
    29, 2026-12-04, sixth)."""
    read_tokens: float = DEFAULT_READ_TOKENS
    """Decode-aware packing (`eplb.core.policy.balanced.reads`): a slot that gets at least
    one token in a step reads its expert's weights once, which costs as much as this many
    tokens of expert work. With few tokens per step (decode) cold experts' slots are often
    empty, and the planner spreads them so that no GPU reads more weights than it must;
    the tokens per step come from the recorded window (its load over its steps). A slot
    reads once per `tile_rows` of its tokens. 0 = off (balance tokens only). Measured in
    benchmarks/README.md (issue 29, target 3)."""
    dispatch_tokens: float = DEFAULT_DISPATCH_TOKENS
    """Decode-aware packing: one more token on the GPU that receives the most costs this
    many tokens of expert work in its dispatch and combine all-to-all, so the planner
    does not spread reads at the price of a slower exchange (inf: the busiest GPU's
    tokens never rise). Measured with `read_tokens` (benchmarks/README.md, issue 29)."""
    tile_rows: float = DEFAULT_TILE_ROWS
    """Decode-aware packing: a grouped GEMM reads an expert's weights once per tile of this
    many of a slot's tokens (128 on an H200, measured), so a slot with 129 tokens reads
    twice. A layer (global placement) whose GPUs cost more in tokens and reads than
    DeepSeek's replica counts packed afresh for the same load is brought down to that cost,
    through those counts when that moves less; at the first plan from the start-up
    placement, a layer that neither gets there takes that fresh packing with its GPUs
    relabelled (benchmarks/README.md, issue 29, 2026-12-04 and 2026-12-05 (fourth)). 0 =
    one read per non-empty slot, and no such catch-up."""
    zero_load_warn_steps: int = 100
    """At this step, warn once (rank 0) if no rank recorded any load in its window yet:
    the model is not adding the tokens each slot receives into `expert_load_view`
    (one host read and one agreement, at that step only). 0 = never. Whatever this
    says, a rebalance whose window is all zero plans nothing: it is skipped ("no load
    recorded") and moves nothing."""
    weighted_replicas: bool = False
    """Let the planner give replicas unequal shares of their expert's tokens."""
    control_interval: int = 10
    """Every this many steps the ranks agree whether anyone asked for a rebalance
    (`request_rebalance()`, HTTP): one MAX all-reduce of three ints on a CPU group, which
    also checks that every rank ran the same number of forwards. The same steps check for
    a load shift (`shift_threshold`). 0 = never check."""
    verify_transfers: bool = False
    """After each layer's weight transfer, compare per-slot checksums of all replicas with
    the pre-transfer checksum of their expert (one all_gather per changed layer); a
    mismatch fails the rebalance before that layer's maps are committed."""
    async_rebalance: bool = False
    """Plan and move weights in a background thread (side CUDA stream, own process group)
    while `step()` keeps serving; each layer's weights and maps switch together at a step
    boundary that all ranks agree on. False: `rebalance()` does everything before returning."""
    planner_process: bool = True
    """Asynchronous mode: rank 0 plans in a child process (`eplb.runtime.planner_process`) rather
    than in the rebalance thread, so planning never holds the serving process's GIL (held,
    it delays the step loop's kernel launches). Policies registered at run time are only
    known in this process: they are planned in the thread. Costs one Python process
    (with torch imported) on rank 0."""
    transport: str = "nccl"
    """How expert weights travel between ranks: "nccl" (point-to-point over the EP group's
    backend, coalesced per peer in messages of up to 1 GiB; gloo on CPU), "ipc" (CUDA IPC
    straight from the peers' slots, all ranks on one host; synchronous rebalances move each
    layer in place; keeps a hold buffer of one layer of local experts per GPU) or "auto" (IPC where it
    can work, else "nccl"; see `eplb.runtime.transport_choice.make_transport`). benchmarks/README.md has
    the bandwidth of each."""
    exchange_launch: str = "auto"
    """Asynchronous mode: where each layer's weight exchange is launched. "step": from
    `step()`, at the same step on every rank, so the transfer group's NCCL kernels reach
    every GPU in the same order relative to the model's own collectives (NCCL requires
    that order for concurrent communicators; two threads launching cannot promise it);
    costs the step loop the host time of launching (the transfer itself runs on a side
    stream). "thread": from the rebalance thread. "auto": "step" on CUDA with more than
    one rank when the transport launches NCCL kernels ("nccl"), else "thread" (gloo, and
    "ipc", which launches no kernel of a process group)."""
    transfer_timeout: float = 300.0
    """Seconds a rebalance waits for a peer (or for its own transfer to make progress)
    before it counts the rebalance as failed; a rank that stopped answering is detected
    within about three times this (its peers sit out this timeout in the transfer, then
    twice this in the step agreement); a rank that died is usually seen at once."""

    def verify(self, num_logical_experts: int, num_gpus: int,
               num_physical_experts: int | None = None) -> "EplbConfig":
        """Check against the model and the EP group; return the config with resolved values."""
        from eplb.core.planning import (check_bool, check_dispatch_tokens, check_load_decay, check_min_gain,
                                        check_move_tolerance, check_read_tokens, check_steady_windows)
        from eplb.core.policy.registry import available_policies

        N, M = num_logical_experts, num_gpus
        R = self.num_redundant_experts
        if R is None:
            R = 0 if num_physical_experts is None else num_physical_experts - N
            log.info("num_redundant_experts not set: using %d (%s)", R,
                     "0, no model given" if num_physical_experts is None else
                     f"the model's {num_physical_experts} slots - {N} experts")
        if isinstance(R, bool) or not isinstance(R, int) or R < 0:
            raise ValueError(f"num_redundant_experts must be an int >= 0, got {R!r}")
        P = N + R
        if P % M:
            ok = [r for r in range(R + 3 * M) if (N + r) % M == 0][:3]
            raise ValueError(
                f"num_redundant_experts={R}: {P} physical slots "
                f"(N={N} + redundant) must be divisible by the {M} EP ranks; "
                f"valid num_redundant_experts: {', '.join(map(str, ok))}, ..."
            )
        if num_physical_experts is not None and num_physical_experts != P:
            raise ValueError(
                f"num_redundant_experts={R} gives {P} slots but the model "
                f"has num_physical_experts={num_physical_experts}; set num_redundant_experts="
                f"{num_physical_experts - N} (or leave it unset: the runtime takes the model's)"
            )
        if not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f"window_size must be an int >= 1, got {self.window_size!r}")
        if not isinstance(self.rebalance_interval, int) or self.rebalance_interval < 0:
            raise ValueError(
                f"rebalance_interval must be an int >= 0 (0 = only on request), got {self.rebalance_interval!r}"
            )
        check_load_decay(self.load_decay)
        check_move_tolerance(self.move_tolerance)
        check_min_gain(self.min_gain)
        check_min_gain(self.shift_threshold, "shift_threshold")
        check_read_tokens(self.read_tokens)
        check_dispatch_tokens(self.dispatch_tokens)
        check_read_tokens(self.tile_rows, "tile_rows")
        if (isinstance(self.zero_load_warn_steps, bool) or not isinstance(self.zero_load_warn_steps, int)
                or self.zero_load_warn_steps < 0):
            raise ValueError(f"zero_load_warn_steps must be an int >= 0 (0 = never warn), "
                             f"got {self.zero_load_warn_steps!r}")
        check_steady_windows(self.steady_windows)
        check_bool(self.drift_trend, "drift_trend")
        if not isinstance(self.weighted_replicas, bool):
            raise ValueError(f"weighted_replicas must be a bool, got {self.weighted_replicas!r}")
        if not isinstance(self.control_interval, int) or self.control_interval < 0:
            raise ValueError(f"control_interval must be an int >= 0 (0 = ignore requests), "
                             f"got {self.control_interval!r}")
        if not isinstance(self.verify_transfers, bool):
            raise ValueError(f"verify_transfers must be a bool, got {self.verify_transfers!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is unknown; choose one of "
                             f"{list(TRANSPORTS)}")
        if not isinstance(self.async_rebalance, bool):
            raise ValueError(f"async_rebalance must be a bool, got {self.async_rebalance!r}")
        if not isinstance(self.planner_process, bool):
            raise ValueError(f"planner_process must be a bool, got {self.planner_process!r}")
        if self.exchange_launch not in LAUNCH_MODES:
            raise ValueError(f"exchange_launch={self.exchange_launch!r} is unknown; choose one of "
                             f"{list(LAUNCH_MODES)}")
        if (isinstance(self.transfer_timeout, bool) or not isinstance(self.transfer_timeout, (int, float))
                or not 0 < self.transfer_timeout <= 86400):
            raise ValueError(f"transfer_timeout must be seconds in (0, 86400], got {self.transfer_timeout!r}")
        if self.policy not in available_policies():
            raise ValueError(f"policy={self.policy!r} is unknown; choose one of {available_policies()}")
        if self.initial_placement is not None and not os.path.isfile(self.initial_placement):
            raise ValueError(f"initial_placement: file not found: {self.initial_placement}")

        num_nodes = self.num_nodes
        if num_nodes is None:
            num_nodes = nodes_from_env(M)
            log.info("num_nodes not set: using %d (from torchrun environment)", num_nodes)
        elif not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {num_nodes!r}")
        if M % num_nodes:
            log.warning("num_nodes=%d does not divide the %d EP ranks: planning with num_nodes=1",
                        num_nodes, M)
            num_nodes = 1
        if self.rebalance_interval and self.window_size > self.rebalance_interval:
            log.info("window_size=%d > rebalance_interval=%d: each plan also sees load recorded "
                     "before the previous rebalance", self.window_size, self.rebalance_interval)
        return dataclasses.replace(self, num_redundant_experts=R, num_nodes=num_nodes)


def nodes_from_env(world_size: int) -> int:
    """Number of nodes: `world_size` (the EP group's size) / torchrun's LOCAL_WORLD_SIZE;
    1 when LOCAL_WORLD_SIZE is unset or does not divide it."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local or not local.isdigit() or int(local) < 1:
        return 1
    local = int(local)
    if world_size % local:
        return 1
    return world_size // local
