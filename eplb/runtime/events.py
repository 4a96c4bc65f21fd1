"""What one rebalance did: `ChangeStats`, the timers and counts a placement change fills
as it runs, and `RebalanceEvent`, the record every report is made from (logs, metrics,
the HTTP status of a request, `EplbRuntime.events`), built from them in one place
(`RebalanceEvent.of_change`); or why it stopped: `RebalanceError`, `EplbFatalError`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from eplb.core.placement import Placement
from eplb.core.transfer_plan import TransferStats

__all__ = ["NO_LOAD", "ChangeStats", "EplbFatalError", "RebalanceError", "RebalanceEvent",
           "layers_left"]

NO_LOAD = "no load recorded (the window is all zero: the model added nothing into expert_load_view)"


class RebalanceError(RuntimeError):
    """A rebalance stopped part-way on every rank at the same layer; every layer is on its
    old or its new placement with maps matching weights, and serving can continue."""


class EplbFatalError(RebalanceError):
    """A peer died or stopped answering during a rebalance, or a local write failed: the
    process group can no longer be trusted and the job should exit and restart. Layers
    are wholly old or new on this rank, except `partly_written`: the layer whose write
    failed (its weights may be partly rewritten, its maps are still old), or None."""

    def __init__(self, *args, partly_written: int | None = None) -> None:
        super().__init__(*args)
        self.partly_written = partly_written


def layers_left(error: RebalanceError) -> str:
    """What a stopped change left on this rank, for its failure message."""
    layer = getattr(error, "partly_written", None)
    if layer is None:
        return "every layer is on its old or its new placement with maps matching weights"
    return (f"layer {layer}'s weights may be partly rewritten (reload the model); every "
            "other layer is on its old or its new placement with maps matching weights")


@dataclass
class ChangeStats:
    """The timers and counts of one placement change (`PlacementChange.stats`), on this
    rank. Times are `time.perf_counter()` seconds."""

    t_start: float = field(default_factory=time.perf_counter)  # the change was made
    t_end: float | None = None  # it finished or was aborted
    seconds_plan: float = 0.0  # plan_fn and the new maps, inside the change
    seconds_switch: float = 0.0  # switching layers (writes + maps) on the caller's thread
    steps: int = 0  # advance() calls: the step boundaries the change took
    # the step loop's share (asynchronous mode): host time inside advance() in total, its
    # longest single call, and the part spent waiting for the agreement
    seconds_step_loop: float = 0.0
    max_step_loop: float = 0.0
    seconds_agree_wait: float = 0.0
    # what this rank moved (TransferExecutor's result): experts received over the network,
    # slots filled from a local expert, slots written, bytes in and out
    received: int = 0
    local_copies: int = 0
    written: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0

    def charge_step_loop(self, seconds: float) -> None:
        """Count `seconds` of the step loop's time against the change."""
        self.seconds_step_loop += seconds
        self.max_step_loop = max(self.max_step_loop, seconds)

    @property
    def seconds_transfer(self) -> float:
        """From the change's start to its end, planning excluded (0 while unfinished)."""
        return 0.0 if self.t_end is None else max(0.0, self.t_end - self.t_start - self.seconds_plan)


