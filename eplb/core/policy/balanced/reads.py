"""Decode-aware packing: count the weight reads of lightly loaded slots.

A GPU's expert work is a grouped GEMM over its local slots. Each slot that gets at least
one token in a step reads that expert's weights once; in decode (few tokens per step) a
read costs as much as computing many tokens, and the slots of cold experts are often
empty. Balancing tokens alone can then give one GPU more non-empty
slots than another: it reads more weights and is the slowest (issue 29).

In token units, a slot with an expected `lam` tokens per step (Poisson) costs

    lam + read_tokens * (1 - exp(-lam))      # tokens, plus a read when it is not empty

and this pass lowers the largest per-GPU sum of that cost by swapping slots between the
costliest GPU and the others, one pair of slots at a time. Replica counts and node
locality do not change. A GPU's tokens also set its share of the dispatch and combine
all-to-all, which reads do not enter: raising the row's busiest GPU tokens by one costs
`dispatch_tokens` (inf: the pass never raises them), so the pass does not make the
exchange slower by more than it makes the GEMMs faster. Before the pass the plan
balances tokens, so the busiest GPU's tokens are close to the mean and cold slots (few
tokens each) can swap without raising them. A row keeps the result only when this
objective (`objective`) falls by more than `min_gain` (relative): each swap is two
copies. When every slot expects at least `WARM_TOKENS` tokens per step the read term is
the same on every GPU (every slot reads) and the pass does nothing. The runtime's
defaults (`EplbConfig.read_tokens`, `dispatch_tokens`) and what they were measured
against: benchmarks/README.md, "Issue 29, target 3 ... on by default".
"""
from __future__ import annotations

import numpy as np

from eplb.core.policy.balanced.rows import REL_EPS, counts_of, gpu_sums, presence

WARM_TOKENS = 8.0  # a slot expecting this many tokens per step is empty with p < 0.04%
READ_ITERS = 200  # most swaps per row (the search stops earlier when no swap gains)
SWAP_MIN_GAIN = 1e-4  # a swap must lower the costliest GPU by this fraction of the mean GPU cost


def spread_reads(w: np.ndarray, p2l: np.ndarray, m: int, step_choices: float, read_tokens: float,
                 rows_per_layer: int = 1, min_gain: float = 0.0,
                 dispatch_tokens: float = np.inf) -> np.ndarray:
    """The decode-aware pass over a plan.

    w [L, n] loads of each layer; p2l [L * rows_per_layer, p] the plan's rows (with nodes:
    one row per (layer, node), `m` GPUs each); step_choices: token-expert choices per step
    and layer over all GPUs (tokens x top_k); read_tokens: the cost of one weight read in
    tokens. Returns the rows with the lowest largest GPU cost found."""
    if read_tokens <= 0 or step_choices <= 0 or m < 2:
        return p2l
    n = w.shape[1]
    R, p = p2l.shape
    layer = np.arange(R) // rows_per_layer  # [R] the layer of each row
    total = w.sum(1)[layer]  # [R] the layer's load
    c = counts_of(p2l, n)  # [R, n] replicas in the row
    share = np.divide(w[layer], total[:, None] * np.maximum(c, 1), out=np.zeros((R, n)),
                      where=total[:, None] > 0)  # [R, n] one replica's share of its layer's load
    lam = share * step_choices  # [R, n] tokens per step on each replica of an expert
    cost = lam + read_tokens * -np.expm1(-lam)  # [R, n] per slot of each expert
    r = np.arange(R)[:, None]
    sums = gpu_sums(cost[r, p2l], m)  # [R, m]
    # rows where some slot may be empty; swaps keep a row's total cost, so no GPU ends below
    # the mean: rows whose costliest GPU is within min_gain of the mean cannot gain enough
    # (most rows when a plan is in force)
    cold = (lam[r, p2l] < WARM_TOKENS).any(1)
    can = cold & (sums.max(1) * (1.0 - min_gain) > sums.mean(1) * (1.0 + REL_EPS))
    rows = np.nonzero(can)[0]
    if rows.size == 0:
        return p2l
    cost, lam = cost[rows], lam[rows]  # [R', n]
    before = objective(cost, lam, p2l[rows], m, dispatch_tokens)  # [R']
    new = swap_down(cost, lam, p2l[rows], m, n, READ_ITERS, dispatch_tokens)  # [R', p]
    after = objective(cost, lam, new, m, dispatch_tokens, p2l[rows])
    keep = after < before * (1.0 - min_gain)
    out = p2l.copy()
    out[rows[keep]] = new[keep]
    return out


def objective(cost: np.ndarray, tokens: np.ndarray, p2l: np.ndarray, m: int,
              dispatch_tokens: float, base: np.ndarray | None = None) -> np.ndarray:
    """[R] what the pass lowers: the largest per-GPU cost of the rows `p2l [R, p]`, plus
    `dispatch_tokens` x how far their busiest GPU's tokens exceed those of `base` (the
    plan before the pass; inf when they exceed them and dispatch_tokens is inf)."""
    r = np.arange(p2l.shape[0])[:, None]
    out = gpu_sums(cost[r, p2l], m).max(1)
    if base is None:
        return out
    rise = gpu_sums(tokens[r, p2l], m).max(1) - gpu_sums(tokens[r, base], m).max(1) * (1 + REL_EPS)
    if np.isinf(dispatch_tokens):
        return np.where(rise > 0, np.inf, out)
    return out + dispatch_tokens * np.maximum(rise, 0.0)


