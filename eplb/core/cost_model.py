"""The cost models of the large-EP replay (eplb.core.scale): what experts, token exchanges
and weight moves cost on the virtual GPUs of one MoE layer.

  layer time = dispatch + slowest GPU's expert work + combine

- ModelShape: the MoE layer's sizes (MODEL_PRESETS; TOKEN_PRESETS: tokens per GPU per
  step);
- expert work (`ExpertCost`): `cost(shape, counts)` for each GPU's `[S]` slot counts, the
  grouped GEMM of its local slots. `AnalyticCost` is a roofline at stated rates (CPU,
  tested in CI); `eplb.ops.gpu_cost.GpuGemmCost` runs the real kernel on a GPU and times it;
- dispatch and combine (`exchange_seconds`): the bytes each GPU sends and receives (a
  token-expert choice is one hidden vector, `hidden * dtype_bytes`; no per-GPU
  de-duplication), tokens starting evenly spread over the GPUs; within a node of
  `gpus_per_node` at `intra_GBps`, across nodes at `inter_GBps` per GPU, both links at
  once, send and receive at once (`LinkModel`). Combine moves the same bytes back, so it
  costs the same;
- a rebalance (`move_seconds`): each layer's new experts received at
  `transfer_efficiency` of the link (from a holder in the same node when there is one),
  layers one after another.

Pure numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eplb.core.placement import Placement
from eplb.core.planning import positive_int


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


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths per GPU, in GB/s (1e9 bytes/s), one direction."""

    gpus_per_node: int = 8
    # the defaults: H200 NVLink's raw peer copy and the partial-move efficiency of a layer
    # move, both measured on 2 x H200 (benchmarks/README.md, "Large EP", and its transfer
    # runs, "Moving one DeepSeek-V3 layer between two GPUs")
    intra_GBps: float = 390.0
    inter_GBps: float = 50.0  # 400 Gb/s network card per GPU
    transfer_efficiency: float = 0.77  # of the raw peer copy

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
        nbytes = (self.weight_reads(counts) * shape.bytes_per_expert
                  + tokens * (2 * H + 2 * I + I + H) * b)  # weights; x, gate/up, h, out rows
        t = np.maximum(flops / (self.tflops * 1e12), nbytes / (self.hbm_TBps * 1e12))
        return t + np.where(tokens > 0, self.launch_us * 1e-6, 0.0)

    def weight_reads(self, counts: np.ndarray) -> np.ndarray:  # [L, M, S] -> [L, M]
        """How many times a GPU reads expert weights: once per slot with tokens."""
        return np.count_nonzero(counts, axis=-1)


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