@dataclass
class RebalanceEvent:
    """What one rebalance did: the plan's figures and what moved are identical on every
    rank; the timers and step counts (seconds_*, max_step_loop_seconds, steps_in_flight)
    are this rank's. A skipped rebalance (its plan gained less than `min_gain`) moved
    nothing and kept the placement in force."""

    step: int
    trigger: str
    # [L] measured over the window's per-GPU load (mean/max); apply_placement given a load:
    # its `before`, or without one predicted from that load on the placement in force
    balancedness_before: np.ndarray
    balancedness_after: np.ndarray  # [L] predicted: the window's load on the placement in force after
    experts_moved: int  # remote expert copies received, all ranks together
    local_copies: int  # slots filled from another slot on the same rank
    slots_changed: int
    bytes_moved: int  # bytes sent between ranks, all ranks together
    seconds_plan: float
    seconds_transfer: float
    seconds_commit: float  # time the step loop spent switching layers (writes + maps)
    placement: Placement = field(repr=False)
    steps_in_flight: int = 0  # step boundaries the change spanned (asynchronous mode; else 0)
    # what the change cost the step loop (host time): in total, its longest single step
    # boundary, and the part of the total spent waiting for agreements
    seconds_step_loop: float = 0.0
    max_step_loop_seconds: float = 0.0
    seconds_agree_wait: float = 0.0
    # mean predicted balancedness of the plan minus that of the placement in force, both on
    # the window's load; a plan gaining less than min_gain is skipped
    predicted_gain: float = 0.0
    skipped: bool = False
    min_gain: float = 0.0
    skip_reason: str = ""  # set when skipped for another reason than the gain (NO_LOAD)
    # the move tolerance the plan used: the config's, or 0 after a load shift or on a
    # drifting load (`planning.plan_tolerance`); None when nothing was planned (a given
    # placement, or no load)
    move_tolerance: float | None = None
    # layers the plan made on the window plus earlier steady windows (`planning.SteadyMemory`)
    steady_layers: int = 0
    # layers the plan made on the window's trend (a drifting load, `trend.DriftTrend`)
    trend_layers: int = 0

    @classmethod
    def of_change(cls, stats: ChangeStats, moved: TransferStats, *, step: int, trigger: str,
                  before: np.ndarray, after: np.ndarray, placement: Placement,
                  bytes_per_expert: int, seconds_plan: float, asynchronous: bool,
                  predicted_gain: float, skipped: bool, min_gain: float,
                  skip_reason: str = "", move_tolerance: float | None = None,
                  steady_layers: int = 0, trend_layers: int = 0) -> "RebalanceEvent":
        """The event of a finished change: its timers from `stats` (this rank's), what
        moved from `moved` (all ranks, `transfer_stats` of the two placements), the
        figures of the plan (`before`, `after` [L], gain, skip) from the caller."""
        return cls(
            step=step, trigger=trigger, balancedness_before=before, balancedness_after=after,
            experts_moved=moved.experts_moved, local_copies=moved.local_copies,
            slots_changed=moved.slots_changed, bytes_moved=moved.experts_moved * bytes_per_expert,
            seconds_plan=seconds_plan, seconds_transfer=stats.seconds_transfer,
            seconds_commit=stats.seconds_switch, placement=placement,
            # step boundaries only an asynchronous change spans (run() drives it on one)
            steps_in_flight=stats.steps if asynchronous else 0,
            seconds_step_loop=stats.seconds_step_loop, max_step_loop_seconds=stats.max_step_loop,
            seconds_agree_wait=stats.seconds_agree_wait, predicted_gain=predicted_gain,
            skipped=skipped, min_gain=min_gain, skip_reason=skip_reason, move_tolerance=move_tolerance,
            steady_layers=steady_layers, trend_layers=trend_layers)

    @property
    def seconds(self) -> float:
        return self.seconds_plan + self.seconds_transfer + self.seconds_commit

    @property
    def outcome(self) -> str:
        """"skipped" or "success" (the `outcome` label of eplb_rebalances_total)."""
        return "skipped" if self.skipped else "success"

    def describe(self) -> str:
        """One line for logs and consoles, e.g. `rebalance at step 50 (interval): balancedness
        0.868 -> 0.984 (predicted), 20 experts moved (0.98 MB) in 0.044 s, move tolerance 0.03`."""
        head = f"rebalance at step {self.step} ({self.trigger})"
        before = float(np.mean(self.balancedness_before))
        trend = self.layers_note()
        if self.skipped:
            why = self.skip_reason or (
                f"nothing to gain (predicted gain {self.predicted_gain:+.4f})"
                if self.predicted_gain <= 0
                else f"predicted gain {self.predicted_gain:+.4f} < min gain {self.min_gain:.4f}")
            return f"{head} skipped: {why}; balancedness {before:.4f}, nothing moved{trend}"
        return (f"{head}: balancedness {before:.4f} -> {float(np.mean(self.balancedness_after)):.4f} "
                f"(predicted), {self.experts_moved} experts moved ({self.bytes_moved / 1e6:.2f} MB) "
                f"in {self.seconds:.3f} s"
                + (f" over {self.steps_in_flight} steps" if self.steps_in_flight else "")
                + (f", move tolerance {self.move_tolerance:g}" if self.move_tolerance is not None else "")
                + trend)

    def layers_note(self) -> str:
        """", earlier steady windows in K of L layers, drift trend in K of L layers" (each part
        only when K > 0): what the plan added to its window (`describe`, the demo's line)."""
        L = len(self.balancedness_after)
        return ((f", earlier steady windows in {self.steady_layers} of {L} layers" if self.steady_layers else "")
                + (f", drift trend in {self.trend_layers} of {L} layers" if self.trend_layers else ""))

    def summary(self) -> dict:
        """JSON-ready figures of this rebalance (no placement)."""
        return {
            "step": self.step, "trigger": self.trigger, "outcome": self.outcome,
            "skipped": self.skipped, "skip_reason": self.skip_reason,
            "balancedness_before": float(np.mean(self.balancedness_before)),
            "balancedness_after": float(np.mean(self.balancedness_after)),
            "predicted_gain": self.predicted_gain, "min_gain": self.min_gain,
            "experts_moved": self.experts_moved, "local_copies": self.local_copies,
            "slots_changed": self.slots_changed, "bytes_moved": self.bytes_moved,
            "seconds_plan": self.seconds_plan, "seconds_transfer": self.seconds_transfer,
            "seconds_commit": self.seconds_commit, "steps_in_flight": self.steps_in_flight,
            "seconds_step_loop": self.seconds_step_loop,
            "max_step_loop_seconds": self.max_step_loop_seconds,
            "seconds_agree_wait": self.seconds_agree_wait, "move_tolerance": self.move_tolerance,
            "steady_layers": self.steady_layers, "trend_layers": self.trend_layers,
        }