def swap_down(cost: np.ndarray, tokens: np.ndarray, p2l: np.ndarray, m: int, n: int,
              iters: int, dispatch_tokens: float = np.inf) -> np.ndarray:
    """Greedy swaps that lower every row's largest per-GPU cost, all rows at once.

    cost [R, n], tokens [R, n]: one slot's cost and tokens per expert; p2l [R, p]. Each
    iteration takes the costliest GPU h of every row and applies the one swap of a slot
    of h with a slot of another GPU g that gives the lowest max(cost h, cost g), among
    swaps that lower h's cost, put no expert twice on a GPU and keep both GPUs' tokens
    at most the row's largest GPU tokens so far (`cap`); with a finite `dispatch_tokens`
    a swap may raise the cap, at that price per token. A swap must gain `SWAP_MIN_GAIN` of
    the row's mean GPU cost; a row without such a swap is done (nothing else changes it),
    so each iteration works on the rows still gaining."""
    R, p = p2l.shape
    s = p // m
    if R == 0 or s == 0:
        return p2l
    p2l = p2l.copy()
    r = np.arange(R)
    x = cost[r[:, None], p2l].reshape(R, m, s)  # [R, m, s] cost per slot
    t = tokens[r[:, None], p2l].reshape(R, m, s)  # [R, m, s] tokens per slot
    load, tok = x.sum(2), t.sum(2)  # [R, m]
    cap = tok.max(1) * (1 + REL_EPS)  # [R] no GPU may end above the busiest GPU's tokens
    eps = np.maximum(SWAP_MIN_GAIN * load.mean(1), 1e-300)  # [R]
    on = presence(p2l, m, n)  # [R, m, n]
    e3 = p2l.reshape(R, m, s)  # [R, m, s] a view: swaps below update p2l
    act = r  # rows still gaining
    for _ in range(iters):
        if act.size == 0:
            break
        A = act.size
        ra = np.arange(A)
        X, T, E, LD, TK = x[act], t[act], e3[act], load[act], tok[act]  # [A, m, s], [A, m]
        h = LD.argmax(1)  # [A] costliest GPU
        xh, th, eh = X[ra, h], T[ra, h], E[ra, h]  # [A, s]
        d_cost = xh[:, None, :, None] - X[:, :, None, :]  # [A, m, s_h, s_g] cost h sheds
        d_tok = th[:, None, :, None] - T[:, :, None, :]
        new_h = LD[ra, h][:, None, None, None] - d_cost
        new_g = LD[:, :, None, None] + d_cost
        ok = d_cost > eps[act][:, None, None, None]  # h gets cheaper
        c4 = cap[act][:, None, None, None]
        top = np.maximum(TK[ra, h][:, None, None, None] - d_tok, TK[:, :, None, None] + d_tok)
        if np.isinf(dispatch_tokens):
            ok &= top <= c4
            pen = 0.0
        else:  # the row's largest GPU tokens may rise, at dispatch_tokens per token
            pen = dispatch_tokens * np.maximum(top - c4, 0.0)
        a3 = act[:, None, None]
        ok &= ~on[a3, np.arange(m)[None, :, None], eh[:, None, :]][..., None]  # h's expert not on g
        ok &= ~on[a3, h[:, None, None], E][:, :, None, :]  # g's expert not on h
        ok[ra, h] = False  # not with itself
        score = np.where(ok, np.maximum(new_h, new_g) + pen, np.inf).reshape(A, -1)  # [A, m * s * s]
        best = score.argmin(1)  # [A] first of the ties: deterministic
        gain = score[ra, best] < LD[ra, h] - eps[act]
        act = act[gain]  # a row without a gain now never has one: nothing else changes it
        if act.size == 0:
            break
        rr = act
        g, rest = np.divmod(best[gain], s * s)
        u, v = np.divmod(rest, s)  # slot u of h, slot v of g
        hh = h[gain]
        a, b = e3[rr, hh, u].copy(), e3[rr, g, v].copy()  # experts
        on[rr, hh, a], on[rr, g, b] = False, False
        on[rr, hh, b], on[rr, g, a] = True, True
        e3[rr, hh, u], e3[rr, g, v] = b, a
        xa, xb, ta, tb = x[rr, hh, u].copy(), x[rr, g, v].copy(), t[rr, hh, u].copy(), t[rr, g, v].copy()
        x[rr, hh, u], x[rr, g, v], t[rr, hh, u], t[rr, g, v] = xb, xa, tb, ta
        load[rr, hh] += xb - xa
        load[rr, g] += xa - xb
        tok[rr, hh] += tb - ta
        tok[rr, g] += ta - tb
        cap[rr] = np.maximum(cap[rr], np.maximum(tok[rr, hh], tok[rr, g]))
    return p2l
