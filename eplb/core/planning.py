"""`plan()`: the one Python call from a measured load to a checked Placement.

It validates the load and the topology once, with errors that say what to change, runs
the named policy (a pure function, see `eplb.core.policy`) and validates what it returns.
Same inputs, same placement: nothing random, nothing read from the environment.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from eplb.core.loadio import MAX_EXPERTS, MAX_SLOTS, as_load
from eplb.core.placement import Placement
from eplb.core.policy.base import DEFAULT_DISPATCH_TOKENS, DEFAULT_MOVE_TOLERANCE, DEFAULT_TILE_ROWS, PolicyOptions
from eplb.core.policy.registry import get_policy


def plan(
    load: Any,
    num_gpus: int,
    num_slots: int,
    num_nodes: int = 1,
    num_groups: int = 1,
    policy: str = "default",
    previous: Placement | None = None,
    *,
    move_tolerance: float = DEFAULT_MOVE_TOLERANCE,
    weighted: bool = False,
    read_tokens: float = 0.0,
    step_choices: float = 0.0,
    dispatch_tokens: float = DEFAULT_DISPATCH_TOKENS,
    tile_rows: float = DEFAULT_TILE_ROWS,
) -> Placement:
    """Compute a placement for `load` ([L, N] or [T, L, N], numpy or torch; T is summed).

    num_slots (P) physical slots per layer spread evenly over num_gpus (M) GPUs on
    num_nodes nodes; num_groups expert groups (DeepSeek's node-limited routing groups).
    `previous` is the placement in use, for policies that limit movement;
    `move_tolerance` is how much extra relative imbalance such a policy may accept to keep
    experts in place; `weighted` asks for per-slot shares (weighted replicas);
    `read_tokens` > 0 makes the planner decode-aware: a slot's weight read costs that many
    tokens whenever the slot gets a token, out of `step_choices` token-expert choices per
    step and layer, and raising the busiest GPU's tokens costs `dispatch_tokens` per token
    (its all-to-all; inf: never raised); a slot reads its weights once per `tile_rows`
    tokens (the grouped GEMM's row tile; 0: once whenever it gets a token)
    (`eplb.core.policy.balanced.reads`).

    An all-zero load (or an all-zero layer) is legitimate, e.g. a window with no traffic:
    it gives a valid placement (every expert has a replica, no division by zero); all
    experts tie, so which one gets the spare slots is the policy's deterministic
    tie-break. A layer whose largest load exceeds 1e30 is first scaled to max 1 (same
    proportions) so sums cannot overflow (policies may compute in float32). Bad input
    raises ValueError.
    """
    fn = get_policy(policy)  # unknown names fail before any work
    load = as_load(load)  # [L, N] float64
    num_layers, num_experts = load.shape
    num_gpus = positive_int(num_gpus, "num_gpus")
    num_slots = positive_int(num_slots, "num_slots")
    num_nodes = positive_int(num_nodes, "num_nodes")
    num_groups = positive_int(num_groups, "num_groups")
    check_topology(num_experts, num_gpus, num_slots, num_nodes, num_groups)
    if previous is not None:
        _check_previous(previous, num_layers, num_experts, num_gpus, num_slots)

    read_tokens = check_read_tokens(read_tokens)
    step_choices = check_read_tokens(step_choices, "step_choices")
    if read_tokens > 0 and step_choices <= 0:
        raise ValueError("read_tokens needs step_choices > 0 (token-expert choices per step and layer)")
    options = PolicyOptions(move_tolerance=check_move_tolerance(move_tolerance), weighted=bool(weighted),
                            read_tokens=read_tokens, step_choices=step_choices,
                            dispatch_tokens=check_dispatch_tokens(dispatch_tokens),
                            tile_rows=check_read_tokens(tile_rows, "tile_rows"))

    big = load.max(axis=1) > _RESCALE_ABOVE  # [L]: sums of such loads could overflow to inf
    if big.any():
        load[big] /= load[big].max(axis=1, keepdims=True)  # same proportions, finite sums
    load.setflags(write=False)  # a policy must not edit its input
    out = fn(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)
    shares = None
    if isinstance(out, tuple):  # (physical_to_logical [L, P], shares [L, P])
        out, shares = out
    p2l = np.asarray(out)  # [L, P]
    if p2l.shape != (num_layers, num_slots):
        raise ValueError(
            f"policy {policy!r} returned shape {p2l.shape}, expected [L, P] = {(num_layers, num_slots)}"
        )
    try:
        return Placement(p2l, num_experts, num_gpus, num_nodes, policy=policy, shares=shares)
    except ValueError as e:
        raise ValueError(f"policy {policy!r} returned an invalid placement: {e}") from None


_RESCALE_ABOVE = 1e30  # layers whose largest load exceeds this are rescaled to max 1 (float32-safe)

DEFAULT_MIN_GAIN = 0.01
"""The least predicted gain in balancedness for which a rebalance moves weights (the same
default as EplbConfig.min_gain; chosen on the shared traces, see benchmarks/README.md)."""


def predicted_gain(current: Placement, planned: Placement, load: np.ndarray) -> float:
    """How much `planned` would raise the balancedness of `load [L, N]` over `current`:
    mean over layers of (mean/max GPU load on planned) - (the same on current). Both are
    predictions on the same load, so routing noise does not count as gain."""
    return float(np.mean(planned.balancedness(load)) - np.mean(current.balancedness(load)))


def worth_moving(current: Placement, planned: Placement, load: np.ndarray,
                 min_gain: float = DEFAULT_MIN_GAIN) -> tuple[bool, float]:
    """(whether to move from `current` to `planned`, the predicted gain): a plan equal to
    `current`, or (with `min_gain` > 0) gaining less than `min_gain` in balancedness on
    `load [L, N]`, moves nothing. `min_gain` 0 turns the gate off: any other plan moves."""
    gain = predicted_gain(current, planned, load)
    return (planned != current and (min_gain == 0 or gain >= min_gain)), gain


DEFAULT_SHIFT_THRESHOLD = 0.05
"""How far (in balancedness, mean over layers) the placement in force may fall below its
plan's prediction, beyond the noise seen on steady load, before the load counts as
shifted (see `ShiftState`); 0 turns shift detection off (benchmarks/README.md, issue 29)."""

NOISE_HISTORY = 3  # gaps of the last checks without a shift that set the noise level


def sampling_gap(gpu_loads: np.ndarray) -> float:
    """How far routing noise alone can lower the balancedness measured on `gpu_loads [L, M]`
    (token counts, not shares), mean over layers: when loads are close, the busiest of M
    GPUs holding X tokens overshoots its expectation by about sqrt(2 ln M X) tokens, so the
    measured balancedness b reads low by up to b sqrt(2 ln M / X). On multinomial draws
    this bounds the gap at their 97.5th percentile (tests/test_shift.py). Layers without
    load count 0 (their balancedness is 1 whatever the noise)."""
    g = np.asarray(gpu_loads, dtype=np.float64)
    M = g.shape[-1]
    mx = g.max(-1)  # [L]
    out = np.zeros(mx.shape)
    ok = mx > 0
    out[ok] = g.mean(-1)[ok] / mx[ok] * np.sqrt(2 * np.log(M) / mx[ok])
    return float(out.mean()) if out.size else 0.0


@dataclass(frozen=True)
class ShiftState:
    """What shift detection remembers between rebalances (pure: every update returns a
    new state). The simulator and the runtime both decide with it, so the replay
    measures what the runtime does.

    A gap is `predicted - measured`: the balancedness (mean over layers of mean/max GPU
    load) the plan in force expected on the load it planned on (its window, with the
    remembered steady windows or the drift trend where those were used), minus what it
    gives on the load recorded since. On a steady load the gap has two parts: the load varying from one
    window to the next (a plan fits its window a little, more so at high EP), and the
    routing noise of the tokens measured (`sampling_gap`: large for a check on few
    tokens, small on many). `noise` keeps the first part, the gap minus its routing
    noise, of the last checks without a shift; the gap expected on a new check is their
    smallest plus the new check's routing noise. A shift is a gap above twice that plus
    `threshold`. The load's variation does not shrink on a short check (the load of a
    few steps is as far from the window as the load of many), its routing noise does
    not either: both are counted as they are. No decision before one gap was measured
    (nothing to compare to)."""

    predicted: float | None = None  # what the plan in force expected; None before a plan
    noise: tuple[float, ...] = ()  # gap minus its routing noise, of the last checks without shift

    def expected_gap(self, sampling: float) -> float | None:
        """The gap expected on a steady load for a check whose routing noise is `sampling`
        (`sampling_gap` of what it measured); None before any check."""
        if not self.noise:
            return None
        return self.variation + float(sampling)

    @property
    def variation(self) -> float | None:
        """How far the load moved away from the plans in force on the last checks without
        a shift, beyond routing noise (the smallest of them, at least 0); None before any
        check. Small on a steady load, large on a load drifting faster than plans follow."""
        if not self.noise:
            return None
        return min(max(g, 0.0) for g in self.noise)

    def shifted(self, measured: float, sampling: float, threshold: float = DEFAULT_SHIFT_THRESHOLD) -> bool:
        """Whether `measured` (balancedness of the placement in force on the load recorded
        since it was put in force, whose routing noise is `sampling`) shows a load shift;
        threshold 0: never."""
        if threshold <= 0 or self.predicted is None or not self.noise:
            return False
        return bool(self.predicted - measured > threshold + 2 * self.expected_gap(sampling))

    def checked(self, measured: float, sampling: float, shifted: bool) -> "ShiftState":
        """The state after a check at a scheduled rebalance: a gap without shift joins
        the noise history, less its routing noise (at most NOISE_HISTORY kept). Call it
        only when load was measured."""
        if self.predicted is None or shifted:
            return self
        noise = (self.noise + (self.predicted - measured - float(sampling),))[-NOISE_HISTORY:]
        return replace(self, noise=noise)

    def planned(self, predicted: float) -> "ShiftState":
        """The state once a plan (or a skipped plan's placement in force) expects `predicted`."""
        return replace(self, predicted=float(predicted))


def plan_tolerance(shifted: bool, move_tolerance: float, variation: float | None = None,
                   window_noise: float = 0.0) -> float:
    """The move tolerance to plan with: 0 (re-plan for balance, whatever it moves) after a
    load shift, or when the load drifts; else `move_tolerance` (keep experts where the load
    is steady). Old layouts are what a shift or a drift makes wrong, so keeping them costs
    most then.

    Drifting: the recent checks all found the plan in force further below its prediction
    (`variation`, `ShiftState.variation`) than `move_tolerance` plus `window_noise`, the
    routing noise of the window it is planned on (`sampling_gap` of its per-GPU counts): a
    plan fits its window's noise, so on a steady load it measures below its prediction by
    up to about that much, and re-planning then only chases noise."""
    return 0.0 if shifted or drifting(move_tolerance, variation, window_noise) else move_tolerance


def drifting(move_tolerance: float, variation: float | None, window_noise: float) -> bool:
    """Whether the load drifts (see `plan_tolerance`); False before any check."""
    return variation is not None and variation > move_tolerance + window_noise


DEFAULT_STEADY_WINDOWS = 2
"""Earlier windows a scheduled plan adds to its own while the load is steady (see
`SteadyMemory`; chosen on the issue 29 replay, benchmarks/README.md); 0 turns it off."""


@dataclass(frozen=True)
class SteadyMemory:
    """The windows of load that scheduled plans planned on while the load stayed steady
    (pure: every update returns a new memory). A plan fits the routing noise of the
    window it is planned on; on a steady load the windows before it show the same
    traffic, so a plan on the window plus `keep` earlier ones rests on more tokens and
    its replica counts and packing fit the next interval better. A shift or a drift
    forgets them (they show the old load), as does any plan that is not steady; a layer
    whose window does not look drawn from the remembered traffic (`same_traffic`: a
    drift too slow for the balance checks, hidden in their noise) forgets its part.

    Only whole windows that do not overlap are added up: it applies when the window is
    not longer than the interval between plans and is not decayed (`applies`)."""

    keep: int = 0  # windows remembered at most; 0 = off
    windows: tuple = ()  # [L, N] loads of earlier steady plans, oldest first

    @staticmethod
    def applies(window: int, interval: int, decay: float) -> bool:
        """Whether windows of `window` steps planned every `interval` steps, weighted by
        `decay`, can be added up: disjoint (window <= interval) and plain sums."""
        return interval > 0 and window <= interval and decay == 1.0

    def plan(self, window: np.ndarray, steady: bool) -> tuple[np.ndarray, "SteadyMemory", np.ndarray]:
        """(what a scheduled plan on `window [L, N]` plans on, the memory after it, [L] bool:
        the layers that add earlier windows). Not `steady` (a shift, a drift): the window
        alone, and everything is forgotten. Steady: the window plus the remembered windows
        of the layers whose window shows the same traffic (`same_traffic`), the others
        forgetting theirs; the window joins them."""
        window = np.asarray(window, dtype=np.float64)
        used = np.zeros(window.shape[0], dtype=bool)  # [L]
        if not steady or self.keep == 0:
            return window, replace(self, windows=()), used
        kept = self.windows
        if kept:
            remembered = np.sum(kept, axis=0)  # [L, N]
            same = same_traffic(window, remembered)  # [L]
            kept = tuple(w * same[:, None] for w in kept)
            used = same & (remembered.sum(-1) > 0)
        load = window + np.sum(kept, axis=0) if kept else window
        return load, replace(self, windows=(kept + (window,))[-self.keep:]), used


def same_traffic(window: np.ndarray, memory: np.ndarray, sigmas: float = 3.0) -> np.ndarray:  # [L] bool
    """Per layer, whether the token counts `window [L, N]` look drawn from the expert
    shares of the counts `memory [L, N]`: Pearson's chi-square of the window against
    those shares, with the routing noise of both parts (a count's variance is its
    expectation times 1 + window / memory tokens), within `sigmas` standard deviations of
    its mean (N - 1 degrees of freedom). A layer without tokens in either part passes
    (nothing to tell apart)."""
    w = np.asarray(window, dtype=np.float64)
    m = np.asarray(memory, dtype=np.float64)
    N = w.shape[-1]
    wt, mt = w.sum(-1, keepdims=True), m.sum(-1, keepdims=True)  # [L, 1]
    empty = (wt[:, 0] <= 0) | (mt[:, 0] <= 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = wt * (m + 0.5) / (mt + 0.5 * N)  # [L, N] smoothed: an expert the memory never saw
        stat = ((w - expected) ** 2 / (expected * (1 + wt / mt))).sum(-1)  # [L]
    dof = max(N - 1, 1)
    return empty | (stat <= dof + sigmas * np.sqrt(2 * dof))


def check_number(value: Any, name: str, ok: Callable[[float], bool], what: str) -> float:
    """`value` as a float when it is a number (not a bool) for which `ok` holds, else a
    ValueError "`name` must be `what`, got ...". NaN fails every range. The shared
    settings below are checked through it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def check_min_gain(value: Any, name: str = "min_gain") -> float:
    """A gain in balancedness (itself in (0, 1]): a float in [0, 1)."""
    return check_number(value, name, lambda v: 0 <= v < 1, "a gain in balancedness in [0, 1)")


def check_read_tokens(value: Any, name: str = "read_tokens") -> float:
    """A finite number >= 0, as a float."""
    return check_number(value, name, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def check_dispatch_tokens(value: Any, name: str = "dispatch_tokens") -> float:
    """A number >= 0 (inf allowed: the busiest GPU's tokens never rise), as a float."""
    return check_number(value, name, lambda v: v >= 0, "a number >= 0 (inf allowed)")


def check_load_decay(value: Any, name: str = "load_decay") -> float:
    """The weight of a step one step older in the load window: a float in (0, 1]. The one
    check of `load_decay`: EplbConfig.verify, simulate() and `eplb simulate` call it."""
    return check_number(value, name, lambda v: 0 < v <= 1, "in (0, 1] (1 = a plain sum)")


def check_steady_windows(value: Any) -> int:
    """Earlier windows a steady plan adds (`SteadyMemory.keep`): an int >= 0 (bools are
    refused). The one check of `steady_windows`: EplbConfig.verify and simulate() call it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"steady_windows must be an int >= 0 (0 = the window alone), got {value!r}")
    return value


def check_bool(value: Any, name: str) -> bool:
    """`value` when it is a bool, else a ValueError naming `name` (0 and 1 are refused: a
    switch is a bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_move_tolerance(value: Any) -> float:
    """Extra relative imbalance a planner may accept to keep experts in place: a float in
    [0, 10). The one check of `move_tolerance`: EplbConfig.verify, plan() and simulate()
    all call it."""
    return check_number(value, "move_tolerance", lambda v: 0 <= v < 10, "in [0, 10)")


def positive_int(value: Any, name: str) -> int:
    """`value` as an int >= 1, else a ValueError naming `name` (bools are refused)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return n


def check_topology(n: int, m: int, p: int, nodes: int, groups: int) -> None:
    """One-line ValueErrors for N experts, M GPUs, P slots, nodes and groups that don't fit."""
    if n > MAX_EXPERTS:
        raise ValueError(f"the number of experts N ({n}) is more than the supported {MAX_EXPERTS}")
    if p > MAX_SLOTS:
        raise ValueError(f"num_slots ({p}) is more than the supported {MAX_SLOTS}")
    if p < n:
        raise ValueError(f"num_slots ({p}) must be >= the number of experts N ({n}): every expert needs a slot")
    if p % m:
        lo, hi = p // m * m, -(-p // m) * m  # nearest multiples below and above
        options = f"{lo} or {hi}" if lo >= n else f"{hi}"
        raise ValueError(
            f"num_slots ({p}) must be a multiple of num_gpus ({m}) so every GPU gets the same "
            f"number of slots; try {options}"
        )
    if m % nodes:
        raise ValueError(f"num_gpus ({m}) must be divisible by num_nodes ({nodes})")
    if n % groups:
        raise ValueError(f"the number of experts N ({n}) must be divisible by num_groups ({groups})")


def _check_previous(prev: Placement, layers: int, n: int, m: int, p: int) -> None:
    if not isinstance(prev, Placement):
        raise ValueError(f"previous must be a Placement or None, got {type(prev).__name__}")
    want = {"L": layers, "N": n, "num_gpus": m, "num_slots": p}
    have = {"L": prev.num_layers, "N": prev.num_logical_experts, "num_gpus": prev.num_gpus,
            "num_slots": prev.num_slots}
    diff = [f"{k} {have[k]} vs {want[k]}" for k in want if have[k] != want[k]]
    if diff:
        raise ValueError(f"previous placement does not match this plan: {', '.join(diff)} (previous vs now)")
