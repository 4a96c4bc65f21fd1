"""What a placement is worth in tokens/s at large expert parallelism (EP 8 to 256), offline.

    shape = MODEL_PRESETS["deepseek-v3"]
    res = scale_replay(trace, shape, num_gpus=64, num_slots=320, tokens_per_gpu=128,
                       window=4, interval=4, cost=AnalyticCost())
    res.rows["default"].tokens_per_s, res.gain_over_static("default")

The replay (the same as `eplb.core.simulate`: each placement kind replans every
`interval` steps on the last `window`, out of sample) gives, for every scored step and
layer, which expert each slot of each of the M virtual GPUs holds. The step's logical
load becomes token counts: the trace's shares of the layer times the step's
`M * tokens_per_gpu * top_k` token-expert choices (expected counts, rounded), split over
an expert's replicas evenly or by the placement's shares. Then per MoE layer:

  layer time = dispatch + slowest GPU's expert work + combine

- expert work: `cost(counts)` for each GPU's `[S]` slot counts: the grouped GEMM of its
  local slots. `AnalyticCost` is a roofline at stated rates (CPU, tested in CI);
  `eplb.ops.gpu_cost.GpuGemmCost` runs the real kernel on a GPU and times it.
- dispatch and combine: the bytes each GPU sends and receives (a token-expert choice is
  one hidden vector, `hidden * dtype_bytes`; no per-GPU de-duplication), tokens starting
  evenly spread over the GPUs; within a node of `gpus_per_node` at `intra_GBps`, across
  nodes at `inter_GBps` per GPU, both links at once, send and receive at once
  (`LinkModel`). Combine moves the same bytes back, so it costs the same.
- a rebalance: each layer's new experts received at `transfer_efficiency` of the link
  (from a holder in the same node when there is one), layers one after another; its time
  is spread over the `serving_steps` model steps an interval stands for and added to them
  (as if serving stopped while weights move: the runtime's background move costs less).

tokens/s = M * tokens_per_gpu / (num_moe_layers * mean layer time + rebalance time per
step). Attention and everything outside the MoE layers are left out: they cost the same
under every placement, so the gains here are upper bounds of whole-model gains.

Trace and model may differ in their number of experts: `stack_experts` builds a model
layer of N experts from N / N_trace consecutive trace layers (expert e of model layer l
is expert e % N_trace of trace layer (l + e // N_trace) % L_trace), which keeps the
per-expert skew of the measured loads. Pure numpy. About 430 lines: the shapes, the link
and cost models and the replay that puts them together stay in one module.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from eplb.core.placement import Placement
from eplb.core.planning import DEFAULT_SHIFT_THRESHOLD, check_topology, positive_int
from eplb.core.policy import DEFAULT_MOVE_TOLERANCE
from eplb.core.simulate import (Block, oracle_blocks, rebalance_steps, replay_policy)
from eplb.core.workload import check_trace

# ---- model shapes, token presets, links ------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The MoE layer shape that sets the cost of experts and of moving tokens and weights."""

    name: str
    hidden: int  # H
    intermediate: int  # I, per routed expert
    num_experts: int  # N, routed
    top_k: int
    num_groups: int  # expert groups (DeepSeek's group-limited routing); 1 = none
    num_moe_layers: int  # MoE layers of the whole model
    dtype_bytes: int = 2  # bf16 weights and activations

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_experts", "top_k", "num_groups",
                     "num_moe_layers", "dtype_bytes"):
            positive_int(getattr(self, name), name)
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by num_groups "
                             f"({self.num_groups})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) is more than num_experts ({self.num_experts})")

    @property
    def bytes_per_expert(self) -> int:  # w13 [2I, H] + w2 [H, I]
        return 3 * self.hidden * self.intermediate * self.dtype_bytes

    @property
    def flops_per_choice(self) -> int:  # one token through one SwiGLU expert
        return 2 * 3 * self.hidden * self.intermediate


MODEL_PRESETS = {
    # DeepSeek-V3 / R1: 61 layers, the first 3 dense; 256 routed experts, top-8, 8 groups.
    "deepseek-v3": ModelShape("deepseek-v3", 7168, 2048, 256, 8, 8, 58),
    # Qwen3-235B-A22B: 94 layers, all MoE; 128 experts, top-8.
    "qwen3-235b": ModelShape("qwen3-235b", 4096, 1536, 128, 8, 1, 94),
}

