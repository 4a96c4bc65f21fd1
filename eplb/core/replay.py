"""The placement in force at every step of a replayed trace: each plan, scheduled or early.

    blocks = replay_policy(trace, initial, steps, window, "default", kw, shift_threshold=0.05)
    [(b.start, b.end, b.lead) for b in blocks]     # steps each placement serves

`replay_policy` plans at each scheduled step on the window before it, out of sample, with
the placement in force as `previous`, and (shift-aware) checks between plans for a load
shift with the runtime's `planning.ShiftState`, starting at most one early rebalance per
interval. `oracle_blocks` plans on the very steps each placement serves. Both return
`Block`s; `eplb.core.simulate` scores them in balance, `eplb.core.scale` in tokens/s.
Pure numpy (plus the policies): same inputs, same result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.core.planning import (DEFAULT_MIN_GAIN, ShiftState, SteadyMemory, drifting, plan, plan_tolerance,
                                sampling_gap, worth_moving)
from eplb.core.policy.base import DEFAULT_MOVE_TOLERANCE
from eplb.core.transfer_plan import transfer_stats
from eplb.core.trend import DriftTrend

@dataclass(frozen=True)
class RebalanceRecord:
    """One rebalance of one policy."""

    step: int  # first step the new placement serves
    slots_changed: int  # slots whose expert changed (copies written), all layers
    experts_moved: int  # remote expert receives (an expert received once per rank), all layers
    local_copies: int  # changed slots filled from an expert already on the same GPU
    bytes_moved: int | None  # experts_moved * bytes_per_expert, if given
    seconds_plan: float
    predicted: float  # in-sample imbalance on the load planned on (window, + memory / trend), placement after
    predicted_gain: float = 0.0  # balancedness of the plan minus the placement in force, on the window
    skipped: bool = False  # the plan gained less than min_gain: nothing moved
    shifted: bool = False  # a load shift was detected: planned with move tolerance 0
    early: bool = False  # an early rebalance between the scheduled ones (after a shift)
    move_tolerance: float | None = None  # what it planned with (0 after a shift or on a drift); None: not recorded
    steady_layers: int = 0  # layers planned with earlier steady windows (`SteadyMemory`)
    trend_layers: int = 0  # layers planned on the window's trend (`DriftTrend`)

    def to_dict(self) -> dict:
        return {"step": self.step, "slots_changed": self.slots_changed,
                "experts_moved": self.experts_moved, "local_copies": self.local_copies,
                "bytes_moved": self.bytes_moved, "seconds_plan": self.seconds_plan,
                "predicted_imbalance": self.predicted, "predicted_gain": self.predicted_gain,
                "skipped": self.skipped, "shifted": self.shifted, "early": self.early,
                "move_tolerance": self.move_tolerance, "steady_layers": self.steady_layers,
                "trend_layers": self.trend_layers}


def rebalance_steps(num_steps: int, interval: int, start: int) -> list[int]:
    """Steps at which a plan is made (the first step each new placement serves)."""
    return list(range(start, num_steps, interval))


def decay_weights(n: int, decay: float) -> np.ndarray:  # [n], index 0 = newest step
    return decay ** np.arange(n, dtype=np.float64)


def window_load(trace: np.ndarray, step: int, window: int, decay: float = 1.0) -> np.ndarray:  # [L, N]
    """What a recorder holds just before `step`: steps `[step - window, step)`, the one k
    steps older than the newest weighted by decay**k (as `LoadRecorder.window_load`)."""
    lo = max(0, step - window)
    recent = trace[lo:step][::-1]  # [w, L, N], newest first
    return np.tensordot(decay_weights(len(recent), decay), recent, axes=1)


def step_imbalance(loads: np.ndarray, placement: Placement) -> np.ndarray:  # [K, L, N] -> [K, L]
    """max/mean GPU load per step and layer (1.0 where a layer has no load), as planeval."""
    p2l = placement.physical_to_logical  # [L, P]
    L, P = p2l.shape
    M = placement.num_gpus
    per_slot = loads[:, np.arange(L)[:, None], p2l] * placement.slot_shares()[None]  # [K, L, P]
    gpu = per_slot.reshape(len(loads), L, M, P // M).sum(-1)  # [K, L, M]
    mean = gpu.mean(-1)  # [K, L]
    out = np.ones(mean.shape)
    ok = mean > 0
    out[ok] = gpu.max(-1)[ok] / mean[ok]
    return out


@dataclass(frozen=True)
class Block:
    """Steps `[start, end)` served by `placement`, and the rebalance that put it in force."""

    start: int
    end: int
    placement: Placement
    previous: Placement  # the placement in force before `start`
    record: RebalanceRecord | None = None  # None for oracle blocks
    lead: float = 0.0  # share of step `start` still served by `previous` (a shift check within it)


def block_imbalance(trace: np.ndarray, block: Block) -> np.ndarray:  # -> [end - start, L]
    """max/mean GPU load of the steps `block` serves; its first step is the `lead`-weighted
    mix of `previous` and `placement` when the rebalance landed within it (the step's time
    is the slowest GPU's, so the two parts add in proportion)."""
    out = step_imbalance(trace[block.start:block.end], block.placement)
    if block.lead > 0:
        before = step_imbalance(trace[block.start:block.start + 1], block.previous)[0]
        out[0] = block.lead * before + (1 - block.lead) * out[0]
    return out


def check_points(check_every: float) -> np.ndarray:  # [K]
    """The fractions of a trace step at which shift checks run when one runs every
    `check_every` of a step: check_every, 2 check_every, ..., 1."""
    k = int(np.ceil(1 / check_every - 1e-9))
    return np.append(np.arange(1, k) * check_every, 1.0)


def _replay_blocks(trace: np.ndarray, initial: Placement, steps: Sequence[int],
                   plan_block: Callable[[int, int, Placement], tuple[Placement, RebalanceRecord | None]],
                   progress: Callable[[], None] | None) -> list[Block]:
    """One Block per plan at each of `steps`, serving up to the next (the last to the end of
    `trace [T, L, N]`): `plan_block(start, end, current)` gives the placement put in force
    and its record, `current` being the placement in force before `start`."""
    ends = list(steps[1:]) + [trace.shape[0]]
    blocks: list[Block] = []
    current = initial
    for s, e in zip(steps, ends):
        new, record = plan_block(s, e, current)
        blocks.append(Block(s, e, new, current, record))
        current = new
        if progress:
            progress()
    return blocks


def replay_policy(trace: np.ndarray, initial: Placement, steps: Sequence[int], window: int,
                  name: str, plan_kwargs: dict, decay: float = 1.0,
                  min_gain: float = DEFAULT_MIN_GAIN, bytes_per_expert: int | None = None,
                  progress: Callable[[], None] | None = None,
                  shift_threshold: float = 0.0, check_every: float | None = 1.0,
                  tokens_per_step: float | None = None, steady_windows: int = 0,
                  drift_trend: bool = False) -> list[Block]:
    """Policy `name` replanning at each of `steps` on the last `window` steps of `trace
    [T, L, N]` with the placement in force as `previous` (out of sample); one Block per
    plan, skipped plans (gain below `min_gain`) keeping the placement in force.

    `shift_threshold` > 0 makes the replay shift-aware, as the runtime
    (`EplbConfig.shift_threshold`, decided by `planning.ShiftState`): at a scheduled
    plan, when the placement in force balances the steps recorded since the last plan
    (at most `window`) worse than that plan predicted, beyond the noise of earlier
    checks, the plan uses move tolerance 0; and every `check_every` of a step served, the
    same check on the load served since the last plan may start one early rebalance per
    interval (bounded rate), planned with tolerance 0 on that load only (the load since the
    shift). A scheduled plan on a drifting load also uses tolerance 0
    (`planning.plan_tolerance`: the variation of the last checks above the move tolerance
    plus the routing noise of the window, counted from the trace's own counts, which
    carry the trace's noise whatever `tokens_per_step` says). 0: the schedule alone.

    `check_every`: the share of a trace step between two checks, as the runtime checks
    every `control_interval` model steps and a trace step stands for many (`eplb.core.scale`:
    `control_interval * interval / serving_steps`). 1 = after each whole step (a trace step
    is one model step); a check within step u that finds a shift puts the new placement in
    force for the rest of u (`Block.lead`: the share served before). The part of a step
    checked counts as that share of the step's load. None: no early rebalances (the
    runtime's `control_interval` 0), shift-aware scheduled plans only.

    `tokens_per_step`: the token-expert choices per layer one trace step stands for, which
    set the routing noise of a check (`planning.sampling_gap`); None: the trace's counts
    are the tokens (a trace recorded step by step).

    `steady_windows`: shift-aware, a scheduled plan on a steady load (no shift, no drift)
    plans on its window plus up to that many windows of the earlier steady plans
    (`planning.SteadyMemory`, as the runtime's `EplbConfig.steady_windows`); 0: its
    window alone. One difference: the runtime also requires the window to share no step
    with the last plan's (`LoadRecorder.window_is_new`), so after an early rebalance less
    than a window before a scheduled one, the runtime plans that scheduled one on its
    window alone where the replay may add the remembered ones.

    `drift_trend`: shift-aware, a scheduled plan (not after a shift) whose window the last
    plan did not see plans on the window's trend in the layers where the last trend
    predicted well (a drifting load: `trend.DriftTrend`, as the runtime's
    `EplbConfig.drift_trend`; plain sums only, `decay` 1); False: on the window."""
    if check_every is not None and not 0 < check_every <= 1:
        raise ValueError(f"check_every must be in (0, 1] (a share of a step) or None, got {check_every!r}")
    M, P = initial.num_gpus, initial.num_slots
    T = trace.shape[0]
    made: list[tuple[int, Placement, Placement, RebalanceRecord, float]] = []
    current, since, state = initial, 0, ShiftState()
    gap = int(np.min(np.diff(steps))) if len(steps) > 1 else window  # the interval between plans
    memory = SteadyMemory(steady_windows if shift_threshold > 0 and SteadyMemory.applies(window, gap, decay) else 0)
    trend = DriftTrend(on=DriftTrend.applies(drift_trend, shift_threshold, decay))
    points = check_points(check_every) if check_every is not None else np.zeros(0)  # [K]

    def plan_at(s: int, load: np.ndarray, shifted: bool, early: bool, lead: float = 0.0,
                moment: np.ndarray | None = None, steps: int = 0) -> None:  # load, moment [L, N]
        nonlocal current, since, state, memory, trend
        t0 = time.perf_counter()
        variation = state.variation  # None before any check (shift detection off): no drift rule
        window_noise = 0.0 if variation is None else sampling_gap(current.gpu_loads(load))  # the trace's counts
        tolerance = plan_kwargs.get("move_tolerance", DEFAULT_MOVE_TOLERANCE)
        tol = plan_tolerance(shifted, tolerance, variation, window_noise)
        drift = drifting(tolerance, variation, window_noise)
        steady = not (shifted or early or drift)
        window = load  # [L, N]
        load, memory, remembered = memory.plan(window, steady)  # [L, N] the window, plus earlier ones when steady
        # the window's trend, in the layers where the last one predicted well (a drift)
        load, trend, on_trend = trend.plan(window, load, moment, steps, (steps + gap) / 2.0, not (shifted or early),
                                           drift)
        planned = plan(load, M, P, policy=name, previous=current, **dict(plan_kwargs, move_tolerance=tol))
        move, gain = worth_moving(current, planned, load, min_gain)
        new = planned if move else current
        seconds = time.perf_counter() - t0
        st = transfer_stats(current.physical_to_logical, new.physical_to_logical, M, bytes_per_expert)
        balance = new.balancedness(load)  # [L] mean / max GPU load on the load planned on (window + memory / trend)
        rec = RebalanceRecord(s, st.slots_changed, st.experts_moved, st.local_copies, st.bytes_moved,
                              seconds, float(np.mean(1.0 / balance)), gain, not move, shifted, early, tol,
                              int(remembered.sum()), int(on_trend.sum()))
        made.append((s, new, current, rec, lead))  # (start, placement, previous, record, lead)
        since = s  # checks measure from the last plan on (applied or skipped), as the runtime
        current, state = new, state.planned(float(np.mean(balance)))
        if progress:
            progress()

    def measured(load: np.ndarray, steps: float) -> tuple[float, float]:  # load [L, N] over `steps` steps
        """(balancedness of the placement in force on `load`, its routing noise)."""
        gpu = current.gpu_loads(load)  # [L, M]
        if tokens_per_step is not None:  # as token counts of the model steps it stands for
            total = load.sum(1, keepdims=True)  # [L, 1]
            gpu = np.divide(gpu * tokens_per_step * steps, total, out=np.zeros_like(gpu), where=total > 0)
        return float(np.mean(balancedness_of_gpu_loads(gpu))), sampling_gap(gpu)

    def early_check(s: int, e: int) -> None:  # checks while steps [s, e) are served
        served = np.zeros(trace.shape[1:])  # [L, N] the whole steps served since the plan
        for u in range(s, e):  # step u being served
            for frac in points:
                if frac == 1.0 and u + 1 >= e:
                    return  # the check after the block's last step is the next scheduled plan's
                load = served + frac * trace[u]  # [L, N] served since the plan
                if state.shifted(*measured(load, (u - s) + frac), shift_threshold):
                    if frac == 1.0:  # after the whole step: the next step starts on the new placement
                        plan_at(u + 1, load, shifted=True, early=True)
                    else:
                        plan_at(u, load, shifted=True, early=True, lead=float(frac))
                    return  # one early rebalance per interval
            served = served + trace[u]

    ends = list(steps[1:]) + [T]
    for s, e in zip(steps, ends):
        shifted = False
        lo = max(since, s - window)
        if shift_threshold > 0 and lo < s:
            got, noise = measured(trace[lo:s].sum(0), s - lo)
            shifted = state.shifted(got, noise, shift_threshold)
            state = state.checked(got, noise, shifted)
        moment, n = None, 0
        if trend.on and s - window >= since:  # a window the last plan did not see: its trend
            recent = trace[max(0, s - window):s]  # [n, L, N] oldest first
            n = len(recent)
            age = np.arange(n - 1, -1, -1, dtype=np.float64)  # [n] 0 for the newest step
            moment = np.tensordot(age, recent, 1)  # [L, N] as LoadRecorder.window_load(moment=True)
        plan_at(s, window_load(trace, s, window, decay), shifted, early=False, moment=moment, steps=n)
        if shift_threshold > 0:
            early_check(s, e)
    ends = [m[0] for m in made[1:]] + [T]
    return [Block(s, e, new, old, rec, lead) for (s, new, old, rec, lead), e in zip(made, ends)]


def oracle_blocks(trace: np.ndarray, initial: Placement, steps: Sequence[int], name: str,
                  plan_kwargs: dict, progress: Callable[[], None] | None = None) -> list[Block]:
    """Policy `name` planning from scratch at each of `steps` on the very steps the plan
    will serve (`[s, next s)`): perfect foresight, the bound on what prediction can give."""
    M, P = initial.num_gpus, initial.num_slots

    def plan_block(s: int, e: int, current: Placement) -> tuple[Placement, None]:
        return plan(trace[s:e].sum(0), M, P, policy=name, previous=None, **plan_kwargs), None

    return _replay_blocks(trace, initial, steps, plan_block, progress)


__all__ = ["Block", "RebalanceRecord", "block_imbalance", "check_points", "decay_weights", "oracle_blocks",
           "rebalance_steps", "replay_policy", "step_imbalance", "window_load"]
