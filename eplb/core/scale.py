"""What a placement is worth in tokens/s at large expert parallelism (EP 8 to 256), offline.

    from eplb.core.cost_model import MODEL_PRESETS, AnalyticCost
    shape = MODEL_PRESETS["deepseek-v3"]
    res = scale_replay(trace, shape, num_gpus=64, num_slots=320, tokens_per_gpu=128,
                       window=4, interval=4, cost=AnalyticCost())
    res.rows["default"].tokens_per_s, res.gain_over_static("default")

The replay (the same as `eplb.core.simulate`: each placement kind replans every
`interval` steps on the last `window`, out of sample) gives, for every scored step and
layer, which expert each slot of each of the M virtual GPUs holds. The step's logical
load becomes token counts: the trace's shares of the layer times the step's
`M * tokens_per_gpu * top_k` token-expert choices, split over an expert's replicas
evenly or by the placement's shares: the expected counts, rounded (`counts="expected"`,
the default), or a Poisson draw of each slot's expected count (`counts="poisson"`: at
decode batch sizes a cold slot is sometimes empty and sometimes reads its weights). Then per MoE layer
(the models of eplb.core.cost_model):

  layer time = dispatch + slowest GPU's expert work + combine

and a rebalance's move time is spread over the `serving_steps` model steps an interval
stands for and added to them (as if serving stopped while weights move: the runtime's
background move costs less).

Shift detection (`PlanOptions.shift_threshold`) checks every `control_interval` model
steps, as the runtime: every `control_interval * interval / serving_steps` of a trace
step. An early rebalance that a check within step t starts serves the rest of t: that
step's layer times are the mix of the two placements' (`Block.lead`).

tokens/s = M * tokens_per_gpu / (num_moe_layers * mean layer time + rebalance time per
step). Attention and everything outside the MoE layers are left out: they cost the same
under every placement, so the gains here are upper bounds of whole-model gains.

Trace and model may differ in their number of experts: `stack_experts` builds a model
layer of N experts from N / N_trace consecutive trace layers (expert e of model layer l
is expert e % N_trace of trace layer (l + e // N_trace) % L_trace), which keeps the
per-expert skew of the measured loads. Pure numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from eplb.core.cost_model import ExpertCost, LinkModel, ModelShape, exchange_seconds, move_seconds
from eplb.core.placement import Placement
from eplb.core.config import EplbConfig
from eplb.core.planning import DEFAULT_SHIFT_THRESHOLD, DEFAULT_STEADY_WINDOWS, check_topology, positive_int
from eplb.core.policy.base import DEFAULT_DISPATCH_TOKENS, DEFAULT_MOVE_TOLERANCE, DEFAULT_TILE_ROWS
from eplb.core.replay import Block, oracle_blocks, rebalance_steps, replay_policy
from eplb.core.trend import DEFAULT_DRIFT_TREND
from eplb.core.workload import check_trace

SERVING_STEPS = 1000  # model steps one rebalance interval stands for (SGLang's default period)
DEFAULT_CONTROL_INTERVAL = EplbConfig.control_interval  # the runtime checks for a shift this often

PLACEMENTS = ("static", "deepseek", "default", "default-weighted", "oracle")
"""static: the start-up placement (slot p holds expert p % N), never rebalanced;
deepseek / default: those policies, out of sample; default-weighted: default with
weighted replicas; oracle: default with weighted replicas planned from scratch on the
very steps it serves (its moves are paid for like the others')."""


# ---- loads ------------------------------------------------------------------------------


def stack_experts(trace: np.ndarray, num_experts: int) -> np.ndarray:  # [T, L, Nt] -> [T, L, N]
    """A trace of Nt experts as loads of `num_experts` = k * Nt experts (see the module
    docstring); the identity when the counts match."""
    T, L, Nt = trace.shape
    if num_experts == Nt:
        return trace
    if num_experts % Nt:
        raise ValueError(f"the model has {num_experts} experts and the trace {Nt}: the model's must "
                         f"be a multiple of the trace's (or use a custom shape with {Nt} experts)")
    k = num_experts // Nt
    layer_of = (np.arange(L)[:, None] + np.arange(k)[None, :]) % L  # [L, k]
    return trace[:, layer_of, :].reshape(T, L, num_experts)  # [T, L, k * Nt]


COUNTS = ("expected", "poisson")
"""How a step's token counts are drawn: `expected` counts, rounded (a slot expecting 0.4
tokens never reads its weights), or `poisson` draws of them (it is empty in 67% of the
steps and reads in the others, as in a decode step whose tokens arrive at random)."""


def slot_counts(shares: np.ndarray, placement: Placement, choices: int,
                rng: np.random.Generator | None = None) -> np.ndarray:
    """Token counts per GPU and slot for one step: `shares [L, N]` (rows sum to 1) of
    `choices` token-expert choices per layer -> [L, M, S] int64: the expected counts,
    rounded, or with `rng` a Poisson draw of each slot's expected count."""
    p2l = placement.physical_to_logical  # [L, P]
    L, P = p2l.shape
    M = placement.num_gpus
    if rng is not None:
        lam = (shares * choices)[np.arange(L)[:, None], p2l] * placement.slot_shares()  # [L, P]
        return rng.poisson(lam).astype(np.int64).reshape(L, M, P // M)
    expert = np.rint(shares * choices)  # [L, N]
    per_slot = np.rint(expert[np.arange(L)[:, None], p2l] * placement.slot_shares())  # [L, P]
    return per_slot.astype(np.int64).reshape(L, M, P // M)


# ---- the replay -------------------------------------------------------------------------


@dataclass
class ScaleRow:
    """One placement kind at one EP size, over the scored steps."""

    name: str
    layer_ms: float  # mean MoE layer time: dispatch + slowest GPU's experts + combine
    compute_ms: float  # of which the slowest GPU's expert work
    exchange_ms: float  # of which dispatch + combine
    idle: float  # GPU-idle fraction of the expert work: 1 - mean GPU time / slowest GPU time
    rebalance_ms_per_step: float  # whole model, spread over the steps of each interval
    tokens_per_s: float
    rebalances: int
    experts_moved: int  # remote receives over all rebalances, of the layers replayed
    step_ms: list[float] = field(default_factory=list)  # per scored step, whole model

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "layer_ms", "compute_ms", "exchange_ms", "idle",
                                              "rebalance_ms_per_step", "tokens_per_s", "rebalances",
                                              "experts_moved", "step_ms")}


@dataclass
class ScaleResult:
    config: dict
    rows: dict[str, ScaleRow]

    def gain_over_static(self, name: str) -> float:
        return self.rows[name].tokens_per_s / self.rows["static"].tokens_per_s - 1

    def to_dict(self) -> dict:
        return {"config": self.config, "rows": {k: v.to_dict() for k, v in self.rows.items()},
                "gain_over_static": {k: self.gain_over_static(k) for k in self.rows}}


def _blocks(kind: str, trace: np.ndarray, initial: Placement, steps: list[int], window: int,
            kw: dict, opts: "PlanOptions", progress: Callable[[], None] | None,
            check_every: float | None, tokens_per_step: float | None) -> list[Block]:
    if kind == "static":
        return [Block(steps[0], trace.shape[0], initial, initial)]
    if kind == "oracle":
        return oracle_blocks(trace, initial, steps, "default", dict(kw, weighted=True), progress)
    if kind == "deepseek":  # the published baseline: on the schedule, from scratch
        return replay_policy(trace, initial, steps, window, "deepseek", kw, decay=opts.decay,
                             min_gain=opts.min_gain, progress=progress)
    weighted = True if kind == "default-weighted" else opts.weighted
    return replay_policy(trace, initial, steps, window, "default",
                         dict(kw, weighted=weighted, move_tolerance=opts.move_tolerance,
                              read_tokens=opts.read_tokens, step_choices=opts.step_choices,
                              dispatch_tokens=opts.dispatch_tokens, tile_rows=opts.tile_rows),
                         decay=opts.decay, min_gain=opts.min_gain, progress=progress,
                         shift_threshold=opts.shift_threshold, check_every=check_every,
                         tokens_per_step=tokens_per_step, steady_windows=opts.steady_windows,
                         drift_trend=opts.drift_trend)


@dataclass(frozen=True)
class PlanOptions:
    """The runtime settings (`EplbConfig`) the planned placement kinds replay with."""

    move_tolerance: float = DEFAULT_MOVE_TOLERANCE
    weighted: bool = False  # weighted replicas for `default` (`default-weighted` always has them)
    decay: float = 1.0  # load_decay of the window
    min_gain: float = 0.0
    shift_threshold: float = DEFAULT_SHIFT_THRESHOLD  # 0 = no shift-aware rebalancing
    # decode-aware packing: tokens a weight read costs (0 = off; EplbConfig's default is on,
    # `eplb simulate --cost` replays with it, set against each EP size's choices per step)
    read_tokens: float = 0.0
    # token-expert choices per model step and layer the plans assume (0: scale_replay's; for
    # plan_scale alone, the trace's counts): reads are set against it, shift checks' noise too
    step_choices: float = 0.0
    dispatch_tokens: float = DEFAULT_DISPATCH_TOKENS  # a token more on the busiest GPU's all-to-all
    tile_rows: float = DEFAULT_TILE_ROWS  # a slot's tokens per weight read (0: one read per slot)
    # model steps between two shift checks (EplbConfig's; 0 = no early rebalances)
    control_interval: int = DEFAULT_CONTROL_INTERVAL
    steady_windows: int = DEFAULT_STEADY_WINDOWS  # earlier windows a steady plan adds (0 = off)
    drift_trend: bool = DEFAULT_DRIFT_TREND  # a drifting load's plans use its trend where it predicted well

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("move_tolerance", "weighted", "decay", "min_gain",
                                              "shift_threshold", "read_tokens", "step_choices",
                                              "dispatch_tokens", "tile_rows", "control_interval",
                                              "steady_windows", "drift_trend")}

    def check_every(self, interval: int, serving_steps: int) -> float | None:
        """The share of a trace step between two shift checks when an interval of
        `interval` trace steps stands for `serving_steps` model steps (at most 1: a check
        after every step); None when `control_interval` is 0 (no early rebalances)."""
        if self.control_interval == 0:
            return None
        return min(1.0, self.control_interval * interval / serving_steps)


