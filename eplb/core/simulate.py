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

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.core.planning import (DEFAULT_MIN_GAIN, DEFAULT_SHIFT_THRESHOLD, ShiftState, check_min_gain,
                                check_move_tolerance, check_topology, plan, plan_tolerance, positive_int,
                                sampling_gap, worth_moving)
from eplb.core.policy.base import DEFAULT_MOVE_TOLERANCE
from eplb.core.policy.registry import get_policy
from eplb.core.transfer_plan import transfer_stats
from eplb.core.workload import check_trace

RESERVED_NAMES = ("none", "oracle")


@dataclass(frozen=True)
class RebalanceRecord:
    """One rebalance of one policy."""

    step: int  # first step the new placement serves
    slots_changed: int  # slots whose expert changed (copies written), all layers
    experts_moved: int  # remote expert receives (an expert received once per rank), all layers
    local_copies: int  # changed slots filled from an expert already on the same GPU
    bytes_moved: int | None  # experts_moved * bytes_per_expert, if given
    seconds_plan: float
    predicted: float  # in-sample imbalance: the planning window's load on the placement in force after
    predicted_gain: float = 0.0  # balancedness of the plan minus the placement in force, on the window
    skipped: bool = False  # the plan gained less than min_gain: nothing moved
    shifted: bool = False  # a load shift was detected: planned with move tolerance 0
    early: bool = False  # an early rebalance between the scheduled ones (after a shift)

    def to_dict(self) -> dict:
        return {"step": self.step, "slots_changed": self.slots_changed,
                "experts_moved": self.experts_moved, "local_copies": self.local_copies,
                "bytes_moved": self.bytes_moved, "seconds_plan": self.seconds_plan,
                "predicted_imbalance": self.predicted, "predicted_gain": self.predicted_gain,
                "skipped": self.skipped, "shifted": self.shifted, "early": self.early}


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
                  tokens_per_step: float | None = None) -> list[Block]:
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
    shift). 0: the schedule alone.

    `check_every`: the share of a trace step between two checks, as the runtime checks
    every `control_interval` model steps and a trace step stands for many (`eplb.core.scale`:
    `control_interval * interval / serving_steps`). 1 = after each whole step (a trace step
    is one model step); a check within step u that finds a shift puts the new placement in
    force for the rest of u (`Block.lead`: the share served before). The part of a step
    checked counts as that share of the step's load. None: no early rebalances (the
    runtime's `control_interval` 0), shift-aware scheduled plans only.

    `tokens_per_step`: the token-expert choices per layer one trace step stands for, which
    set the routing noise of a check (`planning.sampling_gap`); None: the trace's counts
    are the tokens (a trace recorded step by step)."""
    if check_every is not None and not 0 < check_every <= 1:
        raise ValueError(f"check_every must be in (0, 1] (a share of a step) or None, got {check_every!r}")
    M, P = initial.num_gpus, initial.num_slots
    T = trace.shape[0]
    made: list[tuple[int, Placement, Placement, RebalanceRecord, float]] = []
    current, since, state = initial, 0, ShiftState()
    points = check_points(check_every) if check_every is not None else np.zeros(0)  # [K]

    def plan_at(s: int, load: np.ndarray, shifted: bool, early: bool, lead: float = 0.0) -> None:  # load [L, N]
        nonlocal current, since, state
        t0 = time.perf_counter()
        tol = plan_tolerance(shifted, plan_kwargs.get("move_tolerance", DEFAULT_MOVE_TOLERANCE))
        planned = plan(load, M, P, policy=name, previous=current, **dict(plan_kwargs, move_tolerance=tol))
        move, gain = worth_moving(current, planned, load, min_gain)
        new = planned if move else current
        seconds = time.perf_counter() - t0
        st = transfer_stats(current.physical_to_logical, new.physical_to_logical, M, bytes_per_expert)
        rec = RebalanceRecord(s, st.slots_changed, st.experts_moved, st.local_copies, st.bytes_moved,
                              seconds, float(step_imbalance(load[None], new).mean()), gain, not move,
                              shifted, early)
        made.append((s, new, current, rec, lead))  # (start, placement, previous, record, lead)
        since = s  # checks measure from the last plan on (applied or skipped), as the runtime
        current, state = new, state.planned(np.mean(new.balancedness(load)))
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
        for u in range(s, e):  # step u being served
            for frac in points:
                if frac == 1.0 and u + 1 >= e:
                    return  # the check after the block's last step is the next scheduled plan's
                load = trace[s:u].sum(0) + frac * trace[u]  # [L, N] served since the plan
                if state.shifted(*measured(load, (u - s) + frac), shift_threshold):
                    if frac == 1.0:  # after the whole step: the next step starts on the new placement
                        plan_at(u + 1, load, shifted=True, early=True)
                    else:
                        plan_at(u, load, shifted=True, early=True, lead=float(frac))
                    return  # one early rebalance per interval

    ends = list(steps[1:]) + [T]
    for s, e in zip(steps, ends):
        shifted = False
        lo = max(since, s - window)
        if shift_threshold > 0 and lo < s:
            got, noise = measured(trace[lo:s].sum(0), s - lo)
            shifted = state.shifted(got, noise, shift_threshold)
            state = state.checked(got, noise, shifted)
        plan_at(s, window_load(trace, s, window, decay), shifted, early=False)
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
) -> SimulationResult:
    """Replay `trace [T, L, N]` under each policy; see the module docstring.

    `start` is the first rebalance step (default `window`, the first step with a full
    window behind it; at least 1). Summaries cover steps `[start, T)`: steps before it
    run on the start-up placement under every policy. `min_gain`: as `EplbConfig.min_gain`,
    a plan that raises the window's predicted balancedness by less is not applied (a
    skipped rebalance, counted in the summary); the oracles ignore it. `oracle=False` skips
    the oracle references (they double the planning work). `progress()` is called after
    every plan. `shift_threshold`: as `EplbConfig.shift_threshold`, shift-aware
    rebalancing (see `replay_policy`), checked after every step; 0 turns it off. Its checks
    take the trace's values as token counts to weigh routing noise
    (`planning.sampling_gap`): a trace of shares (rows summing to 1) looks like a handful
    of tokens, and no drop clears that noise.
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
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
        raise ValueError(f"decay must be in (0, 1], got {decay!r}")
    move_tolerance = check_move_tolerance(move_tolerance)
    min_gain = check_min_gain(min_gain)
    shift_threshold = check_min_gain(shift_threshold, "shift_threshold")
    if bytes_per_expert is not None and (isinstance(bytes_per_expert, bool)
                                         or not isinstance(bytes_per_expert, int) or bytes_per_expert < 0):
        raise ValueError(f"bytes_per_expert must be an int >= 0, got {bytes_per_expert!r}")
    start = interval if start is None else positive_int(start, "start")
    if start >= T:
        raise ValueError(f"the trace has {T} steps, so nothing is left to score after the first "
                         f"plan at step {start} (window {window}); use a smaller window or start, "
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
              "min_gain": min_gain, "shift_threshold": shift_threshold, "bytes_per_expert": bytes_per_expert, "policies": policies,
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
                                   progress=progress, shift_threshold=shift_threshold):
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
           "rebalance_steps", "simulate", "step_imbalance", "window_load"]
