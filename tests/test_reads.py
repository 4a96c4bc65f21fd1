"""Decode-aware packing (`read_tokens`, eplb.core.policy.balanced.reads). With `tile_rows` 0
(one read per non-empty slot) the pass lowers the largest per-GPU cost of tokens plus
weight reads, computed here on its own from the placement, keeps replica counts, the
one-replica-per-GPU rule and node locality, and does nothing where every slot is warm.
With tiles (`tile_rows` > 0, the default) a slot reads once per tile of its tokens, and a
layer costlier than a fresh packing of DeepSeek's replica counts catches up with it."""
from __future__ import annotations

import math

import numpy as np
import pytest

from eplb.core.planning import plan


def _loads(seed: int, L: int = 6, N: int = 64, sigma: float = 2.5) -> np.ndarray:
    """[L, N]: lognormal loads (a few hot experts, many cold), each layer summing to 1e6."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, sigma, size=(L, N))
    return w / w.sum(1, keepdims=True) * 1e6


def _exact_tiles(lam: float, tile_rows: float) -> float:
    """E[ceil(X / tile_rows)] for X ~ Poisson(lam), by summing the pmf term by term."""
    if lam <= 0:
        return 0.0
    if tile_rows <= 0:
        return 1.0 - math.exp(-lam)
    total = 0.0
    for x in range(1, int(lam + 20 * math.sqrt(lam) + 60)):
        total += math.exp(x * math.log(lam) - lam - math.lgamma(x + 1)) * math.ceil(x / tile_rows)
    return total


def _gpu_cost(load: np.ndarray, p2l: np.ndarray, M: int, choices: float, read: float,
              tile_rows: float = 0.0) -> np.ndarray:
    """[L] the largest per-GPU expected cost, tokens + read x E[reads] (tile_rows 0:
    P(slot not empty); else E[tiles], `_exact_tiles`), loop by loop."""
    L, P = p2l.shape
    S = P // M
    out = np.zeros(L)
    for layer in range(L):
        total = load[layer].sum()
        for g in range(M):
            cost = 0.0
            for e in p2l[layer, g * S:(g + 1) * S]:
                lam = load[layer, e] / total * choices / int((p2l[layer] == e).sum())
                cost += lam + read * _exact_tiles(lam, tile_rows)
            out[layer] = max(out[layer], cost)
    return out


def _check_same_counts_no_duplicates(a: np.ndarray, b: np.ndarray, M: int, N: int) -> None:
    L, P = a.shape
    for layer in range(L):
        assert np.array_equal(np.bincount(a[layer], minlength=N), np.bincount(b[layer], minlength=N))
        for g in range(M):
            gpu = b[layer].reshape(M, -1)[g]
            assert len(set(gpu.tolist())) == gpu.size, f"layer {layer} GPU {g} holds an expert twice"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reads_pass_lowers_the_largest_gpu_cost(seed):
    N, M, P = 64, 8, 72
    load = _loads(seed)
    choices, read = M * 16 * 4.0, 100.0  # 16 tokens per GPU, top-4: many slots may be empty
    base = plan(load, M, P).physical_to_logical
    aware = plan(load, M, P, read_tokens=read, tile_rows=0.0, step_choices=choices).physical_to_logical
    _check_same_counts_no_duplicates(base, aware, M, N)
    before = _gpu_cost(load, base, M, choices, read)
    after = _gpu_cost(load, aware, M, choices, read)
    assert (after <= before + 1e-9).all()
    assert (after < before * 0.999).any(), (before, after)


def test_reads_pass_keeps_node_locality():
    N, M, P, nodes, groups = 64, 8, 72, 2, 4
    load = _loads(3)
    choices = M * 16 * 4.0
    base = plan(load, M, P, nodes, groups).physical_to_logical
    aware = plan(load, M, P, nodes, groups, read_tokens=100.0, tile_rows=0.0, step_choices=choices).physical_to_logical
    _check_same_counts_no_duplicates(base, aware, M, N)
    half = P // nodes
    for layer in range(load.shape[0]):
        for e in range(N):
            assert set(np.nonzero(base[layer] == e)[0] // half) == set(np.nonzero(aware[layer] == e)[0] // half)
    assert not np.array_equal(base, aware)  # the pass did something within the nodes
    assert (_gpu_cost(load, aware, M, choices, 100.0) <= _gpu_cost(load, base, M, choices, 100.0) + 1e-9).all()


def test_warm_slots_leave_the_plan_as_it_is():
    load = _loads(4)
    M, P = 8, 72
    base = plan(load, M, P).physical_to_logical
    # a million choices per step: every slot expects thousands of tokens, every slot reads
    warm = plan(load * 0 + 1.0 + load, M, P, read_tokens=100.0, tile_rows=0.0, step_choices=1e9).physical_to_logical
    assert np.array_equal(plan(load * 0 + 1.0 + load, M, P).physical_to_logical, warm)
    assert base.shape == warm.shape


def test_an_all_zero_layer_plans_without_nan():
    """A window without traffic in one layer is legitimate (plan()'s contract): the pass
    leaves that layer as the plan without it and warns of nothing."""
    import warnings

    load = _loads(6)
    load[2] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 0/0 in the pass would warn
        aware = plan(load, 8, 72, read_tokens=100.0, tile_rows=0.0, step_choices=8 * 16 * 4.0).physical_to_logical
    assert np.array_equal(aware[2], plan(load, 8, 72).physical_to_logical[2])


def test_with_previous_small_gains_do_not_move():
    M, P = 8, 72
    load = _loads(5)
    choices = M * 16 * 4.0
    prev = plan(load, M, P)
    # the plan in force is already the token-balanced plan of this load: a read gain of less
    # than the tolerance must not be bought with copies, a large tolerance keeps every row
    kept = plan(load, M, P, previous=prev, move_tolerance=5.0, read_tokens=100.0, tile_rows=0.0, step_choices=choices)
    assert np.array_equal(kept.physical_to_logical, prev.physical_to_logical)


@pytest.mark.parametrize("kw, msg", [
    (dict(read_tokens=True, step_choices=10.0), "read_tokens"),
    (dict(read_tokens=-1.0, step_choices=10.0), "read_tokens"),
    (dict(read_tokens=float("inf"), step_choices=10.0), "read_tokens"),
    (dict(read_tokens=10.0), "step_choices > 0"),
    (dict(read_tokens=10.0, step_choices=float("nan")), "step_choices"),
])
def test_bad_read_settings_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        plan(_loads(0), 8, 72, **kw)


def _gpu_tokens(load: np.ndarray, p2l: np.ndarray, M: int, choices: float) -> np.ndarray:
    """[L] the largest per-GPU expected tokens per step, loop by loop."""
    L, P = p2l.shape
    S = P // M
    out = np.zeros(L)
    for layer in range(L):
        total = load[layer].sum()
        for g in range(M):
            tok = sum(load[layer, e] / total * choices / int((p2l[layer] == e).sum())
                      for e in p2l[layer, g * S:(g + 1) * S])
            out[layer] = max(out[layer], tok)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_dispatch_tokens_price_the_busiest_gpu_tokens(seed):
    """The busiest GPU's tokens set its all-to-all: with `dispatch_tokens` inf the pass
    never raises them; with a price D, the largest GPU cost plus D x their rise (both
    computed here by loops) never exceeds the largest GPU cost of the plan without the
    pass; with D = 0 the pass is free to raise them and reaches at least as low a cost."""
    N, M, P = 64, 8, 72
    load = _loads(seed)
    choices, read = M * 16 * 4.0, 100.0
    base = plan(load, M, P).physical_to_logical
    cost0, tok0 = _gpu_cost(load, base, M, choices, read), _gpu_tokens(load, base, M, choices)
    costs = {}
    for d in (float("inf"), 40.0, 0.0):
        aware = plan(load, M, P, read_tokens=read, tile_rows=0.0, step_choices=choices, dispatch_tokens=d).physical_to_logical
        _check_same_counts_no_duplicates(base, aware, M, N)
        cost, tok = _gpu_cost(load, aware, M, choices, read), _gpu_tokens(load, aware, M, choices)
        if d == float("inf"):
            assert (tok <= tok0 * (1 + 1e-9)).all(), (tok, tok0)
            assert (cost <= cost0 + 1e-9).all()
        else:
            assert (cost + d * np.maximum(tok - tok0, 0.0) <= cost0 + 1e-9).all(), (d, cost, tok, cost0, tok0)
        costs[d] = cost
    assert costs[0.0].sum() <= costs[float("inf")].sum() + 1e-9


@pytest.mark.parametrize("M,P", [(8, 72), (16, 80)])
def test_dispatch_tokens_inf_holds_in_the_catch_up(M, P):
    """With tiles (tile_rows > 0) a global layer costlier than the fresh reference catches up
    with it, and may raise its busiest GPU's tokens at CATCH_UP_DISPATCH_TOKENS per token;
    with `dispatch_tokens` inf it never raises them (computed here by loops), from scratch
    or from a previous placement. (Once the catch-up priced them at min(inf, 1) = 1: 313
    GPU-token rises over these loads.)"""
    load = _loads(7)
    rises, moved = 0, 0
    for tok in (2, 16):
        choices = M * tok * 8.0
        for prev in (None, plan(load * np.random.default_rng(7).uniform(0.5, 1.5, load.shape), M, P)):
            base = plan(load, M, P, previous=prev, step_choices=choices).physical_to_logical
            aware = plan(load, M, P, previous=prev, read_tokens=100.0, step_choices=choices, tile_rows=128.0,
                         dispatch_tokens=float("inf")).physical_to_logical
            rises += int((_gpu_tokens(load, aware, M, choices) > _gpu_tokens(load, base, M, choices) * (1 + 1e-9)).sum())
            moved += int((aware != base).any(1).sum())
    assert rises == 0
    assert moved > 0  # the pass did act on these loads


def test_a_free_dispatch_lets_the_pass_raise_tokens_somewhere():
    """The price is not dead code: over a few loads, D = 0 raises the busiest GPU's tokens
    in some layer (to cut reads), which D = inf never does."""
    M, P = 8, 72
    choices, read = M * 16 * 4.0, 100.0
    raised = 0
    for seed in range(4):
        load = _loads(seed)
        base = plan(load, M, P).physical_to_logical
        free = plan(load, M, P, read_tokens=read, tile_rows=0.0, step_choices=choices, dispatch_tokens=0.0).physical_to_logical
        raised += int((_gpu_tokens(load, free, M, choices) > _gpu_tokens(load, base, M, choices) * (1 + 1e-9)).sum())
    assert raised > 0


@pytest.mark.parametrize("value", [-1.0, float("nan"), True, "1"])
def test_bad_dispatch_tokens_are_refused(value):
    with pytest.raises(ValueError, match="dispatch_tokens must be a number >= 0"):
        plan(_loads(0), 8, 72, read_tokens=10.0, step_choices=10.0, dispatch_tokens=value)


def test_swap_down_and_objective_hold_the_token_cap_on_their_own():
    """Both guards of `dispatch_tokens` inf, each without the other: the swap search never
    takes a swap that lifts a GPU above the row's busiest tokens, and the objective that
    decides whether a row keeps the pass's result is inf for a row whose busiest GPU
    gained tokens (sums done here by hand)."""
    from eplb.core.policy.balanced.reads import objective, swap_down

    rng = np.random.default_rng(11)
    R, m, s, n = 5, 4, 6, 30
    p2l = np.stack([rng.permutation(n)[: m * s] for _ in range(R)])  # [R, p] distinct experts
    tokens = rng.lognormal(0.0, 1.5, size=(R, n))  # [R, n]
    cost = tokens + 50.0 * -np.expm1(-tokens)
    out = swap_down(cost, tokens, p2l, m, n, 200)
    per_gpu = lambda v, q: np.array([[v[r, q[r, g * s:(g + 1) * s]].sum() for g in range(m)] for r in range(R)])
    assert (per_gpu(tokens, out).max(1) <= per_gpu(tokens, p2l).max(1) * (1 + 1e-9)).all()
    assert not np.array_equal(out, p2l)  # it did swap
    # a row where the busiest GPU's tokens rose: swap the hottest expert onto the busiest GPU
    t0 = per_gpu(tokens, p2l)
    raised = p2l.copy()
    r = 0
    h = int(t0[r].argmax())
    hot = max(range(m * s), key=lambda i: tokens[r, p2l[r, i]] if i // s != h else -1)
    cold = min(range(h * s, (h + 1) * s), key=lambda i: tokens[r, p2l[r, i]])
    raised[r, hot], raised[r, cold] = p2l[r, cold], p2l[r, hot]
    got = objective(cost, tokens, raised, m, float("inf"), t0.max(1))
    assert np.isinf(got[0]) and np.isfinite(got[1:]).all()
    assert got[1:] == pytest.approx(per_gpu(cost, raised)[1:].max(1))


def _swap_down_by_hand(cost, tokens, p2l, m, n, iters, dispatch_tokens, target, cap):
    """`swap_down` written as loops, one row at a time: every swap of a slot of the
    costliest GPU h with a slot of another GPU g, scored max(h after, g after) plus
    dispatch_tokens per token the pair's larger GPU tokens end above the cap (excluded
    when inf), experts never twice on a GPU; the lowest score in (g, u, v) order wins if it
    lowers h by the minimum gain."""
    from eplb.core.policy.balanced.reads import REL_EPS, SWAP_MIN_GAIN
    R, p = p2l.shape
    s = p // m
    out = p2l.copy()
    for r in range(R):
        e = out[r].reshape(m, s)  # a view
        load = lambda g: sum(cost[r, x] for x in e[g])
        tok = lambda g: sum(tokens[r, x] for x in e[g])
        eps = max(SWAP_MIN_GAIN * np.mean([load(g) for g in range(m)]), 1e-300)
        lim = (max(tok(g) for g in range(m)) if cap is None else max(cap[r], 0.0)) * (1 + REL_EPS)
        for _ in range(iters):
            loads = [load(g) for g in range(m)]
            h = int(np.argmax(loads))
            if target is not None and loads[h] <= target[r] * (1 + REL_EPS):
                break
            best = None
            for g in range(m):
                for u in range(s):
                    for v in range(s):
                        a, b = e[h, u], e[g, v]
                        if g == h or a in e[g] or b in e[h]:
                            continue
                        d = cost[r, a] - cost[r, b]
                        if d <= eps:
                            continue
                        dt = tokens[r, a] - tokens[r, b]
                        over = max(tok(h) - dt, tok(g) + dt) - lim
                        if over > 0 and np.isinf(dispatch_tokens):
                            continue
                        sc = max(loads[h] - d, loads[g] + d) + (dispatch_tokens * max(over, 0.0) if over > 0 else 0.0)
                        if best is None or sc < best[0]:
                            best = (sc, g, u, v)
            if best is None or not best[0] < loads[h] - eps:
                break
            _, g, u, v = best
            e[h, u], e[g, v] = e[g, v], e[h, u]
            lim = max(lim, tok(h), tok(g))
    return out


@pytest.mark.parametrize("dispatch_tokens,with_target", [(float("inf"), False), (40.0, False), (1.0, True)])
def test_swap_down_is_the_search_written_as_loops(dispatch_tokens, with_target):
    """The vectorised swap search (all rows at once, exclusions as large sums) makes the
    very swaps of the loops above, on random rows with hot, cold and replicated experts."""
    from eplb.core.policy.balanced.reads import swap_down

    rng = np.random.default_rng(5)
    R, m, s, n = 6, 4, 5, 16
    rows = []
    while len(rows) < R:  # every expert once, 4 of them twice, never twice on one GPU
        row = rng.permutation(np.concatenate([np.arange(n), rng.choice(n, m * s - n, replace=False)]))
        if all(len(set(row[g * s:(g + 1) * s])) == s for g in range(m)):
            rows.append(row)
    p2l = np.stack(rows)  # [R, p]
    # whole numbers: sums are exact in any order, so ties (replicas of one expert on two GPUs
    # make many) fall to the first swap in both versions, not to rounding
    tokens = np.floor(rng.lognormal(1.0, 1.5, size=(R, n)))  # [R, n]
    cost = tokens + 30.0 * (tokens > 0)
    target = cap = None
    if with_target:
        per = np.array([[cost[r, p2l[r, g * s:(g + 1) * s]].sum() for g in range(m)] for r in range(R)])
        target = per.mean(1) + 0.3 * (per.max(1) - per.mean(1))  # [R] part of the way down
        cap = np.array([max(tokens[r, p2l[r, g * s:(g + 1) * s]].sum() for g in range(m)) for r in range(R)]) * 0.9
    got = swap_down(cost, tokens, p2l, m, n, 50, dispatch_tokens, target, cap)
    want = _swap_down_by_hand(cost, tokens, p2l, m, n, 50, dispatch_tokens, target, cap)
    assert not np.array_equal(want, p2l)  # the loops did swap
    assert np.array_equal(got, want)


def test_expected_tiles_is_the_poisson_mean_of_the_tile_count():
    from eplb.core.policy.balanced.read_cost import expected_tiles

    lams = np.array([0.0, 0.2, 5.0, 50.0, 100.0, 120.0, 128.0, 140.0, 200.0, 257.0, 1000.0, 3000.5])
    for tile_rows in (64.0, 128.0):
        got = expected_tiles(lams.copy(), tile_rows)
        want = np.array([_exact_tiles(x, tile_rows) for x in lams])
        assert np.abs(got - want).max() < 0.01, (tile_rows, got, want)  # the normal tail's error
    got0 = expected_tiles(lams.copy(), 0.0)  # one read per non-empty slot, exactly
    assert np.array_equal(got0, -np.expm1(-lams))


def test_expected_tiles_leaves_out_only_terms_below_rounding():
    """Every slot whose tiles past the first count (a normal-tail term above 1e-15) gets
    them: on a dense grid of expected tokens, from cold slots to several tiles, the
    function equals the whole sum of the tail terms (every k, by `math.erfc`) to 1e-12, so
    its choice of the few slots and terms it computes drops nothing that counts."""
    from eplb.core.policy.balanced.read_cost import expected_tiles

    lams = np.concatenate([np.linspace(0.0, 400.0, 4001), np.linspace(400.0, 3000.0, 521)])  # [K]
    for tile_rows in (16.0, 64.0, 128.0):
        got = expected_tiles(lams.copy(), tile_rows)
        want = np.array([-math.expm1(-x) + sum(0.5 * math.erfc((k * tile_rows + 0.5 - x) / math.sqrt(2.0 * x))
                                               for k in range(1, int((x + 12.0 * math.sqrt(x)) / tile_rows) + 2)) if x > 0 else 0.0
                         for x in lams])
        assert np.abs(got - want).max() < 1e-12, tile_rows


def test_erfc_matches_the_standard_library():
    from eplb.core.policy.balanced.read_cost import erfc

    x = np.linspace(-6.0, 6.0, 241)
    want = np.array([math.erfc(v) for v in x])
    assert (np.abs(erfc(x) - want) <= 1e-13 * want).all()  # relative, to double precision
    assert erfc(x.reshape(1, -1, 1)).shape == (1, 241, 1)


@pytest.mark.parametrize("start_up", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_kept_layout_catches_up_with_deepseeks_cost_through_its_counts(seed, start_up):
    """The start-up layout's spare replicas sit on arbitrary experts: as the start-up
    placement, or as a plan in force (the same layout marked planned, which the catch-up
    may only move, not replace). With tiles counted, the planner moves it to within 2% of
    DeepSeek's fresh plan in the cost of tokens plus reads per 128-row tile (computed here
    by loops, with exact Poisson tile counts); counting one read per slot (tile_rows 0, the
    pass before the catch-up), some layer stays more than 3% above it."""
    from eplb.core.placement import Placement

    L, N, M, P = 4, 64, 8, 72
    load = _loads(seed, L, N, sigma=1.0)  # [L, N]
    choices, read = M * 128 * 4.0, 100.0  # 128 tokens per GPU, top-4: the hot slots overflow a tile
    prev = Placement.initial(L, N, P, M)
    if not start_up:
        prev = prev.with_physical_to_logical(prev.physical_to_logical, policy="default")  # as if planned
    kw = dict(previous=prev, read_tokens=read, step_choices=choices)
    tiles = plan(load, M, P, tile_rows=128.0, **kw).physical_to_logical
    one = plan(load, M, P, tile_rows=0.0, **kw).physical_to_logical
    ds = plan(load, M, P, policy="deepseek").physical_to_logical
    cost = {k: _gpu_cost(load, v, M, choices, read, 128.0) for k, v in
            (("tiles", tiles), ("one", one), ("deepseek", ds))}
    assert (cost["tiles"] <= cost["deepseek"] * 1.02).all(), cost
    assert (cost["one"] > cost["deepseek"] * 1.03).any(), cost
    assert (cost["tiles"] < cost["one"]).all(), cost
    _check_same_counts_no_duplicates(tiles, tiles, M, N)  # no GPU holds an expert twice
    counts = lambda p2l: np.stack([np.bincount(r, minlength=N) for r in p2l])  # noqa: E731
    assert not np.array_equal(counts(tiles), counts(prev.physical_to_logical))  # spares moved


def test_nodes_and_tile_rows_0_keep_the_pass_without_the_catch_up():
    """The catch-up needs every expert in a row: with nodes (rows per node) the plan with
    tiles and a large tolerance keeps the previous placement, as without tiles."""
    L, M, P, nodes, groups = 2, 8, 72, 2, 4
    load = _loads(9, L=L)
    choices = M * 128 * 4.0
    prev = plan(load, M, P, nodes, groups)
    for t in (0.0, 128.0):
        kept = plan(load, M, P, nodes, groups, previous=prev, move_tolerance=5.0, read_tokens=100.0,
                    step_choices=choices, tile_rows=t)
        assert np.array_equal(kept.physical_to_logical, prev.physical_to_logical), t


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True])
def test_bad_tile_rows_are_refused(value):
    from eplb.core.config import EplbConfig

    with pytest.raises(ValueError, match="tile_rows must be a finite number >= 0"):
        plan(_loads(0), 8, 72, read_tokens=10.0, step_choices=10.0, tile_rows=value)
    with pytest.raises(ValueError, match="tile_rows must be a finite number >= 0"):
        EplbConfig(tile_rows=value).verify(64, 8)


def test_a_row_over_the_fresh_reference_always_gets_down_to_it():
    """spread_reads on the first plans from the start-up placement (token-balanced, before
    any read is counted): every row whose cost (tokens plus
    expected reads per 128-row tile, as the pass counts them) is above that of the fresh
    reference ends at or below it. Swaps and DeepSeek's counts alone leave some of these
    rows above it; the fresh plan relabelled is the candidate that always gets there."""
    from eplb.core.placement import Placement
    from eplb.core.policy.balanced.read_cost import layer_cost
    from eplb.core.policy.balanced.solve import fresh_packing
    from eplb.core.policy.balanced.reads import spread_reads

    L, N, M, P = 4, 64, 8, 72
    choices, read = M * 128 * 4.0, 100.0  # 128 tokens per GPU, top-4: the hot slots overflow a tile
    over_rows = 0
    for seed in range(4):
        load = _loads(seed, L, N, sigma=1.0)  # [L, N]
        p2l = plan(load, M, P, previous=Placement.initial(L, N, P, M)).physical_to_logical  # [L, P]
        ref = fresh_packing(load, P, M)[1]  # [L, P]
        ref_cost = layer_cost(load, ref, M, choices, read)
        before = layer_cost(load, p2l, M, choices, read)[0]  # [L]
        out = spread_reads(load, p2l, M, choices, read, min_gain=0.03, dispatch_tokens=40.0,
                           reference=ref_cost, reference_p2l=ref)
        after = layer_cost(load, out, M, choices, read)[0]
        over = before > ref_cost[0] * (1 + 1e-9)
        over_rows += int(over.sum())
        assert (after[over] <= ref_cost[0][over] * (1 + 1e-9)).all(), (seed, after, ref_cost[0])
        _check_same_counts_no_duplicates(out, out, M, N)  # no GPU holds an expert twice
    assert over_rows >= 8


def test_from_the_start_up_placement_no_layer_costs_more_than_the_fresh_reference():
    """From the start-up placement, which no plan chose, every layer of a decode-aware plan
    costs at most the fresh reference (DeepSeek's counts packed for tokens) in tokens plus
    expected reads per tile: the catch-up may replace a start-up layer. The same layout
    marked as planned is only moved, never replaced, and some of its layers stay above."""
    from eplb.core.placement import Placement
    from eplb.core.policy.balanced.read_cost import layer_cost
    from eplb.core.policy.balanced.solve import fresh_packing

    L, N, M, P = 4, 64, 8, 72
    choices, read = M * 128 * 4.0, 100.0  # 128 tokens per GPU, top-4: the hot slots overflow a tile
    above = 0  # layers of the planned layout left above the reference
    for seed in range(6):
        load = _loads(seed, L, N, sigma=1.0)  # [L, N]
        start = Placement.initial(L, N, P, M)
        planned = start.with_physical_to_logical(start.physical_to_logical, policy="default")
        ref = layer_cost(load, fresh_packing(load, P, M)[1], M, choices, read)[0]  # [L]
        kw = dict(read_tokens=read, step_choices=choices)
        from_start = layer_cost(load, plan(load, M, P, previous=start, **kw).physical_to_logical, M, choices, read)[0]
        from_planned = layer_cost(load, plan(load, M, P, previous=planned, **kw).physical_to_logical, M, choices,
                                  read)[0]
        assert (from_start <= ref * (1 + 1e-9)).all(), (seed, from_start / ref)
        above += int((from_planned > ref * (1 + 1e-9)).sum())
    assert above >= 2


def test_the_catch_up_reuses_the_reference_s_per_slot_figures_exactly():
    """`slot_figures` takes a layer's per-slot cost and tokens from the fresh reference
    where the layer has the reference's replica counts, and computes them (`per_slot`)
    elsewhere: bit for bit `per_slot`'s numbers, whichever rows match, with tiles or
    without (the plans must not depend on the reuse)."""
    from eplb.core.policy.balanced.read_cost import expert_tokens, layer_cost, per_slot, slot_figures
    from eplb.core.policy.balanced.solve import fresh_packing
    from eplb.core.policy.balanced.rows import counts_of

    L, N, M, P = 6, 64, 8, 80
    load = _loads(3, L, N, sigma=1.5)  # [L, N]
    choices, read = M * 128 * 8.0, 100.0
    ref_p2l = fresh_packing(load, P, M)[1]  # [L, P]
    c_ref = counts_of(ref_p2l, N)  # [L, N]
    c_other = c_ref.copy()  # other counts: one replica of each layer's most replicated expert to its coldest
    rows = np.arange(L)
    c_other[rows, c_ref.argmax(1)] -= 1
    c_other[rows, load.argmin(1)] += 1
    assert (c_other != c_ref).any(1).all() and c_ref.max() >= 2
    lam_e = expert_tokens(load, choices)  # [L, N]
    for tiles in (0.0, 64.0, 128.0):
        reference = layer_cost(load, ref_p2l, M, choices, read, tiles)
        assert np.array_equal(reference.counts, c_ref)
        # rows: every layer at the reference's counts, then at the other counts, then mixed, then a few layers out of order
        for c, lays in ((c_ref, np.arange(L)), (c_other, np.arange(L)),
                        (np.concatenate([c_ref[:3], c_other[3:]]), np.arange(L)),
                        (c_other[[5, 0, 2]], np.array([5, 0, 2]))):
            got = slot_figures(lam_e[lays], c, reference, lays, read, tiles)
            want = per_slot(lam_e[lays], c, read, tiles)
            for g, w_ in zip(got, want):
                assert np.array_equal(g, w_), tiles
            assert np.array_equal(slot_figures(lam_e[lays], c, None, lays, read, tiles)[0], want[0])