def plans_per_kind(T: int, interval: int) -> int:
    """Scheduled plans of one planned kind over a trace of T steps (early ones come on top)."""
    return len(rebalance_steps(T, interval, interval))


def plan_scale(trace: np.ndarray, shape: ModelShape, num_gpus: int, num_slots: int,
               window: int, interval: int, link: LinkModel = LinkModel(),
               placements: Sequence[str] = PLACEMENTS, min_gain: float | None = None,
               opts: PlanOptions = PlanOptions(),
               progress: Callable[[], None] | None = None, serving_steps: int = SERVING_STEPS,
               ) -> tuple[np.ndarray, dict[str, list[Block]]]:
    """The planning half of `scale_replay` (it does not depend on the token count or the
    cost model, so sweeps reuse it): (loads [T, L, N], placement blocks per kind).
    `opts`: the settings the policies replay with (`min_gain`, when given, overrides
    `opts.min_gain`); `progress()` is called after each plan. `serving_steps`: as
    `scale_replay`'s; with `opts.control_interval` it sets how often within a trace step
    shift detection checks (`PlanOptions.check_every`)."""
    if min_gain is not None:
        opts = replace(opts, min_gain=min_gain)
    trace = check_trace(trace)
    M = positive_int(num_gpus, "num_gpus")
    P = positive_int(num_slots, "num_slots")
    window, interval = positive_int(window, "window"), positive_int(interval, "interval")
    bad = [k for k in placements if k not in PLACEMENTS]
    if bad or not placements:
        raise ValueError(f"unknown placement kind(s) {bad}; choose from {', '.join(PLACEMENTS)}")
    if "static" not in placements:
        placements = ("static", *placements)  # gains are over static
    loads = stack_experts(trace, shape.num_experts)  # [T, L, N]
    T, L, N = loads.shape
    nodes, groups = topology(shape, M, link)
    check_topology(N, M, P, nodes, groups)
    if interval >= T:
        raise ValueError(f"the trace has {T} steps: nothing left to score after the first plan at "
                         f"step {interval}; use a smaller interval or a longer trace")
    steps = rebalance_steps(T, interval, interval)
    initial = Placement.initial(L, N, P, M, nodes)
    kw = dict(num_nodes=nodes, num_groups=groups)
    serving_steps = positive_int(serving_steps, "serving_steps")
    every = opts.check_every(interval, serving_steps)
    per_trace_step = opts.step_choices * serving_steps / interval if opts.step_choices > 0 else None
    return loads, {kind: _blocks(kind, loads, initial, steps, window, kw, opts, progress, every, per_trace_step)
                   for kind in placements}