# Tokens per GPU per step: a decode batch (DeepSeek's decode serves ~128 per GPU) and a
# prefill chunk (DeepSeek's prefill runs 4096-token micro-batches per GPU).
TOKEN_PRESETS = {"decode": 128, "prefill": 4096}

PLACEMENTS = ("static", "deepseek", "default", "default-weighted", "oracle")
"""static: the start-up placement (slot p holds expert p % N), never rebalanced;
deepseek / default: those policies, out of sample; default-weighted: default with
weighted replicas; oracle: default with weighted replicas planned from scratch on the
very steps it serves (its moves are paid for like the others')."""


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths per GPU, in GB/s (1e9 bytes/s), one direction."""

    gpus_per_node: int = 8
    intra_GBps: float = 390.0  # H200 NVLink: raw peer copy measured 390.8 GB/s (2026-12-01)
    inter_GBps: float = 50.0  # 400 Gb/s network card per GPU
    transfer_efficiency: float = 0.77  # a partial layer move, of raw (measured 2026-12-01)

    def __post_init__(self) -> None:
        positive_int(self.gpus_per_node, "gpus_per_node")
        for name in ("intra_GBps", "inter_GBps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if not 0 < self.transfer_efficiency <= 1:
            raise ValueError(f"transfer_efficiency must be in (0, 1], got {self.transfer_efficiency!r}")


class ExpertCost(Protocol):
    """Seconds of each GPU's grouped GEMM, from the token counts of its slots:
    `counts [L, M, S]` -> `[L, M]`."""

    def __call__(self, shape: ModelShape, counts: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class AnalyticCost:
    """A roofline for one grouped GEMM: max(FLOPs / `tflops`, bytes / `hbm_TBps`) plus a
    fixed launch cost. Bytes: the weights of every slot with tokens, and each token's input,
    gate/up, hidden and output rows. The default rates are stated, not measured: about 60%
    of an H200's dense bf16 peak (989 TFLOP/s) and 85% of its 4.8 TB/s."""

    tflops: float = 600.0
    hbm_TBps: float = 4.0
    launch_us: float = 10.0

    def __call__(self, shape: ModelShape, counts: np.ndarray) -> np.ndarray:  # [L, M, S] -> [L, M]
        H, I, b = shape.hidden, shape.intermediate, shape.dtype_bytes
        counts = np.asarray(counts, dtype=np.float64)
        tokens = counts.sum(-1)  # [L, M]
        flops = tokens * shape.flops_per_choice
        nbytes = (np.count_nonzero(counts, axis=-1) * shape.bytes_per_expert
                  + tokens * (2 * H + 2 * I + I + H) * b)  # weights; x, gate/up, h, out rows
        t = np.maximum(flops / (self.tflops * 1e12), nbytes / (self.hbm_TBps * 1e12))
        return t + np.where(tokens > 0, self.launch_us * 1e-6, 0.0)


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


