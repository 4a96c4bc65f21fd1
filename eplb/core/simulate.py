"""Offline replay of a measured load trace: how well would a policy have balanced it?

    result = simulate(trace, num_gpus=16, num_slots=80, window=1, interval=1,
                      policies=("deepseek", "default"))
    result.policies["default"].summary()["mean"]      # out-of-sample max/mean GPU load

`trace [T, L, N]` holds per-step logical expert counts. Starting from the start-up
placement (slot p holds expert p % N, `Placement.initial`), each policy replans at steps
`start, start + interval, ...` on the last `window` steps before that step, weighted
like `LoadRecorder.window_load(decay=...)` (a step k steps older than the newest counts
decay**k), with `previous` = the placement in force. Every step is scored with the
placement in force *when it runs*, a placement planned on earlier steps only, so the
figures are out-of-sample. The score of a step is max/mean GPU load per layer, the
definition of `shared/tools/planeval.py` (tokens of an expert split evenly over its
replicas unless the placement carries per-slot shares), then averaged over layers.

Two references come with every run, scored on the same steps:

- `none`: the start-up placement, never rebalanced (what no balancer gives);
- `oracle`, per policy: at each rebalance the policy plans from scratch on the very steps
  that placement will serve (the block `[s, s + interval)`), i.e. with perfect foresight.
  The gap between a policy and its oracle is what imperfect prediction costs.

Pure numpy (plus the policies): no torch.distributed, nothing random; same inputs, same
result. It returns data only: the table and the plot of `eplb simulate` are
eplb.ops.simulate_report's and eplb.ops.plots'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from eplb.core.placement import Placement
from eplb.core.planning import (DEFAULT_MIN_GAIN, DEFAULT_SHIFT_THRESHOLD, DEFAULT_STEADY_WINDOWS, check_bool,
                                check_load_decay, check_min_gain, check_move_tolerance, check_steady_windows,
                                check_topology, positive_int)
from eplb.core.policy.base import DEFAULT_MOVE_TOLERANCE
from eplb.core.policy.registry import get_policy
from eplb.core.replay import (RebalanceRecord, block_imbalance, decay_weights, oracle_blocks, rebalance_steps,
                              replay_policy, step_imbalance, window_load)
from eplb.core.trend import DEFAULT_DRIFT_TREND
from eplb.core.workload import check_trace

RESERVED_NAMES = ("none", "oracle")


@dataclass
class PolicyResult:
    """Per-step scores of one policy (or a reference) over the whole trace."""

    name: str
    layer_imbalance: np.ndarray  # [T, L] max/mean GPU load per step and layer
    start: int  # first scored step: the summaries cover steps [start, T)
    total_slots: int  # L * P, to express moves as a fraction
    rebalances: list[RebalanceRecord] = field(default_factory=list)

    @property
    def imbalance(self) -> np.ndarray:  # [T] per step, mean over layers
        return self.layer_imbalance.mean(1)

    @property
    def scored(self) -> np.ndarray:  # [T - start]
        return self.imbalance[self.start:]

    def summary(self) -> dict:
        """Out-of-sample figures over the scored steps, and the cost of the rebalances."""
        s = self.scored
        out: dict[str, Any] = {
            "mean": float(s.mean()), "median": float(np.median(s)),
            "p95": float(np.percentile(s, 95)), "max": float(s.max()),
            "steps_scored": int(s.size), "rebalances": len(self.rebalances),
            "skipped": sum(r.skipped for r in self.rebalances),
        }
        if self.rebalances:
            r = self.rebalances
            moved = np.array([x.slots_changed for x in r], dtype=np.float64)
            out.update({
                "slots_changed_mean": float(moved.mean()),
                "slots_changed_pct": float(100 * moved.mean() / self.total_slots),
                "experts_moved_mean": float(np.mean([x.experts_moved for x in r])),
                "local_copies_mean": float(np.mean([x.local_copies for x in r])),
                "bytes_moved_mean": (None if r[0].bytes_moved is None
                                     else float(np.mean([x.bytes_moved for x in r]))),
                "plan_ms_median": float(1e3 * np.median([x.seconds_plan for x in r])),
                "predicted_mean": float(np.mean([x.predicted for x in r])),
                # how shift-aware planning planned (`replay_policy`): early rebalances after a
                # shift, plans with move tolerance 0 (after a shift or on a drift), and the
                # share of layer plans that added earlier steady windows or used the drift trend
                "early": sum(x.early for x in r),
                "tolerance_zero": sum(x.move_tolerance == 0.0 for x in r),
                "steady_layer_share": float(np.mean([x.steady_layers for x in r]) / self.layer_imbalance.shape[1]),
                "trend_layer_share": float(np.mean([x.trend_layers for x in r]) / self.layer_imbalance.shape[1]),
            })
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "summary": self.summary(),
                "imbalance": self.imbalance.round(6).tolist(),
                "layer_imbalance_mean": self.layer_imbalance[self.start:].mean(0).round(6).tolist(),
                "rebalances": [r.to_dict() for r in self.rebalances]}


@dataclass
class SimulationResult:
    config: dict
    policies: dict[str, PolicyResult]  # planned, out-of-sample
    none: PolicyResult  # the start-up placement, never changed
    oracle: dict[str, PolicyResult]  # per policy, planned on the scored block itself

    def to_dict(self) -> dict:
        return {"config": self.config,
                "policies": {k: v.to_dict() for k, v in self.policies.items()},
                "none": self.none.to_dict(),
                "oracle": {k: v.to_dict() for k, v in self.oracle.items()}}

def simulate(
    trace: Any,
    num_gpus: int,
    num_slots: int,
    window: int,
    interval: int,
    policies: Sequence[str] = ("default",),
    num_nodes: int = 1,
    num_groups: int = 1,
    decay: float = 1.0,
    move_tolerance: float = DEFAULT_MOVE_TOLERANCE,
    weighted: bool = False,
    min_gain: float = DEFAULT_MIN_GAIN,
    bytes_per_expert: int | None = None,
    start: int | None = None,
    oracle: bool = True,
    progress: Callable[[], None] | None = None,
    shift_threshold: float = DEFAULT_SHIFT_THRESHOLD,
    steady_windows: int = DEFAULT_STEADY_WINDOWS,
    drift_trend: bool = DEFAULT_DRIFT_TREND,
) -> SimulationResult:
    """Replay `trace [T, L, N]` under each policy; see the module docstring.

    `start` is the first rebalance step (default `interval`, as the runtime's first
    scheduled rebalance; at least 1). Summaries cover steps `[start, T)`: steps before it
    run on the start-up placement under every policy. `min_gain`: as `EplbConfig.min_gain`,
    a plan that raises the window's predicted balancedness by less is not applied (a
    skipped rebalance, counted in the summary); the oracles ignore it. `oracle=False` skips
    the oracle references (they double the planning work). `progress()` is called after
    every plan. `shift_threshold`: as `EplbConfig.shift_threshold`, shift-aware
    rebalancing (see `replay_policy`), checked after every step; 0 turns it off. Its checks
    take the trace's values as token counts to weigh routing noise
    (`planning.sampling_gap`): a trace of shares (rows summing to 1) looks like a handful
    of tokens, and no drop clears that noise. `steady_windows`: as
    `EplbConfig.steady_windows`, earlier windows a plan on a steady load adds (shift-aware
    only; 0: the window alone). `drift_trend`: as `EplbConfig.drift_trend`, a plan on a
    drifting load uses the window's trend where it predicted well (shift-aware only).
    """
    trace = check_trace(trace)
    T, L, N = trace.shape
    M = positive_int(num_gpus, "num_gpus")
    P = positive_int(num_slots, "num_slots")
    num_nodes = positive_int(num_nodes, "num_nodes")
    num_groups = positive_int(num_groups, "num_groups")
    window = positive_int(window, "window")
    interval = positive_int(interval, "interval")
    check_topology(N, M, P, num_nodes, num_groups)
    check_load_decay(decay)
    move_tolerance = check_move_tolerance(move_tolerance)
    min_gain = check_min_gain(min_gain)
    shift_threshold = check_min_gain(shift_threshold, "shift_threshold")
    steady_windows = check_steady_windows(steady_windows)
    drift_trend = check_bool(drift_trend, "drift_trend")
    if bytes_per_expert is not None and (isinstance(bytes_per_expert, bool)
                                         or not isinstance(bytes_per_expert, int) or bytes_per_expert < 0):
        raise ValueError(f"bytes_per_expert must be an int >= 0, got {bytes_per_expert!r}")
    start = interval if start is None else positive_int(start, "start")
    if start >= T:
        raise ValueError(f"the trace has {T} steps, so nothing is left to score after the first "
                         f"plan at step {start} (interval {interval}); use a smaller interval or start, "
                         f"or a longer trace")
    if isinstance(policies, str):
        policies = (policies,)
    try:
        policies = list(policies)
    except TypeError:
        raise ValueError(f"policies must be a list of policy names, got {policies!r}") from None
    if not policies:
        raise ValueError("give at least one policy")
    for name in policies:
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is a reference figure, always reported; not a policy name")
        get_policy(name)  # unknown names fail here, before any work
    if len(set(policies)) != len(policies):
        raise ValueError(f"policy listed twice: {policies}")

    steps = rebalance_steps(T, interval, start)
    initial = Placement.initial(L, N, P, M, num_nodes)
    kw = dict(num_nodes=num_nodes, num_groups=num_groups, move_tolerance=float(move_tolerance),
              weighted=bool(weighted))
    config = {"steps": T, "layers": L, "experts": N, "num_gpus": M, "num_slots": P,
              "num_nodes": num_nodes, "num_groups": num_groups, "window": window,
              "interval": interval, "start": start, "decay": float(decay),
              "move_tolerance": float(move_tolerance), "weighted": bool(weighted),
              "min_gain": min_gain, "shift_threshold": shift_threshold,
              "steady_windows": steady_windows, "drift_trend": drift_trend,
              "bytes_per_expert": bytes_per_expert, "policies": policies,
              "rebalance_steps": steps}

    none_scores = step_imbalance(trace, initial)  # [T, L]
    none = PolicyResult("none", none_scores, start, L * P)

    results: dict[str, PolicyResult] = {}
    oracles: dict[str, PolicyResult] = {}
    for name in policies:
        scores = none_scores.copy()  # [T, L]; steps before `start` keep the start-up placement
        res = PolicyResult(name, scores, start, L * P)
        for block in replay_policy(trace, initial, steps, window, name, kw, decay=decay,
                                   min_gain=min_gain, bytes_per_expert=bytes_per_expert,
                                   progress=progress, shift_threshold=shift_threshold,
                                   steady_windows=steady_windows, drift_trend=drift_trend):
            res.rebalances.append(block.record)
            scores[block.start:block.end] = block_imbalance(trace, block)
        results[name] = res
        if oracle:
            o_scores = none_scores.copy()
            for block in oracle_blocks(trace, initial, steps, name, kw, progress=progress):
                o_scores[block.start:block.end] = step_imbalance(trace[block.start:block.end],
                                                                 block.placement)
            oracles[name] = PolicyResult(f"oracle:{name}", o_scores, start, L * P)
    return SimulationResult(config, results, none, oracles)


def aggregate_steps(trace: np.ndarray, every: int) -> np.ndarray:  # [T, L, N] -> [T // every, L, N]
    """Sum every `every` consecutive steps into one; the last `T % every` steps are dropped
    (a partial step would be a smaller batch than the others)."""
    every = positive_int(every, "aggregate")
    T = trace.shape[0]
    if every > T:
        raise ValueError(f"aggregate {every} is more than the trace's {T} steps")
    n = T // every
    return trace[:n * every].reshape(n, every, *trace.shape[1:]).sum(1)


__all__ = ["PolicyResult", "RebalanceRecord", "SimulationResult", "aggregate_steps", "decay_weights",
           "rebalance_steps", "simulate", "step_imbalance", "window_load"]  # the replay's names, re-exported
