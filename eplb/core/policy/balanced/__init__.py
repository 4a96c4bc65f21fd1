"""The `balanced` planner (registered as `default` too): better balance than DeepSeek EPLB,
no two replicas of one expert on one GPU, few moves when a previous placement is given,
optional weighted replicas.

Every step works on "rows": one row is one MoE layer (global placement) or one
(layer, node) pair (hierarchical placement). All rows are processed together with
numpy array operations; Python loops run over rounds or improvement iterations, never
over the experts or slots of a row. Shapes are written next to the arrays: R rows,
n experts per row, p slots per row, m GPUs per row, s = p / m slots per GPU.

The modules, one job each:

- `rows`: row-wise helpers (gathers, stable orders, GPU sums, presence maps);
- `budgets`: iteration budgets from the problem size (never from a clock);
- `replicas`: replica counts (DeepSeek's rule, capped at m so that no GPU needs two
  copies of an expert) and, with two slots per GPU, the counts with the best
  heavy-with-light pairing (exhaustive when a row has few count vectors, e.g. 8 experts
  on 8 GPUs, otherwise a hill-climb);
- `packing`: packing in rounds (heavy items to the light GPUs, light items to the heavy
  ones), duplicate repair, and the refill of GPUs dominated by one hot item (one GPU or
  several: such a GPU gets the coldest experts);
- `pairs`: pair exchanges between GPUs;
- `refinement`: moves aimed at the most loaded GPU
  (swaps, replica count changes; towards a target, first those that bring that GPU
  within it without putting another above it);
- `solve`: the from-scratch pipeline of the steps above, and on small problems up to
  three steps of count moves scored by re-packed placements (candidates among the hot
  experts) and DeepSeek's own placement as a second candidate (duplicates repaired,
  improved), kept per row when better: never worse than `deepseek` there;
- `moves`: planning with `previous` (keep what is within the target, move the rest
  through the change of replica counts or a few max-GPU moves, or relabel the
  from-scratch plan so that experts stay where they were);
- `topology`: expert groups onto nodes, then every (layer, node) is a row; on small
  problems a second candidate starts from DeepSeek's hierarchical placement (duplicates
  repaired) and the better one is kept per layer;
- `reads`: decode-aware packing (`options.read_tokens`): pair exchanges that balance tokens
  plus the weight reads of the slots (one per tile of `options.tile_rows` tokens, none for a
  slot with no token in a step), and the catch-up of a layer costlier than a fresh packing
  of DeepSeek's replica counts (`solve.fresh_packing`: the from-scratch plan's first step,
  made once for both);
- `read_cost`: the decode-aware pass's cost model (a slot's tokens plus its expected weight
  reads, `expected_tiles`; a placement's largest GPU cost, `layer_cost`, and the fresh
  reference's figures, `Reference`);
- `shares`: weighted replicas (water-filling shares, and the wrap-around chain: a
  placement built so that shares can reach the mean GPU load exactly).

How much of the improvement steps runs is set by the problem size (see `budgets`),
never by a clock: small problems run to convergence, DeepSeek-V3-sized ones take a few
milliseconds on one core.
"""
from __future__ import annotations

import numpy as np

from eplb.core.policy.base import DEFAULT_MOVE_TOLERANCE
from eplb.core.policy.deepseek import deepseek_policy
from eplb.core.policy.balanced.moves import HEAVY_ROWS, plan_rows
from eplb.core.policy.balanced.read_cost import layer_cost
from eplb.core.policy.balanced.reads import spread_reads
from eplb.core.policy.balanced.shares import plan_shares, replica_shares
from eplb.core.policy.balanced.solve import fresh_packing
from eplb.core.policy.balanced.topology import plan_hierarchical


