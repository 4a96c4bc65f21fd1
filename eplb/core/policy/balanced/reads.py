"""Decode-aware packing: count the weight reads of lightly loaded slots.

A GPU's expert work is a grouped GEMM over its local slots. A slot reads its expert's
weights once per tile of `tile_rows` of its tokens in a step (none when it gets none); in
decode (few tokens per step) a read costs as much as computing many tokens, the slots of
cold experts are often empty, and a hot slot just above a tile's rows reads twice.
Balancing tokens alone can then give one GPU more reads than another: it is the slowest
(issue 29).

In token units, a slot with an expected `lam` tokens per step (Poisson, X) costs

    lam + read_tokens * E[ceil(X / tile_rows)]    # tokens, plus a read per tile
                                                 # (tile_rows 0: P(X >= 1), one read)

(the cost model: `read_cost`), and this pass lowers the largest per-GPU sum of that cost
by swapping slots between the costliest GPU and the others, one pair of slots at a time.
Replica counts and node locality do not change. A GPU's tokens also set its share of the
dispatch and combine all-to-all, which reads do not enter: raising the row's busiest GPU
tokens by one costs `dispatch_tokens` (inf: the pass never raises them), so the pass does
not make the exchange slower by more than it makes the GEMMs faster. A row keeps the
result only when this objective (`objective`) falls by more than `min_gain` (relative):
each swap is two copies. A row whose every slot expects at least `WARM_TOKENS` tokens per
step is left to the token balance, tiles or not (with `tile_rows` 0 every such slot reads
once, the same on every GPU; with tiles only rounding differs): only the catch-up below
looks at it.

Kept layouts keep the replica counts they started from (those of the start-up placement
at first), which token balance cannot tell apart and reads can: a row costlier than a
fresh plan of the same load, DeepSeek's replica counts packed for tokens
(`solve.fresh_packing`, `read_cost.layer_cost`), catches up with it, through those
counts when that moves less; from scratch or from the start-up placement, a row that
neither gets there takes that plan relabelled (`spread_reads`). The runtime's defaults
(`EplbConfig.read_tokens`, `dispatch_tokens`, `tile_rows`) and what they were measured
against: benchmarks/README.md, issue 29 ("Target 3 ... on by default", 2026-12-04 and
2026-12-05 (fourth)).
"""
from __future__ import annotations

import numpy as np
import torch

from eplb.core.policy.base import DEFAULT_TILE_ROWS
from eplb.core.policy.balanced.moves import align, transition
from eplb.core.policy.balanced.read_cost import Reference, expert_tokens, slot_figures
from eplb.core.policy.balanced.refinement import improve_max
from eplb.core.policy.balanced.rows import REL_EPS, counts_of, gpu_sums, max_load, presence, take

WARM_TOKENS = 8.0  # a slot expecting this many tokens per step is empty with p < 0.04%
# a row costlier than the fresh reference catches up with it pricing a token more on its
# busiest GPU at one token of work (not `dispatch_tokens`): the reference's own cost counts
# its tokens at that price (benchmarks/README.md, issue 29, 2026-12-04)
CATCH_UP_DISPATCH_TOKENS = 1.0
READ_ITERS = 200  # most swaps per row (the search stops earlier when no swap gains)
SWAP_MIN_GAIN = 1e-4  # a swap must lower the costliest GPU by this fraction of the mean GPU cost
EXCLUDED = 1e300  # swap_down: what an excluded swap adds to its score (a few still sum below inf)