def topology(shape: ModelShape, num_gpus: int, link: LinkModel) -> tuple[int, int]:
    """(nodes, expert groups) the policies see: nodes of `gpus_per_node`; the model's
    groups when the nodes divide them (DeepSeek's hierarchical case), else 1."""
    nodes = num_gpus // link.gpus_per_node if num_gpus % link.gpus_per_node == 0 else 1
    nodes = max(1, nodes)
    return nodes, (shape.num_groups if shape.num_groups % nodes == 0 else 1)


def scale_replay(trace: np.ndarray, shape: ModelShape, num_gpus: int, num_slots: int,
                 tokens_per_gpu: int, window: int, interval: int, cost: ExpertCost,
                 link: LinkModel = LinkModel(), placements: Sequence[str] = PLACEMENTS,
                 serving_steps: int = SERVING_STEPS, min_gain: float = 0.0,
                 planned: tuple[np.ndarray, dict[str, list[Block]]] | None = None,
                 progress: Callable[[], None] | None = None,
                 opts: PlanOptions = PlanOptions(), counts: str = "expected",
                 seed: int = 0) -> ScaleResult:
    """Tokens/s of each placement kind for `trace [T, L, N_trace]` served by `shape` on
    `num_gpus` GPUs with `num_slots` slots per layer (see the module docstring).

    Plans start at step `interval` (the first full window when window == interval); steps
    from there on are scored. `min_gain` gates the planned policies as `EplbConfig.min_gain`
    (default 0: every plan that differs moves). `serving_steps`: the model steps one
    interval stands for (a trace step is an aggregate of many), over which a rebalance's
    time is spread (default 1000, SGLang's default rebalance period). Nodes are groups of `link.gpus_per_node`
    GPUs; the policies see them (and the model's expert groups when they fit the nodes).
    `progress()` is called after each scored step of each placement. `opts`: the runtime
    settings the policies replay with (also those `planned` was made with, when given),
    except `opts.min_gain`: the `min_gain` argument replaces it.
    `counts`: how a step's token counts are drawn (`COUNTS`); Poisson draws come from a
    generator seeded with (`seed`, step), the same for every placement kind."""
    if counts not in COUNTS:
        raise ValueError(f"counts must be one of {', '.join(COUNTS)}, got {counts!r}")
    M, P = positive_int(num_gpus, "num_gpus"), positive_int(num_slots, "num_slots")
    tokens_per_gpu = positive_int(tokens_per_gpu, "tokens_per_gpu")
    serving_steps = positive_int(serving_steps, "serving_steps")
    interval = positive_int(interval, "interval")
    if planned is None and opts.step_choices == 0:  # this run's tokens
        opts = replace(opts, step_choices=float(M * tokens_per_gpu * shape.top_k))
    loads, all_blocks = planned if planned is not None else plan_scale(
        trace, shape, M, P, window, interval, link, placements, min_gain, opts,
        serving_steps=serving_steps)
    T, L, N = loads.shape
    nodes, groups = topology(shape, M, link)
    totals = loads.sum(-1, keepdims=True)  # [T, L, 1]
    shares = np.divide(loads, totals, out=np.full(loads.shape, 1.0 / N), where=totals > 0)  # [T, L, N]
    choices = M * tokens_per_gpu * shape.top_k  # per layer and step
    layer_scale = shape.num_moe_layers / L  # replayed layers stand for the model's

    def layer_times(t: int, placement: Placement) -> np.ndarray:  # [3, L]: slowest GPU, exchange, mean GPU
        rng = np.random.default_rng((seed, t)) if counts == "poisson" else None
        c = slot_counts(shares[t], placement, choices, rng)  # [L, M, S]
        gpu_s = np.asarray(cost(shape, c), dtype=np.float64)  # [L, M]
        ex = 2 * exchange_seconds(c.sum(-1), shape, link)  # [L] dispatch + combine
        return np.stack([gpu_s.max(-1), ex, gpu_s.mean(-1)])

    rows: dict[str, ScaleRow] = {}
    for kind, blocks in all_blocks.items():
        layer_t, comp_t, exch_t, mean_t, step_ms = [], [], [], [], []
        rebalance_s, moved, n_rebalances, pending = 0.0, 0, 0, 0.0
        for b in blocks:
            if b.placement is not b.previous and b.placement != b.previous:
                n_rebalances += 1
                spent = move_seconds(b.previous, b.placement, shape, link) * layer_scale
                rebalance_s += spent
                moved += _experts_moved(b)
            else:
                spent = 0.0
            if b.end == b.start:  # replaced within its first step: its moves land on the next block
                pending += spent
                continue
            per_step_move = (spent + pending) / serving_steps * interval / (b.end - b.start)  # per serving step
            pending = 0.0
            for t in range(b.start, b.end):
                times = layer_times(t, b.placement)  # [3, L]
                if t == b.start and b.lead > 0:  # the rebalance landed within this step
                    times = b.lead * layer_times(t, b.previous) + (1 - b.lead) * times
                comp, ex, mean_gpu = times
                layer_t.append((comp + ex).mean())
                comp_t.append(comp.mean())
                exch_t.append(ex.mean())
                mean_t.append(mean_gpu.mean())
                step_ms.append(1e3 * ((comp + ex).mean() * shape.num_moe_layers + per_step_move))
                if progress:
                    progress()
        n_scored = len(layer_t)
        layer_s = float(np.mean(layer_t))
        rebalance_per_step = rebalance_s / (n_scored / interval * serving_steps)
        step_s = layer_s * shape.num_moe_layers + rebalance_per_step
        rows[kind] = ScaleRow(
            name=kind, layer_ms=1e3 * layer_s, compute_ms=1e3 * float(np.mean(comp_t)),
            exchange_ms=1e3 * float(np.mean(exch_t)),
            idle=1 - float(np.mean(mean_t)) / float(np.mean(comp_t)),
            rebalance_ms_per_step=1e3 * rebalance_per_step,
            tokens_per_s=M * tokens_per_gpu / step_s, rebalances=n_rebalances, experts_moved=moved,
            step_ms=[round(x, 4) for x in step_ms])
    config = {"model": shape.name, "hidden": shape.hidden, "intermediate": shape.intermediate,
              "experts": N, "top_k": shape.top_k, "moe_layers": shape.num_moe_layers,
              "trace_steps": T, "layers_replayed": L, "num_gpus": M, "num_slots": P,
              "nodes": nodes, "groups": groups, "tokens_per_gpu": tokens_per_gpu, "window": window,
              "interval": interval, "serving_steps": serving_steps, "counts": counts, "min_gain": min_gain, "scored_steps": T - interval,
              "plan_options": replace(opts, min_gain=min_gain).to_dict(),
              "link": {"gpus_per_node": link.gpus_per_node, "intra_GBps": link.intra_GBps,
                       "inter_GBps": link.inter_GBps,
                       "transfer_efficiency": link.transfer_efficiency}}
    return ScaleResult(config, rows)


def _experts_moved(b: Block) -> int:
    """Remote receives of the rebalance that put `b` in force: the figure of its record (a
    policy's block), counted only for blocks without one (the oracle's, cached plans)."""
    if b.record is not None:
        return b.record.experts_moved
    from eplb.core.transfer_plan import transfer_stats
    old, new = b.previous, b.placement
    return transfer_stats(old.physical_to_logical, new.physical_to_logical, old.num_gpus).experts_moved