def balanced_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    """Balanced expert placement (registered as `balanced` and as `default`).

    From the same inputs as DeepSeek EPLB it balances better: replica counts that fit the
    packing (a count search when GPUs have two slots, count-changing moves otherwise),
    packing in rounds, pair exchanges and moves on the most loaded GPU. Never two
    replicas of one expert on one GPU (unless a GPU has more slots than there are
    experts to fill them; then it returns DeepSeek's placement). With expert groups that
    divide over the nodes (`num_groups % num_nodes == 0`, num_nodes > 1) it keeps
    DeepSeek's node locality: whole groups go to nodes (G/nodes each, lowest max node
    load), and every replica of an expert stays on its group's node. Otherwise the
    placement is global, as DeepSeek's. Deterministic: stable orders with explicit
    tie-breaks, iteration budgets from the problem size only, no randomness.

    `previous` (the placement in force) and `options.move_tolerance` (tol, default 0.03)
    trade balance for moves. A layer's target max GPU load is (1 + tol) x the
    from-scratch plan's, and on small problems never more than DeepSeek's own
    from-scratch plan of the same load (so that under a drifting load a kept layer is
    not worse than re-planning with DeepSeek). A layer within its target is kept as it
    is; otherwise two candidates start from `previous`: the move to the from-scratch
    replica counts with one copy per changed count (`moves.transition`), and
    `previous` itself, both then moved one or two slots at a time, aimed at the most
    loaded GPU (swaps, replica count changes), until they reach the target: first the
    moves that bring that GPU within the target and put no other GPU above it (a count
    change, one copy, before a swap, two), so that each overloaded GPU costs one move;
    the one that gets there with fewer copies is kept, and a layer that does not get
    there takes the from-scratch plan with its GPUs relabelled so that experts stay where
    they were when possible. tol = 0: the from-scratch balance whatever it moves; 0.03
    moves 15.8% of the copies per rebalance in the ESFT jitter replay of
    benchmarks/planner.py (DeepSeek from scratch: 92.1%) and is no worse out of sample
    there, and 11-16% of DeepSeek's copies in the smooth-drift replays of the ESFT tasks
    (section 7); larger values move less and accept more in-sample imbalance (see
    benchmarks/README.md). On large problems (more than about 15,800 slots over all layers:
    `budgets.PREV_WORK` / (R p)^2 < 1) the step-by-step moves are skipped for time: a layer
    keeps its previous placement within tolerance, else takes the relabelled plan. In
    the hierarchical case the previous group-to-node assignment is kept while its max
    node load is within the same tolerance.

    With `options.step_choices` (the token-expert choices per step of a layer) a layer
    keeps its replica counts only while its heaviest replica expects fewer than
    `moves.HEAVY_ROWS` (8192) tokens per step or at most 1.5 times the from-scratch plan's
    heaviest: a prefill GEMM slows down with its largest group, which GPU token totals do
    not show (`moves`).

    `options.read_tokens` > 0 (decode-aware packing, not with weighted replicas): a last
    pass balances tokens plus the weight reads of the slots (one per `options.tile_rows`
    tokens, none for a slot that gets no token in a step; `options.step_choices`
    token-expert choices per step; see `reads`), kept per row when it lowers the largest
    GPU cost by more than tol (any gain without `previous`). With tiles and a global
    placement, a layer that costs more that way than DeepSeek's replica counts packed
    afresh is brought down to that cost (through those counts when that moves less). From
    scratch or from the start-up placement, where no layout is worth keeping, a layer
    that neither gets there takes that packing, its GPUs relabelled: the first plan then
    moves more, and the plans after it less (benchmarks/README.md, issue 29, 2026-12-05
    (fourth)).

    `options.weighted`: also return per-slot shares [L, P] (each expert's shares sum to
    1). With shares, balance is limited only by where the replicas are (a flow problem),
    so the planner also builds a placement for them: the wrap-around chain of
    `shares.chain_shares`, which reaches the mean GPU load exactly when its greedy order
    succeeds (every real trace at EP 8-64 with one redundant slot per GPU); per layer it
    is kept against water-filled shares on the unweighted plan when its max GPU load is
    lower (by more than tol when `previous` is given; the chain is then relabelled
    towards `previous`). With P = N there is nothing to share and the shares are all 1.

    benchmarks/planner.py measures all of this against `deepseek` (see benchmarks/README.md).
    """
    w = np.asarray(load, dtype=np.float64)  # [L, N]
    L, N = w.shape
    P, M = int(num_slots), int(num_gpus)
    tol = DEFAULT_MOVE_TOLERANCE if options is None else float(options.move_tolerance)
    weighted = False if options is None else bool(options.weighted)
    prev = None if previous is None else np.asarray(previous.physical_to_logical, dtype=np.int64)  # [L, P]
    k = int(num_nodes)
    hierarchical = k > 1 and num_groups % k == 0
    if (P * k > N * M) if hierarchical else (P > N * M):
        # more slots per GPU than experts to fill them: duplicates cannot be avoided
        p2l = deepseek_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)
        return (p2l, replica_shares(w, p2l, M)) if weighted else p2l
    # the load of HEAVY_ROWS tokens per step in each layer [L], when the tokens per step are known
    choices = 0.0 if options is None else float(options.step_choices)
    heavy = HEAVY_ROWS * w.sum(1) / choices if choices > 0 else None
    reads = 0.0 if options is None else float(options.read_tokens)
    tiles = 0.0 if options is None else float(options.tile_rows)
    fresh = None
    if hierarchical:
        p2l = plan_hierarchical(w, P, M, k, int(num_groups), prev, tol, heavy)
    else:
        # decode-aware with tiles: no layer may cost more than a fresh packing of DeepSeek's
        # counts, the first step of the from-scratch plan (made once, for both)
        fresh = fresh_packing(w, P, M) if reads > 0 and tiles > 0 and not weighted else None
        p2l = plan_rows(w, P, M, prev, tol, heavy, fresh)
    if not weighted:
        if reads > 0:  # decode-aware: spread the weight reads of cold slots (`reads`)
            rows = k if hierarchical else 1
            reference = ref_p2l = None
            if fresh is not None:
                c_ds, ref_p2l, _ = fresh  # [L, N], [L, P]
                reference = layer_cost(w, ref_p2l, M, choices, reads, tiles, c_ds)
                if prev is not None and not previous.is_initial:
                    ref_p2l = None  # a layout worth keeping: the catch-up moves it, never replaces it
            p2l = spread_reads(w, p2l.reshape(L * rows, P // rows), M // rows, choices, reads, rows,
                               min_gain=tol if prev is not None else 0.0,
                               dispatch_tokens=float(options.dispatch_tokens), tile_rows=tiles,
                               reference=reference, reference_p2l=ref_p2l).reshape(L, P)
        return p2l
    return plan_shares(w, p2l, M, k, hierarchical, prev, tol)