def spread_reads(w: np.ndarray, p2l: np.ndarray, m: int, step_choices: float, read_tokens: float,
                 rows_per_layer: int = 1, min_gain: float = 0.0,
                 dispatch_tokens: float = np.inf, tile_rows: float = DEFAULT_TILE_ROWS,
                 reference: Reference | None = None,
                 reference_p2l: np.ndarray | None = None) -> np.ndarray:
    """The decode-aware pass over a plan.

    w [L, n] loads of each layer; p2l [L * rows_per_layer, p] the plan's rows (with nodes:
    one row per (layer, node), `m` GPUs each); step_choices: token-expert choices per step
    and layer over all GPUs (tokens x top_k); read_tokens: the cost of one weight read in
    tokens; tile_rows: the rows of one GEMM tile, each of which reads the weights again
    (0: one read per non-empty slot). Rows are improved by swaps when that lowers their
    largest GPU cost by more than `min_gain` (relative). dispatch_tokens: the price of one
    more token on a row's busiest GPU (inf here, never raised; the planner passes
    `PolicyOptions.dispatch_tokens`, 40 by default).

    reference: the cost of a fresh plan of each layer (`solve.fresh_packing`,
    `read_cost.layer_cost`): its largest GPU cost and busiest GPU's tokens [L], its replica counts (DeepSeek's: the
    second candidate below moves to them) and per-slot figures [L, n], which the
    candidates reuse where their counts are the same. A row costlier than its
    layer's reference cost is brought down to it whatever `min_gain` says, by whichever of
    two candidates gets there with fewer moves: swaps alone, or (one row per layer) first
    the move to DeepSeek's replica counts with one copy per changed count
    (`moves.transition`) and the tokens re-balanced, then swaps; its busiest GPU's tokens
    may then rise to the reference's, and beyond at `CATCH_UP_DISPATCH_TOKENS` per token
    (never with `dispatch_tokens` inf). With `reference_p2l` [L, p] (that fresh plan; one
    row per layer; given when no layout is worth keeping: from scratch, or from the
    start-up placement) a third candidate is the fresh plan itself, its GPUs relabelled
    towards the row (`moves.align`): it is at the reference's cost, so a row over it
    always gets there, moving the most when neither other candidate does. Kept layouts
    otherwise keep the replica counts they started from, which token balance cannot tell
    apart but tiles can (benchmarks/README.md, issue 29).
    Returns the rows with the lowest largest GPU cost found."""
    if read_tokens <= 0 or step_choices <= 0 or m < 2:
        return p2l
    L, n = w.shape
    R, p = p2l.shape
    layer = np.arange(R) // rows_per_layer  # [R] the layer of each row
    # per layer, not per row: a layer's rows (nodes) hold disjoint experts, so a layer's
    # replica counts are those of the row holding the expert, and a row only ever reads its
    # own experts' entries below ([L, n] arrays, not [R, n]: 4x smaller at 4 nodes)
    lam_e = expert_tokens(w, step_choices)  # [L, n] tokens per step of each expert
    c = counts_of(p2l.reshape(L, -1), n)  # [L, n] replica counts
    lam = lam_e / np.maximum(c, 1)  # [L, n] ... on one slot of it
    r = layer[:, None]  # [R, 1] a row's entries of the [L, n] arrays
    at = p2l + r * n  # [R, p] each slot's entry of the flat [L, n] arrays (a flat take: 2x faster)
    # rows whose every slot reads anyway (each expects WARM_TOKENS or more) are left to the
    # token balance, tiles or not: their reads differ from GPU to GPU by the rounding of
    # tiles at most, and searching every warm row costs tens of ms at the DeepSeek-V3 shape.
    # Only the catch-up with the reference looks at every row
    lam_s = lam.ravel().take(at)  # [R, p] tokens per step of each slot
    cold = (lam_s < WARM_TOKENS).any(1)  # [R]
    look = np.flatnonzero(cold) if reference is None else np.arange(R)  # [R'] rows costed
    if not look.size:
        return p2l
    # a slot's cost is that of one slot of its expert: costed per expert of the layers
    # looked at ([L', n], fewer entries than their rows' slots), then gathered per slot
    seen = np.zeros(L, dtype=bool)
    seen[layer[look]] = True
    lays = np.flatnonzero(seen)  # [L'] the layers of the rows looked at (np.unique: 0.3 ms)
    if lays.size == L:  # (no copies of the [L, n] arrays)
        cost_e = slot_figures(lam_e, c, reference, lays, read_tokens, tile_rows, lam)[0]  # [L, n]
    else:
        cost_e = np.zeros((L, n))
        cost_e[lays] = slot_figures(lam_e[lays], c[lays], reference, lays, read_tokens, tile_rows, lam[lays])[0]
    sums = np.zeros((R, m))
    sums[look] = gpu_sums(cost_e.ravel().take(at[look]), m)  # [R', m]
    top = sums.max(1)  # [R]
    base_tok = np.zeros(R)  # [R] the busiest GPU's tokens, on the rows searched below

    def expert_cost(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[R'] (rows looked at) -> ([R', n], [R', n]): one slot's cost and tokens of each expert."""
        return cost_e[layer[rows]], lam[layer[rows]]
    # swaps keep a row's total cost, so no GPU ends below the mean: rows whose costliest GPU
    # is within min_gain of the mean cannot gain enough (most rows when a plan is in force)
    can = cold & (top * (1.0 - min_gain) > sums.mean(1) * (1.0 + REL_EPS))
    out = p2l.copy()
    over = np.zeros(R, dtype=bool)
    if reference is not None:
        ref_cost, ref_tok = reference.cost[layer], reference.tokens[layer]  # [R]
        over = top > ref_cost * (1.0 + REL_EPS)  # costlier than the fresh reference
    # two kinds of rows, each with its own rule for keeping the result:
    # 1. within the reference (or without one): swaps alone, kept when they gain min_gain;
    # 2. costlier than the reference: brought down to it, whatever min_gain, by the
    #    candidate (swaps alone, or DeepSeek's counts first) that gets there in fewer moves
    searched = np.flatnonzero(can | over)
    if not searched.size:
        return out
    base_tok[searched] = gpu_sums(lam_s[searched], m).max(1)
    rows = np.nonzero(can & ~over)[0]
    if rows.size:
        cost, lam_r = expert_cost(rows)  # [R', n] each
        new = swap_down(cost, lam_r, p2l[rows], m, n, READ_ITERS, dispatch_tokens)  # [R', p]
        after = objective(cost, lam_r, new, m, dispatch_tokens, base_tok[rows])
        keep = after < top[rows] * (1.0 - min_gain)
        out[rows[keep]] = new[keep]
    rows = np.nonzero(over)[0]
    if rows.size:
        # the busiest GPU's tokens may rise to the reference's, then at the lower of the two
        # prices; dispatch_tokens inf: never (inf stays inf: the min of the two would be 1)
        price = dispatch_tokens if np.isinf(dispatch_tokens) else min(dispatch_tokens, CATCH_UP_DISPATCH_TOKENS)
        cap = base_tok[rows] if np.isinf(price) else np.maximum(base_tok[rows], ref_tok[rows])  # [R']
        target = ref_cost[rows]  # [R']
        cands = [p2l[rows]]
        if rows_per_layer == 1:  # the row holds every expert: DeepSeek's counts are the row's
            wr, moved = w[rows], p2l[rows].copy()
            total = w.sum(1)[layer[rows]]  # [R'] the layer's load
            c_ds = reference.counts[rows]  # [R', n] (DeepSeek's: `solve.fresh_packing`)
            ch = np.flatnonzero((counts_of(moved, n) != c_ds).any(1))  # rows whose counts change
            if ch.size:  # (`transition` keeps a row at its counts as it is)
                moved[ch] = transition(wr[ch], moved[ch], c_ds[ch], m)
            # the copies land where the surplus replicas were: re-balance the tokens first
            # (max-GPU moves to the token cap, in load units); skipped when no row is above
            # the cap, where it moves nothing (it is called on all rows or none: the rows it
            # gets set how widely it searches)
            cap_load = cap * total / step_choices  # [R']
            if ch.size or (max_load(wr, moved, m) > cap_load).any():
                moved, _ = improve_max(wr, moved, m, m, budget=READ_ITERS, target=cap_load, fix=True)
            cands.append(moved)
            if reference_p2l is not None:
                cands.append(align(reference_p2l[rows], p2l[rows], m, n))
        best, best_after, best_moves = p2l[rows], top[rows], np.zeros(rows.size, dtype=np.int64)
        lr = layer[rows]  # [R'] (the rows are whole layers here)
        for i, start in enumerate(cands):  # the first keeps its counts: its costs are known
            # a later candidate's row equal to the first's ends where the first's did, which
            # never beats it: only the rows where it differs are searched
            j = np.arange(rows.size) if i == 0 else np.flatnonzero((start != cands[0]).any(1))  # [J]
            if not j.size:
                continue
            start = start[j]
            cs, ls = expert_cost(rows) if i == 0 else slot_figures(lam_e[lr[j]], counts_of(start, n), reference,
                                                                   lr[j], read_tokens, tile_rows)
            new = swap_down(cs, ls, start, m, n, READ_ITERS, price, target[j], cap[j])
            after = objective(cs, ls, new, m, price, cap[j])
            moves = (new != p2l[rows[j]]).sum(1)
            # the first to reach the target with fewer moves; while none does, the lower cost
            done, was = after <= target[j] * (1.0 + REL_EPS), best_after[j] <= target[j] * (1.0 + REL_EPS)
            better = np.where(done & was, moves < best_moves[j], (done & ~was) | (~was & (after < best_after[j])))
            best[j] = np.where(better[:, None], new, best[j])
            best_after[j] = np.where(better, after, best_after[j])
            best_moves[j] = np.where(better, moves, best_moves[j])
        keep = best_after < top[rows] * (1.0 - REL_EPS)
        out[rows[keep]] = best[keep]
    return out


def objective(cost: np.ndarray, tokens: np.ndarray, p2l: np.ndarray, m: int,
              dispatch_tokens: float, base_tokens: np.ndarray | None = None) -> np.ndarray:
    """[R] what the pass lowers: the largest per-GPU cost of the rows `p2l [R, p]` (cost,
    tokens [R, n]: one slot's of each expert), plus `dispatch_tokens` x how far their
    busiest GPU's tokens exceed `base_tokens [R]` (those of the plan before the pass; inf
    when they exceed them and dispatch_tokens is inf)."""
    out = gpu_sums(take(cost, p2l), m).max(1)
    if base_tokens is None:
        return out
    rise = gpu_sums(take(tokens, p2l), m).max(1) - base_tokens * (1 + REL_EPS)
    if np.isinf(dispatch_tokens):
        return np.where(rise > 0, np.inf, out)
    return out + dispatch_tokens * np.maximum(rise, 0.0)


def swap_down(cost: np.ndarray, tokens: np.ndarray, p2l: np.ndarray, m: int, n: int,
              iters: int, dispatch_tokens: float = np.inf, target: np.ndarray | None = None,
              cap: np.ndarray | None = None) -> np.ndarray:
    """Greedy swaps that lower every row's largest per-GPU cost, all rows at once.

    cost [R, n], tokens [R, n]: one slot's cost and tokens per expert; p2l [R, p]. Each
    iteration takes the costliest GPU h of every row and applies the one swap of a slot
    of h with a slot of another GPU g that gives the lowest max(cost h, cost g), among
    swaps that lower h's cost, put no expert twice on a GPU and keep both GPUs' tokens
    at most the row's largest GPU tokens so far (`cap`); with a finite `dispatch_tokens`
    a swap may raise the cap, at that price per token. A swap must gain `SWAP_MIN_GAIN` of
    the row's mean GPU cost; a row without such a swap is done (nothing else changes it),
    so each iteration works on the rows still gaining. target [R] (optional): a row stops
    once its costliest GPU is at or below it; cap [R] (optional): the busiest GPU's tokens
    to start from (default: those of `p2l`)."""
    R, p = p2l.shape
    s = p // m
    if R == 0 or s == 0:
        return p2l
    p2l = p2l.copy()
    x = take(cost, p2l).reshape(R, m, s)  # [R, m, s] cost per slot
    t = take(tokens, p2l).reshape(R, m, s)  # [R, m, s] tokens per slot
    load, tok = x.sum(2), t.sum(2)  # [R, m]
    cap = (tok.max(1) if cap is None else np.maximum(cap, 0.0)) * (1 + REL_EPS)  # [R] no GPU may end above
    stop = np.zeros(R) if target is None else target * (1 + REL_EPS)  # [R]
    eps = np.maximum(SWAP_MIN_GAIN * load.mean(1), 1e-300)  # [R]
    on = presence(p2l, m, n)  # [R, m, n]
    on_f = on.reshape(-1)  # a view: GPU g of row r holds expert e at (r * m + g) * n + e
    gpus = np.arange(m)
    e3 = p2l.reshape(R, m, s)  # [R, m, s] a view: swaps below update p2l
    act = np.arange(R)  # rows still gaining
    # the [A, m, s_h, s_g] work arrays, allocated once (allocating them each iteration took
    # most of the time); an excluded swap scores about EXCLUDED or more instead of inf, so
    # the exclusions are sums, not masks (masked writes are slow). The arithmetic on them
    # runs in torch: its loops vectorise the broadcast operands, numpy's do not (2-4x
    # slower); the IEEE operations are numpy's of before (benchmarks/diag/check_identical.py
    # --reads: the same plans). The argmin runs in numpy, on a view of the same memory
    # (torch's is slower)
    shape4 = (R, m, s, s)
    score_buf, d_buf, top_buf = (torch.empty(shape4, dtype=torch.float64) for _ in range(3))
    price = EXCLUDED if np.isinf(dispatch_tokens) else dispatch_tokens  # per token over the cap
    for _ in range(iters):
        if act.size == 0:
            break
        A = act.size
        ra = np.arange(A)
        X, T, E, LD, TK = x[act], t[act], e3[act], load[act], tok[act]  # [A, m, s], [A, m]
        h = LD.argmax(1)  # [A] costliest GPU
        xh, th, eh = X[ra, h], T[ra, h], E[ra, h]  # [A, s]
        score, d, top = score_buf[:A], d_buf[:A], top_buf[:A]  # [A, m, s_h, s_g]
        # the exclusions ride on the costs: g's slot v holding an expert that h holds makes
        # v's cost EXCLUDED more (h's cost after the swap goes above EXCLUDED), h's slot u
        # holding an expert that g holds (or g being h) makes g's cost EXCLUDED more; a swap
        # excluded by neither has exactly the costs it would have without them
        # (gathers from the flat `on` by flat index: 2x faster than indexing it [R, m, n])
        X_ex = X + on_f.take(((act * m + h) * n)[:, None, None] + E) * EXCLUDED  # [A, m, s_g] g's expert on h
        no_g = on_f.take(((act[:, None] * m + gpus) * n)[:, :, None] + eh[:, None, :]) * EXCLUDED  # [A, m, s_h] h's expert on g
        no_g[ra, h] = EXCLUDED  # not with itself
        LD_ex = LD[:, :, None] + no_g  # [A, m, s_h]
        # torch.from_numpy: views, no copies
        torch.sub(torch.from_numpy(xh)[:, None, :, None], torch.from_numpy(X_ex)[:, :, None, :], out=d)  # the cost h sheds
        torch.sub(torch.from_numpy(LD[ra, h])[:, None, None, None], d, out=score)  # h's cost after the swap
        torch.add(torch.from_numpy(LD_ex)[..., None], d, out=top)  # g's cost after the swap
        torch.maximum(score, top, out=score)
        # a swap must make h cheaper by eps: one that does not scores at least h's cost less
        # eps, so it never passes `gain` below and never beats one that does
        torch.sub(torch.from_numpy(th)[:, None, :, None], torch.from_numpy(T)[:, :, None, :], out=d)  # the tokens h sheds
        torch.sub(torch.from_numpy(TK[ra, h])[:, None, None, None], d, out=top)
        torch.add(torch.from_numpy(TK)[:, :, None, None], d, out=d)
        torch.maximum(top, d, out=top)  # the pair's larger GPU tokens after the swap
        top.sub_(torch.from_numpy(cap[act])[:, None, None, None])  # above the row's cap: priced (or excluded)
        top.clamp_(min=0.0)
        if price != 1.0:  # (the catch-up's price: x 1 changes no bit)
            top.mul_(price)
        score.add_(top)
        score = score.numpy().reshape(A, -1)  # [A, m * s * s]
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
        act = act[load[act].max(1) > stop[act]]  # rows at their target are done
    return p2l