def slot_counts(shares: np.ndarray, placement: Placement, choices: int) -> np.ndarray:
    """Token counts per GPU and slot for one step: `shares [L, N]` (rows sum to 1) of
    `choices` token-expert choices per layer -> [L, M, S] int64 (expected counts, rounded)."""
    p2l = placement.physical_to_logical  # [L, P]
    L, P = p2l.shape
    M = placement.num_gpus
    expert = np.rint(shares * choices)  # [L, N]
    per_slot = np.rint(expert[np.arange(L)[:, None], p2l] * placement.slot_shares())  # [L, P]
    return per_slot.astype(np.int64).reshape(L, M, P // M)


def exchange_seconds(gpu_choices: np.ndarray, shape: ModelShape, link: LinkModel) -> np.ndarray:
    """Dispatch time per layer from `gpu_choices [L, M]` (token-expert choices each GPU
    serves), tokens starting evenly over the M GPUs -> [L] seconds (the slowest GPU)."""
    L, M = gpu_choices.shape
    n = min(link.gpus_per_node, M)
    if M % n:
        raise ValueError(f"num_gpus ({M}) must be a multiple of gpus_per_node ({n})")
    row = shape.hidden * shape.dtype_bytes  # bytes per choice
    node_load = gpu_choices.reshape(L, M // n, n).sum(-1).repeat(n, axis=1)  # [L, M]
    total = gpu_choices.sum(-1, keepdims=True)  # [L, 1]
    recv_intra = gpu_choices * (n - 1) / M  # from the other GPUs of the node
    recv_inter = gpu_choices * (M - n) / M
    send_intra = (node_load - gpu_choices) / M  # this GPU's 1/M share of their loads
    send_inter = (total - node_load) / M
    t_intra = np.maximum(recv_intra, send_intra) * row / (link.intra_GBps * 1e9)
    t_inter = np.maximum(recv_inter, send_inter) * row / (link.inter_GBps * 1e9)
    return np.maximum(t_intra, t_inter).max(-1)  # [L]


def move_seconds(old: Placement, new: Placement, shape: ModelShape, link: LinkModel) -> float:
    """Time to move `old` to `new`, layers one after another: per layer, the GPU that
    receives the most bytes (a new expert once per GPU, from a holder in its node when
    there is one) at `transfer_efficiency` of the link. Vectorised over layers, GPUs and
    experts (like `transfer_stats`, which counts the same receives over all GPUs)."""
    o, w = old.physical_to_logical, new.physical_to_logical  # [L, P]
    L, P = o.shape
    M = old.num_gpus
    if o.size == 0:
        return 0.0
    n = min(link.gpus_per_node, M)  # GPU g is in node g // n
    N = old.num_logical_experts
    bw_intra = link.intra_GBps * 1e9 * link.transfer_efficiency
    bw_inter = link.inter_GBps * 1e9 * link.transfer_efficiency
    gpu = np.arange(P) // (P // M)  # [P] the GPU of each slot
    layer = np.arange(L)[:, None]  # [L, 1]
    held = np.zeros((L, M, N), dtype=bool)  # [L, M, N] GPU holds expert before
    held[layer, gpu, o] = True
    node_has = np.zeros((L, -(-M // n), N), dtype=bool)  # [L, nodes, N] some GPU of the node does
    node_has[layer, gpu // n, o] = True
    need = np.zeros((L, M, N), dtype=bool)  # [L, M, N] GPU receives expert: new on it, not held
    need[layer, gpu, w] = True
    need &= ~held
    n_need = need.sum(-1)  # [L, M]
    n_intra = (need & node_has[:, np.arange(M) // n]).sum(-1)  # [L, M] from a holder in the node
    B = shape.bytes_per_expert
    worst = np.maximum(n_intra * B / bw_intra, (n_need - n_intra) * B / bw_inter).max(-1)  # [L]
    return float(np.cumsum(worst)[-1])  # added up in layer order, as the layers run


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
            kw: dict, opts: "PlanOptions", progress: Callable[[], None] | None) -> list[Block]:
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
                              read_tokens=opts.read_tokens, step_choices=opts.step_choices),
                         decay=opts.decay, min_gain=opts.min_gain, progress=progress,
                         shift_threshold=opts.shift_threshold)


@dataclass(frozen=True)
class PlanOptions:
    """The runtime settings (`EplbConfig`) the planned placement kinds replay with."""

    move_tolerance: float = DEFAULT_MOVE_TOLERANCE
    weighted: bool = False  # weighted replicas for `default` (`default-weighted` always has them)
    decay: float = 1.0  # load_decay of the window
    min_gain: float = 0.0
    shift_threshold: float = DEFAULT_SHIFT_THRESHOLD  # 0 = no shift-aware rebalancing
    read_tokens: float = 0.0  # decode-aware packing: tokens a weight read costs (0 = off)
    step_choices: float = 0.0  # token-expert choices per step and layer the plans assume

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("move_tolerance", "weighted", "decay", "min_gain",
                                              "shift_threshold", "read_tokens", "step_choices")}


def plans_per_kind(T: int, interval: int) -> int:
    """Scheduled plans of one planned kind over a trace of T steps (early ones come on top)."""
    return len(rebalance_steps(T, interval, interval))


def plan_scale(trace: np.ndarray, shape: ModelShape, num_gpus: int, num_slots: int,
               window: int, interval: int, link: LinkModel = LinkModel(),
               placements: Sequence[str] = PLACEMENTS, min_gain: float | None = None,
               opts: PlanOptions = PlanOptions(),
               progress: Callable[[], None] | None = None
               ) -> tuple[np.ndarray, dict[str, list[Block]]]:
    """The planning half of `scale_replay` (it does not depend on the token count or the
    cost model, so sweeps reuse it): (loads [T, L, N], placement blocks per kind).
    `opts`: the settings the policies replay with (`min_gain`, when given, overrides
    `opts.min_gain`); `progress()` is called after each plan."""
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
    return loads, {kind: _blocks(kind, loads, initial, steps, window, kw, opts, progress)
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
                 serving_steps: int = 1000, min_gain: float = 0.0,
                 planned: tuple[np.ndarray, dict[str, list[Block]]] | None = None,
                 progress: Callable[[], None] | None = None,
                 opts: PlanOptions = PlanOptions()) -> ScaleResult:
    """Tokens/s of each placement kind for `trace [T, L, N_trace]` served by `shape` on
    `num_gpus` GPUs with `num_slots` slots per layer (see the module docstring).

    Plans start at step `interval` (the first full window when window == interval); steps
    from there on are scored. `min_gain` gates the planned policies as `EplbConfig.min_gain`
    (default 0: every plan that differs moves). `serving_steps`: the model steps one
    interval stands for (a trace step is an aggregate of many), over which a rebalance's
    time is spread (default 1000, SGLang's default rebalance period). Nodes are groups of `link.gpus_per_node`
    GPUs; the policies see them (and the model's expert groups when they fit the nodes).
    `progress()` is called after each scored step of each placement. `opts`: the runtime
    settings the policies replay with (also those `planned` was made with, when given)."""
    M, P = positive_int(num_gpus, "num_gpus"), positive_int(num_slots, "num_slots")
    tokens_per_gpu = positive_int(tokens_per_gpu, "tokens_per_gpu")
    serving_steps = positive_int(serving_steps, "serving_steps")
    interval = positive_int(interval, "interval")
    loads, all_blocks = planned if planned is not None else plan_scale(
        trace, shape, M, P, window, interval, link, placements, min_gain, opts)
    T, L, N = loads.shape
    nodes, groups = topology(shape, M, link)
    totals = loads.sum(-1, keepdims=True)  # [T, L, 1]
    shares = np.divide(loads, totals, out=np.full(loads.shape, 1.0 / N), where=totals > 0)  # [T, L, N]
    choices = M * tokens_per_gpu * shape.top_k  # per layer and step
    layer_scale = shape.num_moe_layers / L  # replayed layers stand for the model's

    rows: dict[str, ScaleRow] = {}
    for kind, blocks in all_blocks.items():
        layer_t, comp_t, exch_t, mean_t, step_ms = [], [], [], [], []
        rebalance_s, moved, n_rebalances = 0.0, 0, 0
        for b in blocks:
            if b.placement is not b.previous and b.placement != b.previous:
                n_rebalances += 1
                spent = move_seconds(b.previous, b.placement, shape, link) * layer_scale
                rebalance_s += spent
                moved += _experts_moved(b)
            else:
                spent = 0.0
            per_step_move = spent / serving_steps * interval / (b.end - b.start)  # per serving step
            for t in range(b.start, b.end):
                counts = slot_counts(shares[t], b.placement, choices)  # [L, M, S]
                gpu_s = np.asarray(cost(shape, counts), dtype=np.float64)  # [L, M]
                ex = 2 * exchange_seconds(counts.sum(-1), shape, link)  # [L] dispatch + combine
                comp = gpu_s.max(-1)  # [L]
                layer_t.append((comp + ex).mean())
                comp_t.append(comp.mean())
                exch_t.append(ex.mean())
                mean_t.append(gpu_s.mean(-1).mean())
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
              "interval": interval, "serving_steps": serving_steps, "min_gain": min_gain, "scored_steps": T - interval,
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
