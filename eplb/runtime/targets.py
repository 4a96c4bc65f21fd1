"""What a rebalance moves to, and the figures its event reports. `RebalanceTargets` reads
the recorded window (one all-reduce on the step loop per plan; with shift detection on,
the default, a scheduled plan adds a small one of the steps since the last plan, and each
shift check makes one), and
returns the `plan_fn` a `PlacementChange` calls (in the rebalance thread in asynchronous
mode) together with the `info` dict that `plan_fn` fills: "load" [L, N] (what the
planner sees: the window, plus earlier steady windows), "before" [L] (balancedness
measured from the per-GPU window), "predicted_gain", "skipped" (and "skip_reason"),
"seconds_plan"; `EplbRuntime._finished` builds the RebalanceEvent from it.

A planned rebalance (`planned`): rank 0 plans (`Rank0Planner`), every rank gets the plan,
and `worth_moving` (the same verdict on every rank) keeps the placement in force when the
plan gains less than `min_gain`. A given placement (`given`, `apply_placement`) is moved to
as it is. Shift detection (`EplbConfig.shift_threshold`, `shift_now`) keeps the
`ShiftState` the simulator keeps, and bounds early rebalances to one between two others;
on a steady load plans add earlier windows (`EplbConfig.steady_windows`, the simulator's
`SteadyMemory`).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from eplb.core.config import EplbConfig
from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.core.planning import (ShiftState, SteadyMemory, drifting, plan_tolerance, predicted_gain, sampling_gap,
                                worth_moving)
from eplb.core.trend import DriftTrend
from eplb.runtime.events import NO_LOAD
from eplb.runtime.plan_broadcast import Rank0Planner
from eplb.runtime.recorder import LoadRecorder
from eplb.runtime.share_routing import ShareRouting

__all__ = ["RebalanceTargets"]


class RebalanceTargets:
    """The targets of one runtime's rebalances. `group`: the EP group the window is
    all-reduced on; `routing`: how the model realises a placement's shares (the
    predictions are made on what it routes). Each call takes the runtime's `config` as it
    is then (a caller may replace it between rebalances)."""

    def __init__(self, recorder: LoadRecorder, planner: Rank0Planner, group,
                 device: torch.device, routing: ShareRouting) -> None:
        self.recorder = recorder
        self.planner = planner
        self.group = group
        self.device = device
        self.routing = routing
        self.shift = ShiftState()  # the same state as the simulator's
        self.early_used = False  # an early (shift) rebalance ran since the last other plan
        self.memory = SteadyMemory()  # windows of earlier steady plans (rank 0's copy plans)
        self.trend = DriftTrend()  # the last scheduled plan's trend, window and layers on it (every rank)

    def shift_now(self, config: EplbConfig) -> bool:
        """Shift-aware early rebalance: whether the load recorded since the last plan shows
        a shift (`ShiftState.shifted`, the same decision as the simulator's), at most once
        between two other rebalances. Collective when it checks: one all-reduce of the
        window and one host read, every `control_interval` steps while a plan's prediction
        is known."""
        thr = config.shift_threshold
        steps = self.recorder.steps_since_plan
        if not thr or self.early_used or self.shift.predicted is None or steps < 1:
            return False  # the same on every rank: config, step counts and the state agree
        _, gpu = self.recorder.window_load(self.group, since_plan=True)  # [L, M] all-reduced
        gpu = gpu.cpu().numpy()
        measured = float(np.mean(balancedness_of_gpu_loads(gpu)))
        return self.shift.shifted(measured, sampling_gap(gpu), thr)

    def planned(self, trigger: str, request_ids: list[int], placement: Placement, plan_group,
                config: EplbConfig) -> tuple[Callable[[], Placement], dict]:
        """A rebalance planned on the recorded window, from `placement` (in force), rank 0
        planning over `plan_group`. A plan that gains less than `config.min_gain` keeps
        `placement` (skipped); an all-zero window is not planned on at all (skipped,
        reason NO_LOAD)."""
        info = {"request_ids": request_ids, "t_start": time.perf_counter(), "trigger": trigger,
                "steps": self.recorder.steps_since_plan}
        early = trigger == "shift"  # plans on the load since the last plan, with tolerance 0
        self.early_used = early  # the bounded rate: one early rebalance between two other plans
        read_window = self._window_reader(info, config, since_plan=early)  # collective: the all-reduce
        # the window shares no step with the last plan's (SteadyMemory adds disjoint windows only)
        window_is_new = self.recorder.window_is_new
        self.recorder.on_plan()  # shift detection measures from this plan on
        realised = self.routing.realised

        def plan_fn() -> Placement:
            t0 = time.perf_counter()
            read_window()
            if not info["load"].any():  # all-reduced: the same verdict on every rank
                info.update(skipped=True, skip_reason=NO_LOAD, predicted_gain=0.0,
                            seconds_plan=time.perf_counter() - t0)
                return placement
            steps = info["steps"]
            measured, noise = float(np.mean(info["measured"])), info["sampling"]
            shifted = early or self.shift.shifted(measured, noise, config.shift_threshold)
            if not early and steps > 0:  # a gap needs load measured since the last plan
                self.shift = self.shift.checked(measured, noise, shifted)
            info["shifted"] = shifted
            variation = self.shift.variation if config.shift_threshold > 0 else None  # 0: detection off
            # the routing noise of the recorded counts: only the drift rule reads it
            window_noise = 0.0 if variation is None else sampling_gap(realised(placement).gpu_loads(info["load"]))
            tol = plan_tolerance(shifted, config.move_tolerance, variation, window_noise)
            info["move_tolerance"] = tol
            keep = config.steady_windows if config.shift_threshold > 0 and SteadyMemory.applies(
                config.window_size, config.rebalance_interval, config.load_decay) else 0
            drift = drifting(config.move_tolerance, variation, window_noise)
            steady = window_is_new and not (shifted or drift)
            memory = SteadyMemory(keep, self.memory.windows)
            window = info["load"]  # [L, N]
            load, self.memory, remembered = memory.plan(window, steady)  # [L, N] the window (+ earlier ones)
            info["steady_layers"] = int(remembered.sum())
            # the window's trend, in the layers where the last one predicted well (a drift)
            n = info.get("window_steps", 0)
            trend = DriftTrend(_trend_on(config), self.trend.last)
            load, self.trend, used = trend.plan(window, load, info.get("moment"), n,
                                                (n + config.rebalance_interval) / 2.0, window_is_new and not shifted,
                                                drift)
            info["trend_layers"] = int(used.sum())
            info["load"] = load  # what the planner sees, and what the event's figures are on
            planned = self.planner.plan(load, placement, plan_group, move_tolerance=tol,
                                        step_choices=info["step_choices"])
            # the same decision on every rank: same broadcast plan, same all-reduced load
            move, info["predicted_gain"] = worth_moving(
                realised(placement), realised(planned), load, config.min_gain)
            info["skipped"] = not move
            info["seconds_plan"] = time.perf_counter() - t0
            chosen = planned if move else placement
            self.shift = self.shift.planned(np.mean(realised(chosen).balancedness(info["load"])))
            return chosen

        return plan_fn, info

    def given(self, old: Placement, new: Placement, trigger: str, config: EplbConfig, *,
              before: np.ndarray | None, load: np.ndarray | None,
              seconds_plan: float) -> tuple[Callable[[], Placement], dict]:
        """A move from `old` to `new` as it is (`apply_placement`): its figures on `load`
        [L, N] and `before` [L] when given, else on the recorded window (collective)."""
        info = {"request_ids": [], "t_start": time.perf_counter(), "trigger": trigger,
                "seconds_plan": seconds_plan}
        if load is None:  # report on the recorded window, like a planned rebalance
            read_window = self._window_reader(info, config)  # collective
        else:
            info["load"] = np.asarray(load, dtype=np.float64)  # [L, N]
            info["before"] = before  # [L] or None: predicted on `load` (see _finished)
            read_window = lambda: None  # noqa: E731
        realised = self.routing.realised

        def plan_fn() -> Placement:
            read_window()
            info["predicted_gain"] = predicted_gain(realised(old), realised(new), info["load"])
            return new

        return plan_fn, info

    def _window_reader(self, info: dict, config: EplbConfig,
                       since_plan: bool = False) -> Callable[[], None]:
        """All-reduce the recorded window now (a collective, on the step loop) and return
        the function that fills `info` from it on the host: "load" [L, N], "before" [L],
        "measured" [L] and "sampling" (for shift detection: the balancedness of the steps
        since the last plan, and their routing noise), and "step_choices" (token-expert
        choices per step and layer, what decode-aware packing sets weight reads against:
        the load over the steps it covers). In
        asynchronous mode that function runs in the rebalance thread, after the
        all-reduce's kernels, so the step loop never waits for the copy."""
        with_moment = _trend_on(config) and not since_plan  # a drifting load's trend, in the same all-reduce
        logical, gpu, *moment = self.recorder.window_load(self.group, decay=config.load_decay,
                                                          since_plan=since_plan, moment=with_moment)  # [L, N], [L, M]
        window_steps = self.recorder.fill
        steps = self.recorder.window_steps(config.load_decay, since_plan)
        recent = gpu  # [L, M]  (one more small all-reduce when it differs)
        if not since_plan and config.shift_threshold:
            recent = self.recorder.window_load(self.group, since_plan=True)[1]
        window_done = None
        if self.device.type == "cuda":  # read() may run on another thread and stream
            window_done = torch.cuda.Event()
            window_done.record(torch.cuda.current_stream(self.device))

        def read() -> None:
            if window_done is not None:
                torch.cuda.current_stream(self.device).wait_event(window_done)
            info["load"] = logical.cpu().numpy().astype(np.float64)  # [L, N]
            info["before"] = balancedness_of_gpu_loads(gpu.cpu().numpy())  # [L]
            recent_np = recent.cpu().numpy()  # [L, M] since the last plan
            info["measured"] = balancedness_of_gpu_loads(recent_np)  # [L]
            info["sampling"] = sampling_gap(recent_np)  # its routing noise
            info["step_choices"] = float(info["load"].sum(1).mean()) / steps if steps > 0 else 0.0
            if moment:  # [L, N] the window's counts weighted by step age, over its `window_steps` steps
                info["moment"], info["window_steps"] = moment[0].cpu().numpy().astype(np.float64), window_steps

        return read


def _trend_on(config: EplbConfig) -> bool:
    """Whether plans may use the window's trend (`trend.DriftTrend.applies`)."""
    return DriftTrend.applies(config.drift_trend, config.shift_threshold, config.load_decay)
