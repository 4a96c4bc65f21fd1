"""Plans on a drifting load use the window's trend (issue 29): `trend_load` extrapolates
each expert's count per step to the middle of the interval a plan will serve (slopes
within routing noise shrunk), and `DriftTrend` decides per layer whether a plan uses it.
A pure function and a frozen state, shared by the runtime (`eplb.runtime.targets`) and
the replay (`eplb.core.replay`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

DEFAULT_DRIFT_TREND = True
"""Scheduled plans use the window's trend in the layers where it has predicted well
(`DriftTrend`: a drifting load; measured on the issue 29 replay, benchmarks/README.md);
False: the window."""

TREND_FLOOR = 0.1  # an expert's extrapolated count is at least this share of its window mean


def trend_load(total: np.ndarray, moment: np.ndarray, steps: int, ahead: float) -> np.ndarray:  # [L, N]
    """The load of the `steps` steps of a window extrapolated `ahead` steps past its middle.

    `total [L, N]`: the window's counts summed over its steps; `moment [L, N]`: the same
    counts weighted by each step's age (0 for the newest step, steps - 1 for the oldest),
    what `LoadRecorder.window_load(moment=True)` all-reduces. Per expert, the least-squares
    line through its count per step gives the count at the middle of what comes (`ahead`:
    `(window + rebalance_interval) / 2` for the interval the plan serves); it is at least
    `TREND_FLOOR` of the window mean, and each layer is rescaled to the window's tokens (the
    planner sees the same volume, only its split over the experts moves)."""
    total = np.asarray(total, dtype=np.float64)
    moment = np.asarray(moment, dtype=np.float64)
    if steps < 2:
        return total
    mean_age = (steps - 1) / 2.0
    sxx = steps * (steps * steps - 1) / 12.0  # sum over the steps of (age - mean age)**2
    slope = -(moment - mean_age * total) / sxx  # [L, N] count per step, per step towards the newest
    mean = total / steps  # [L, N]
    # routing noise: a count per step varies about its mean like a Poisson count, so the
    # fitted slope by about mean / sxx; a slope not clear of that is shrunk towards 0
    noise = mean / sxx  # [L, N] the slope's variance
    slope = slope * np.clip(1.0 - noise / np.maximum(slope * slope, 1e-300), 0.0, 1.0)
    return _with_tokens_of(np.maximum(mean + slope * float(ahead), TREND_FLOOR * mean), total)


@dataclass(frozen=True)
class DriftTrend:
    """Plans on a drifting load (pure: every update returns a new state). A drift moves
    the load on between the window a plan sees and the interval it serves, so a plan on
    the window balances a load that is gone; at EP 128 on the issue 29 drift family both
    the default and DeepSeek's plans serve about 1.41 max/mean where the oracle gets 1.12.
    A scheduled plan therefore makes the window's trend (`trend_load`) and moves its load
    along it (the trend's move from the window, carried over to the load it would plan on
    otherwise: `SteadyMemory`'s windows stay), per layer, where two things hold:

    - the trend made by the plan before predicted what followed better than that plan's
      window did (L1 distance of the expert shares), which a load moving one way passes
      and a steady or jumpy one does not (a straight line through noise or through jumps
      lands further off than their mean);
    - the load drifts: the drift rule (`planning.drifting`, beyond routing noise) says
      so, or the layer was on the trend last time (plans on the trend follow a drift, so
      the rule may no longer see it).

    The first plan only makes a trend to judge; a plan after a shift, or on a window the
    last plan saw, forgets it."""

    on: bool = DEFAULT_DRIFT_TREND
    last: tuple | None = None  # ([L, N] trend, [L, N] window, [L] used) of the last scheduled plan

    @staticmethod
    def applies(drift_trend: bool, shift_threshold: float, decay: float) -> bool:
        """Whether plans may use the trend: `drift_trend`, with shift detection on (the
        shift-aware planning it belongs to) and a window of plain sums (`decay` 1)."""
        return bool(drift_trend) and shift_threshold > 0 and decay == 1

    def plan(self, window: np.ndarray, load: np.ndarray, moment: np.ndarray | None, steps: int,
             ahead: float, fresh: bool, drift: bool) -> tuple[np.ndarray, "DriftTrend", np.ndarray]:
        """(what the plan plans on, the state after it, [L] bool: the layers that use the
        trend). `window [L, N]`: the counts of the window's `steps` steps, `moment` their
        age-weighted sum; `load [L, N]`: what the plan would plan on otherwise (the window,
        or with `SteadyMemory`'s earlier windows), kept in the other layers. `fresh`: a
        scheduled plan (not after a shift) on a window none of whose steps the last plan
        saw; else, or `moment` None, `load` and the state forgets (a shift's load says
        nothing of the trend before it). `drift`: the drift rule fires for this plan."""
        window = np.asarray(window, dtype=np.float64)
        load = np.asarray(load, dtype=np.float64)
        none = np.zeros(window.shape[0], dtype=bool)  # [L]
        if not self.on or not fresh or moment is None or steps < 2:
            return load, replace(self, last=None), none
        trend = trend_load(window, moment, steps, ahead)  # [L, N]
        use = none
        if self.last is not None and self.last[0].shape == window.shape:
            came = _shares(window)  # [L, N] what followed the last plan
            use = (np.abs(_shares(self.last[0]) - came).sum(-1)
                   < np.abs(_shares(self.last[1]) - came).sum(-1)) & (drift | self.last[2])  # [L]
        # the trend's move from the window, carried over to `load` (which may hold more
        # windows: the same move in proportion), at least TREND_FLOOR of it, same tokens
        scale = np.divide(load.sum(-1, keepdims=True), window.sum(-1, keepdims=True),
                          out=np.ones((load.shape[0], 1)), where=window.sum(-1, keepdims=True) > 0)  # [L, 1]
        moved = _with_tokens_of(np.maximum(load + (trend - window) * scale, TREND_FLOOR * load), load)  # [L, N]
        return np.where(use[:, None], moved, load), replace(self, last=(trend, window, use)), use


def _with_tokens_of(pred: np.ndarray, like: np.ndarray) -> np.ndarray:  # [L, N], [L, N] -> [L, N]
    """`pred` rescaled per layer to the tokens of `like` (`like` itself where `pred` has none)."""
    sums = pred.sum(-1, keepdims=True)  # [L, 1]
    return np.divide(pred * like.sum(-1, keepdims=True), sums, out=like.copy(), where=sums > 0)


def _shares(load: np.ndarray) -> np.ndarray:  # [L, N] -> [L, N] per-layer shares (0 for an empty layer)
    sums = load.sum(-1, keepdims=True)
    return np.divide(load, sums, out=np.zeros_like(load), where=sums > 0)
