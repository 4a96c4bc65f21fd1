"""The `balanced` planner, round 3 (issue 17): never worse than `deepseek` when one or
several experts are hotter than a GPU's share, the refill of a GPU dominated by one hot
expert, moves through the change of replica counts (`transition`), the moves towards a
target that fix the most loaded GPU first (`improve_max(fix=True)`), the tolerance capped
by DeepSeek's own plan, and a small smooth-drift replay."""
from __future__ import annotations

import numpy as np

from eplb.core.planning import plan
from eplb.core.policy.balanced.moves import transition
from eplb.core.policy.balanced.refinement import improve_max
from eplb.core.policy.balanced.packing import refill_hot
from eplb.core.policy.balanced.rows import counts_of, has_duplicates, max_load
from eplb.core.policy.balanced.solve import solve


def hot_load(N, L, M, k, f, sigma, seed):
    """[L, N]: k experts each about f x the mean GPU load on M GPUs, the rest lognormal."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0, sigma, (L, N))
    idx = np.argsort(rng.random((L, N)), 1)[:, :k]
    rest = w.copy()
    np.put_along_axis(rest, idx, 0, 1)
    fs = f * rng.uniform(0.9, 1.1, (L, k))
    hot = fs * rest.sum(1, keepdims=True) / M / (1 - fs.sum(1, keepdims=True) / M)
    np.put_along_axis(w, idx, hot, 1)
    return np.round(w / w.sum(1, keepdims=True) * 1e6)


def imb(p, load):  # [L]
    return 1.0 / p.balancedness(load)


def test_never_worse_than_deepseek_with_hot_experts():
    # two experts each twice a GPU's share on 8 GPUs with one spare slot per GPU: before
    # round 3 the planner was worse than deepseek here (1.1353 against 1.1328)
    load = hot_load(256, 4, 8, 2, 2.0, 0.3, 3)
    cases = [(load, 8, 264)]
    for M in (16, 32):  # P = N and one spare slot per GPU, one and three hot experts
        for k, f in ((1, 1.4), (3, 1.5)):
            w = hot_load(128, 2, M, k, f, 0.5, 7)
            cases += [(w, M, 128), (w, M, 128 + M)]
    for w, M, P in cases:
        d = plan(w, M, P, policy="deepseek")
        b = plan(w, M, P)
        assert b.num_duplicates_on_gpu() == 0
        assert imb(b, w).mean() <= imb(d, w).mean() + 1e-12, (M, P)


def test_refill_gives_the_coldest_experts_to_the_gpu_of_one_hot_expert():
    # 4 GPUs of 3 slots; expert 0 alone is above the mean GPU load; its GPU holds two
    # mid-weight experts, the coldest ones sit elsewhere
    w = np.array([[60.0, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0.5]])  # [1, 12]
    p2l = np.array([[0, 1, 2, 3, 4, 11, 5, 6, 10, 7, 8, 9]])  # [1, 12]
    out = refill_hot(w, p2l, 4)
    assert sorted(out[0, :3].tolist()) == [0, 10, 11]  # the hot expert and the two coldest
    assert max_load(w, out, 4)[0] < max_load(w, p2l, 4)[0]
    assert sorted(out[0].tolist()) == sorted(p2l[0].tolist())


def test_transition_copies_only_the_changed_counts():
    rng = np.random.default_rng(0)
    w = rng.lognormal(0, 1, (6, 64))
    old = solve(w, 80, 16)  # [6, 80]
    w2 = w * rng.uniform(0.5, 1.5, w.shape)
    c_new = counts_of(solve(w2, 80, 16), 64)  # [6, 64]
    out = transition(w2, old, c_new, 16)
    assert (counts_of(out, 64) == c_new).all()
    assert not has_duplicates(out, 16).any()
    changes = np.maximum(c_new - counts_of(old, 64), 0).sum(1)  # [6] replicas to add
    moved = (out != old).sum(1)
    # one copy per changed count, two more where a duplicate had to be swapped away
    assert (moved >= changes).all() and (moved <= changes + 2).all()
    assert (moved == changes).sum() >= 4
    # the new replicas go to the least loaded GPUs: better than the old placement
    assert (max_load(w2, out, 16) < max_load(w2, old, 16)).all()


def test_fix_first_reaches_the_target_with_fewer_copies():
    """Moving previous placements of drifted loads to (1 + 0.03) x the from-scratch max:
    with `fix` (a move that brings the most loaded GPU within the target and puts no other
    GPU above it first) every row that reached the target still does, and the changed
    slots (the copies) are fewer over the batch and never more in a row by more than the
    two of one swap."""
    totals = {False: 0, True: 0}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        L, N, M, P = 40, 64, 16, 80
        load = np.round(1e4 / (np.argsort(rng.random((L, N)), 1) + 1.0) ** 0.9 * rng.uniform(0.5, 1.5, (L, N)))
        prev = np.asarray(plan(load, M, P).physical_to_logical)
        drift = load * rng.uniform(0.7, 1.3, load.shape)
        target = 1.03 * max_load(drift, solve(drift, P, M), M)
        rows = np.nonzero(max_load(drift, prev, M) > target)[0]
        assert rows.size >= 30
        out = {}
        for fix in (False, True):
            q, _ = improve_max(drift[rows], prev[rows], M, M, budget=80, target=target[rows], fix=fix)
            assert not has_duplicates(q, M).any()
            assert (counts_of(q, N) >= 1).all()
            out[fix] = (max_load(drift[rows], q, M) <= target[rows], (q != prev[rows]).sum(1))
            totals[fix] += int(out[fix][1].sum())
        assert (out[True][0] >= out[False][0]).all()
        assert (out[True][1] <= out[False][1] + 2).all()
    assert totals[True] < totals[False]


def test_tolerance_never_keeps_a_layer_worse_than_deepseek():
    # a generous tolerance would keep the previous placement; on small problems the
    # target is capped by DeepSeek's own plan of the same load
    rng = np.random.default_rng(3)
    a = rng.lognormal(0, 1, (4, 64))
    b = a * rng.lognormal(0, 0.4, a.shape)
    prev = plan(a, 16, 80)
    q = plan(b, 16, 80, previous=prev, move_tolerance=0.5)
    d = plan(b, 16, 80, policy="deepseek")
    assert (imb(q, b) <= imb(d, b) + 1e-9).all()
    assert (q.physical_to_logical != prev.physical_to_logical).mean() < 0.5


def test_smooth_drift_moves_a_third_of_deepseek_and_balances_as_well():
    """Two lognormal profiles blended along half a cosine over 120 steps of 60k choices
    per layer; plan every 20 steps on the last 20, score every step."""
    L, N, M, P, steps, width = 6, 64, 16, 80, 120, 20
    rng = np.random.default_rng(21)
    pa, pb = rng.lognormal(0, 1, (2, L, N))
    pa, pb = pa / pa.sum(1, keepdims=True), pb / pb.sum(1, keepdims=True)
    T = np.empty((steps, L, N))
    for t in range(steps):
        x = (1 - np.cos(np.pi * t / steps)) / 2
        mix = (1 - x) * pa + x * pb
        for layer in range(L):
            T[t, layer] = rng.multinomial(60_000, mix[layer] / mix[layer].sum())
    res = {}
    for policy in ("deepseek", "default"):
        prev, moved, per_step = None, 0, []
        for t in range(width, steps, width):
            p = plan(T[t - width:t].sum(0), M, P, policy=policy, previous=None if policy == "deepseek" else prev)
            if prev is not None:
                moved += int((p.physical_to_logical != prev.physical_to_logical).sum())
            per_step += [imb(p, T[u]).mean() for u in range(t, min(t + width, steps))]
            prev = p
        res[policy] = moved, float(np.mean(per_step))
    assert res["default"][0] <= res["deepseek"][0] / 3, res
    assert res["default"][1] <= res["deepseek"][1], res
