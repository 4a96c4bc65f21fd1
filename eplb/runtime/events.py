"""RebalanceEvent: what one rebalance did, the record every report is made from (logs,
metrics, the HTTP status of a request, `EplbRuntime.events`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eplb.core.placement import Placement

__all__ = ["NO_LOAD", "RebalanceEvent"]

NO_LOAD = "no load recorded (the window is all zero: the model added nothing into expert_load_view)"


@dataclass
class RebalanceEvent:
    """What one rebalance did, identical on every rank. A skipped rebalance (its plan
    gained less than `min_gain`) moved nothing and kept the placement in force."""

    step: int
    trigger: str
    balancedness_before: np.ndarray  # [L] measured over the window's per-GPU load (mean/max)
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

    @property
    def seconds(self) -> float:
        return self.seconds_plan + self.seconds_transfer + self.seconds_commit

    @property
    def outcome(self) -> str:
        """"skipped" or "success" (the `outcome` label of eplb_rebalances_total)."""
        return "skipped" if self.skipped else "success"

    def describe(self) -> str:
        """One line for logs and consoles, e.g. `rebalance at step 50 (interval): balancedness
        0.868 -> 0.984 (predicted), 20 experts moved (0.98 MB) in 0.044 s`."""
        head = f"rebalance at step {self.step} ({self.trigger})"
        before = float(np.mean(self.balancedness_before))
        if self.skipped:
            why = self.skip_reason or (
                f"nothing to gain (predicted gain {self.predicted_gain:+.4f})"
                if self.predicted_gain <= 0
                else f"predicted gain {self.predicted_gain:+.4f} < min gain {self.min_gain:.4f}")
            return f"{head} skipped: {why}; balancedness {before:.4f}, nothing moved"
        return (f"{head}: balancedness {before:.4f} -> {float(np.mean(self.balancedness_after)):.4f} "
                f"(predicted), {self.experts_moved} experts moved ({self.bytes_moved / 1e6:.2f} MB) "
                f"in {self.seconds:.3f} s"
                + (f" over {self.steps_in_flight} steps" if self.steps_in_flight else ""))

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
            "seconds_agree_wait": self.seconds_agree_wait,
        }
