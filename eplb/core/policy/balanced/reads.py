"""Decode-aware packing: count the weight reads of lightly loaded slots.

A GPU's expert work is a grouped GEMM over its local slots. Each slot that gets at least
one token in a step reads that expert's weights once; in decode (few tokens per step) a
read costs as much as computing many tokens (on an H200 in bf16, reading an expert's
weights takes about as long as running 150 tokens through it), and the slots of cold
experts are often empty. Balancing tokens alone can then give one GPU more non-empty
slots than another: it reads more weights and is the slowest (issue 29).

In token units, a slot with an expected `lam` tokens per step (Poisson) costs

    lam + read_tokens * (1 - exp(-lam))      # tokens, plus a read when it is not empty

and this pass balances that per-GPU sum by pair exchanges (`pairs.improve_pairs`;
replica counts and node locality do not change). A row keeps the result only when its
largest GPU cost falls by more than `min_gain` (relative): each exchange is two copies.
When every slot expects at least `WARM_TOKENS` tokens per step the read term is the same
on every GPU (every slot reads) and the pass does nothing.
"""
from __future__ import annotations

import numpy as np

from eplb.core.policy.balanced.pairs import improve_pairs
from eplb.core.policy.balanced.rows import counts_of, gpu_sums, slot_loads

WARM_TOKENS = 8.0  # a slot expecting this many tokens per step is empty with p < 0.04%
READ_ITERS = 40  # pair-exchange iterations of the pass


def spread_reads(w: np.ndarray, p2l: np.ndarray, m: int, step_choices: float, read_tokens: float,
                 rows_per_layer: int = 1, min_gain: float = 0.0) -> np.ndarray:
    """The decode-aware pass over a plan.

    w [L, n] loads of each layer; p2l [L * rows_per_layer, p] the plan's rows (with nodes:
    one row per (layer, node), `m` GPUs each); step_choices: token-expert choices per step
    and layer over all GPUs (tokens x top_k); read_tokens: the cost of one weight read in
    tokens. Returns the rows with the lowest largest GPU cost found."""
    if read_tokens <= 0 or step_choices <= 0 or m < 2:
        return p2l
    n = w.shape[1]
    wr = np.repeat(w, rows_per_layer, axis=0)  # [R, n] every row sees its layer's load
    total = wr.sum(1, keepdims=True)  # [R, 1] the layer's load
    c = counts_of(p2l, n)  # [R, n] replicas in the row
    share = np.divide(wr, total * np.maximum(c, 1), out=np.zeros_like(wr), where=total > 0)
    lam = share * step_choices  # [R, n] tokens per step on each replica of an expert
    cold = ((lam < WARM_TOKENS) & (c > 0)).any(1)  # [R] rows where some slot may be empty
    if not cold.any():
        return p2l
    rows = np.nonzero(cold)[0]
    # per-expert cost weights whose per-slot value (weight / count) is the slot's cost
    cost_w = c[rows] * (lam[rows] + read_tokens * -np.expm1(-lam[rows]))  # [R', n]
    before = gpu_sums(slot_loads(cost_w, p2l[rows], c[rows]), m).max(1)  # [R']
    new = improve_pairs(cost_w, p2l[rows], m, READ_ITERS)  # [R', p]
    after = gpu_sums(slot_loads(cost_w, new, c[rows]), m).max(1)
    keep = after < before * (1.0 - min_gain)
    out = p2l.copy()
    out[rows[keep]] = new[keep]
    return out
