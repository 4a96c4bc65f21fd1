"""Shift-aware rebalancing (issue 29): the pure decision (`planning.ShiftState`), the replay
that uses it (`simulate.replay_policy`), and the runtime that uses the same function."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.placement import Placement
from eplb.core.planning import ShiftState, SteadyMemory, plan, plan_tolerance, same_traffic, sampling_gap
from eplb.core.replay import block_imbalance, check_points, replay_policy, step_imbalance
from eplb.core.simulate import simulate
from eplb.core.workload import cosine_drift


# ---- the decision ------------------------------------------------------------------------
def test_no_decision_before_a_prediction_and_a_noise_level():
    s = ShiftState()
    assert not s.shifted(0.1, 0.0)  # no plan yet
    s = s.planned(0.95)
    assert not s.shifted(0.1, 0.0)  # no steady gap measured yet: nothing to compare to
    s = s.checked(0.94, 0.004, shifted=False)
    assert s.noise == (pytest.approx(0.006),)  # the gap 0.01 less its routing noise
    assert s.shifted(0.1, 0.0)
    assert not s.shifted(0.1, 0.0, threshold=0)  # 0 = off


def test_threshold_is_above_twice_the_load_variation_plus_the_checks_routing_noise():
    s = ShiftState().planned(0.9).checked(0.88, 0.005, False).planned(0.9)  # gap 0.02, noise 0.005
    assert s.expected_gap(0.0) == pytest.approx(0.015)
    assert s.expected_gap(0.04) == pytest.approx(0.055)  # a check on few tokens
    # routing noise 0: a shift above 0.05 + 2 * 0.015 = 0.08
    assert not s.shifted(0.9 - 0.079, 0.0)
    assert s.shifted(0.9 - 0.081, 0.0)
    # routing noise 0.04: above 0.05 + 2 * 0.055 = 0.16
    assert not s.shifted(0.9 - 0.159, 0.04)
    assert s.shifted(0.9 - 0.161, 0.04)


def test_noise_keeps_the_smallest_of_the_last_steady_gaps_only():
    s = ShiftState().planned(1.0)
    for gap in (0.2, 0.03, 0.1, 0.08):
        s = s.checked(1.0 - gap, 0.01, shifted=False)
    assert [round(g, 6) for g in s.noise] == [0.02, 0.09, 0.07]  # the last 3, less their noise
    assert s.expected_gap(0.0) == pytest.approx(0.02)
    assert s.checked(0.0, 0.0, shifted=True) == s  # a shift's gap is not noise
    s = ShiftState().planned(0.9).checked(0.95, 0.01, False)  # better than predicted: no variation
    assert s.expected_gap(0.02) == pytest.approx(0.02)
    assert plan_tolerance(True, 0.03) == 0.0 and plan_tolerance(False, 0.03) == 0.03


def test_variation_and_the_drift_rule_by_hand():
    assert ShiftState().variation is None and ShiftState().planned(0.9).variation is None
    s = ShiftState().planned(1.0)
    for gap in (0.2, 0.08, 0.12):
        s = s.checked(1.0 - gap, 0.01, shifted=False)
    assert s.variation == pytest.approx(0.07)  # the smallest gap less its routing noise
    assert ShiftState().planned(0.9).checked(0.95, 0.0, False).variation == 0.0  # better than predicted
    # drifting: the variation above the move tolerance plus the window's routing noise
    assert plan_tolerance(False, 0.03, 0.07, 0.039) == 0.0
    assert plan_tolerance(False, 0.03, 0.07, 0.041) == 0.03  # the window's noise explains it
    assert plan_tolerance(False, 0.03, 0.029) == 0.03  # within the tolerance
    assert plan_tolerance(False, 0.03, None) == 0.03  # no check yet (or detection off)
    assert plan_tolerance(True, 0.03, 0.0, 0.5) == 0.0  # a shift re-plans whatever the noise


def test_sampling_gap_by_hand_and_bounds_routing_noise():
    gpu = np.array([[10.0, 30.0, 20.0, 40.0], [0.0, 0.0, 0.0, 0.0]])  # [L, M] token counts
    by_hand = (25 / 40 * np.sqrt(2 * np.log(4) / 40) + 0.0) / 2  # the empty layer counts 0
    assert sampling_gap(gpu) == pytest.approx(by_hand)
    assert sampling_gap(np.ones((3, 1))) == 0.0  # one GPU: always balanced
    # multinomial draws of a fixed load: the measured balancedness falls short of the true
    # one by more than the estimate in at most 5% of draws, at every size and token count
    rng = np.random.default_rng(3)
    for M in (8, 64, 256):
        for per_gpu in (30, 300, 3000):
            p = rng.lognormal(0, 0.3, M)
            p /= p.sum()
            true_b = p.mean() / p.max()
            draws = rng.multinomial(per_gpu * M, p, size=400).astype(float)  # [400, M]
            measured = draws.mean(1) / draws.max(1)
            est = np.array([sampling_gap(d[None]) for d in draws])
            assert np.mean(true_b - measured > est) <= 0.05, (M, per_gpu)
            assert np.median(est) < 2 * np.sqrt(2 * np.log(M) / (per_gpu * M * p.max())) * true_b


# ---- the replay --------------------------------------------------------------------------
def domains(T=24, L=2, N=16, every=8, seed=0):  # [T, L, N]: a Zipf load whose hot experts change every 8 steps
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(T // every):
        ranks = np.argsort(rng.random((L, N)), 1) + 1.0
        shares = 1.0 / ranks ** 1.2
        for _ in range(every):
            out.append([rng.multinomial(20000, p / p.sum()) for p in shares])
    return np.array(out, dtype=np.float64)


def test_replay_rebalances_early_after_a_shift_and_balances_better():
    trace = domains()
    M, P = 8, 24
    initial = Placement.initial(2, 16, P, M)
    steps = list(range(4, 24, 4))
    kw = dict(num_nodes=1, num_groups=1)
    on = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05)
    off = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.0)
    early = [b.start for b in on if b.record.early]
    assert early == [9, 17]  # one step after each domain change (steps 8 and 16)
    assert all(b.record.shifted for b in on if b.record.early)
    assert [b.start for b in off] == steps and not any(b.record.shifted for b in off)

    def served(blocks, lo, hi):  # mean max/mean GPU load over steps [lo, hi)
        per = np.concatenate([step_imbalance(trace[max(b.start, lo):min(b.end, hi)], b.placement).mean(1)
                              for b in blocks if b.end > lo and b.start < hi])
        return per.mean()

    for lo in (9, 17):  # the steps after each early rebalance, up to the next scheduled plan
        assert served(on, lo, lo + 3) < served(off, lo, lo + 3) - 0.2


def test_check_points_by_hand():
    assert check_points(1.0).tolist() == [1.0]
    assert check_points(0.25).tolist() == [0.25, 0.5, 0.75, 1.0]
    assert np.allclose(check_points(0.3), [0.3, 0.6, 0.9, 1.0])
    assert len(check_points(0.04)) == 25 and check_points(0.04)[-1] == 1.0


def test_replay_checks_within_a_step_put_the_new_placement_in_force_there():
    """A trace step that stands for many model steps is checked every `check_every` of it:
    the early rebalance lands within the step the load changed in (8, 16), not one step
    later, and that step's score is the mix of the two placements by `lead`."""
    trace = domains()
    M, P = 8, 24
    initial = Placement.initial(2, 16, P, M)
    steps = list(range(4, 24, 4))
    kw = dict(num_nodes=1, num_groups=1)
    sub = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05,
                        check_every=0.25, tokens_per_step=1e6)
    early = [b for b in sub if b.record.early]
    assert [b.start for b in early] == [8, 16]
    assert all(b.lead in (0.25, 0.5, 0.75) for b in early)
    assert all(b.lead == 0.0 for b in sub if not b.record.early)
    # the scheduled plan at 8 served only the first `lead` of step 8: an empty block
    sched = [b for b in sub if b.start == 8 and not b.record.early]
    assert len(sched) == 1 and sched[0].end == 8 and early[0].previous is sched[0].placement
    # no early rebalances at all without checks (the runtime's control_interval 0)
    none = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05,
                         check_every=None)
    assert not any(b.record.early for b in none) and [b.start for b in none] == steps
    with pytest.raises(ValueError, match="check_every must be in"):
        replay_policy(trace, initial, steps, 4, "default", kw, shift_threshold=0.05, check_every=0.0)
    # the scores mix: step 8 counts lead x the old placement's + (1 - lead) x the new one's
    b = early[0]
    old = step_imbalance(trace[8:9], b.previous)[0]  # [L]
    new = step_imbalance(trace[8:9], b.placement)[0]
    got = block_imbalance(trace, b)
    assert np.allclose(got[0], b.lead * old + (1 - b.lead) * new)
    assert np.allclose(got[1:], step_imbalance(trace[9:b.end], b.placement))
    assert old.mean() > new.mean() + 0.2  # the old layout is the wrong one after the change


def test_replay_checks_on_few_tokens_wait_for_a_larger_drop():
    """The same shift seen on few tokens per step: the routing noise of a check on a
    quarter of a step is large, so the replay needs more of the step (or the next) to decide."""
    trace = domains()
    initial = Placement.initial(2, 16, 24, 8)
    kw = dict(num_nodes=1, num_groups=1)
    steps = list(range(4, 24, 4))
    many = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05,
                         check_every=0.25, tokens_per_step=1e6)
    few = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05,
                        check_every=0.25, tokens_per_step=40.0)
    when = lambda bs: [b.start + b.lead for b in bs if b.record.early]  # noqa: E731
    assert len(when(few)) == len(when(many)) and all(f > m for f, m in zip(when(few), when(many)))


def steady_trace(tokens: int, experts: int = 16, seed: int = 3, steps: int = 24) -> np.ndarray:
    """[steps, 2, experts] counts: fixed lognormal(0, 1) shares, each step `tokens`
    multinomial draws per layer."""
    rng = np.random.default_rng(seed)
    shares = rng.lognormal(0, 1, (2, experts))
    return np.array([[rng.multinomial(tokens, p / p.sum()) for p in shares] for _ in range(steps)], float)


def test_replay_on_a_steady_load_is_the_schedule_alone():
    trace = steady_trace(20000)
    a = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False, steady_windows=0)
    b = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.0, oracle=False)
    ra, rb = a.policies["default"].rebalances, b.policies["default"].rebalances
    assert not any(r.shifted or r.early for r in ra)
    assert [r.move_tolerance for r in ra] == [0.03] * len(ra)  # steady: never drifting
    assert [r.slots_changed for r in ra] == [r.slots_changed for r in rb]
    assert np.array_equal(a.policies["default"].layer_imbalance, b.policies["default"].layer_imbalance)


def _by_hand(trace, steps, loads_of, tolerances_of=lambda k: 0.03):
    """The placements of plans at `steps` made by plan() on `loads_of(k, s)` [L, N], each
    from the one before (min gain 0: a plan that differs moves)."""
    current, out = Placement.initial(2, 16, 24, 8), []
    for k, s in enumerate(steps):
        new = plan(loads_of(k, s), 8, 24, previous=current, move_tolerance=tolerances_of(k))
        current = new
        out.append(current.physical_to_logical)
    return out


def test_replay_on_a_steady_load_plans_on_the_window_and_two_earlier_ones():
    """SteadyMemory by hand: on a steady load the k-th plan sees windows k-2..k; a policy
    without shift detection, or steady_windows 0, sees its window alone."""
    trace = steady_trace(20000)
    initial, steps = Placement.initial(2, 16, 24, 8), list(range(4, 24, 4))
    kw = dict(num_nodes=1, num_groups=1)
    got = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05,
                        steady_windows=2)
    assert not any(b.record.shifted or b.record.early for b in got)
    want = _by_hand(trace, steps, lambda k, s: trace[max(0, s - 12):s].sum(0))  # up to 3 windows
    assert [b.placement.physical_to_logical.tolist() for b in got] == [w.tolist() for w in want]
    alone = _by_hand(trace, steps, lambda k, s: trace[s - 4:s].sum(0))
    assert any(not np.array_equal(a, w) for a, w in zip(alone, want))  # the memory changed plans
    for kwargs in (dict(shift_threshold=0.0, steady_windows=2), dict(shift_threshold=0.05, steady_windows=0)):
        off = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, **kwargs)
        assert [b.placement.physical_to_logical.tolist() for b in off] == [w.tolist() for w in alone]
    # windows that overlap (window 6, a plan every 4) or are decayed are never added up
    for window, decay in ((6, 1.0), (4, 0.9)):
        w = replay_policy(trace, initial, steps, window, "default", kw, min_gain=0.0, decay=decay,
                          shift_threshold=0.05, steady_windows=2)
        a = replay_policy(trace, initial, steps, window, "default", kw, min_gain=0.0, decay=decay,
                          shift_threshold=0.05, steady_windows=0)
        assert [b.placement.physical_to_logical.tolist() for b in w] == \
            [b.placement.physical_to_logical.tolist() for b in a]


def test_replay_forgets_the_steady_windows_at_a_shift():
    """A domain change at step 12: the early rebalance and the plans after it never see a
    window from before the shift; the steady plans before it do add theirs."""
    rng = np.random.default_rng(4)
    a, b = rng.lognormal(0, 1.5, (2, 16)), rng.lognormal(0, 1.5, (2, 16))
    trace = np.array([[rng.multinomial(20000, p / p.sum()) for p in (a if t < 12 else b)]
                      for t in range(24)], float)
    initial, steps = Placement.initial(2, 16, 24, 8), list(range(4, 24, 4))
    got = replay_policy(trace, initial, steps, 4, "default", dict(num_nodes=1, num_groups=1), min_gain=0.0,
                        shift_threshold=0.05, check_every=1.0, steady_windows=2)
    early = [b for b in got if b.record.early]
    assert len(early) == 1 and early[0].start > 12, [(b.start, b.record.early) for b in got]
    spans: list[tuple[int, int]] = []  # the windows remembered, by hand
    seen = []
    for blk in got:  # the same rule by hand: what each plan should have seen
        s = blk.start
        window = (12, s) if blk.record.early else (s - 4, s)
        steady = not (blk.record.shifted or blk.record.early or blk.record.move_tolerance == 0.0)
        used = [window] + (spans if steady else [])
        spans = (spans + [window])[-2:] if steady else []
        load = sum(trace[lo:hi].sum(0) for lo, hi in used)
        seen.append((s, min(lo for lo, _ in used)))
        assert blk.record.steady_layers == (2 if len(used) > 1 else 0), (s, blk.record.to_dict())  # both layers
        assert blk.record.to_dict()["steady_layers"] == blk.record.steady_layers
        assert blk.placement == blk.previous or blk.placement == plan(
            load, 8, 24, previous=blk.previous, move_tolerance=blk.record.move_tolerance)
    # before the shift the steady plans add earlier windows; from the early plan on, only
    # steps after the shift
    assert seen[:3] == [(4, 0), (8, 0), (12, 0)], seen
    assert all(first >= 12 for s, first in seen[3:]) and seen[-1] == (20, 12), seen


def test_steady_memory_rules():
    w = np.ones((2, 4))
    m = SteadyMemory(2)
    for k in (1, 2, 3):
        _, m, used = m.plan(k * w, True)
        assert used.tolist() == [k > 1] * 2  # the first plan has nothing to add
    assert [x[0, 0] for x in m.windows] == [2, 3]  # the last two
    load, after, used = m.plan(w, True)
    np.testing.assert_array_equal(load, 6 * w)
    assert used.tolist() == [True, True]
    assert [x[0, 0] for x in after.windows] == [3, 1]
    load, after, used = m.plan(w, False)
    np.testing.assert_array_equal(load, w)
    assert after.windows == () and not used.any()  # not steady: forgotten
    assert SteadyMemory(0).plan(w, True)[1].windows == ()  # off
    # a layer without remembered tokens adds nothing, so it is not counted as using them
    z = np.stack([np.ones(4), np.zeros(4)])  # [2, 4]
    assert SteadyMemory(2, (z,)).plan(w, True)[2].tolist() == [True, False]
    assert SteadyMemory.applies(1000, 3000, 1.0) and SteadyMemory.applies(4, 4, 1.0)
    assert not SteadyMemory.applies(5, 4, 1.0) and not SteadyMemory.applies(4, 4, 0.99)
    assert not SteadyMemory.applies(4, 0, 1.0)  # no schedule: nothing to add up


def test_same_traffic_passes_draws_of_the_same_shares_and_refuses_moved_ones():
    rng = np.random.default_rng(0)
    shares = rng.lognormal(0, 1, (200, 64))
    shares /= shares.sum(1, keepdims=True)
    draw = lambda p, n: np.stack([rng.multinomial(n, row) for row in p])  # noqa: E731
    memory = draw(shares, 200_000)
    assert same_traffic(draw(shares, 50_000), memory).mean() >= 0.99  # 3 sigmas: about 1 in 200 fails
    moved = shares * rng.lognormal(0, 0.1, shares.shape)  # each expert's share off by about 10%
    assert same_traffic(draw(moved / moved.sum(1, keepdims=True), 50_000), memory).mean() <= 0.01
    # few tokens cannot tell the same 10% apart: noise of that size passes
    assert same_traffic(draw(moved / moved.sum(1, keepdims=True), 500), memory).mean() >= 0.9
    assert same_traffic(np.zeros((1, 4)), np.ones((1, 4))).all()  # no tokens: nothing to tell apart
    # a layer that moved is forgotten, the others kept
    w = np.stack([draw(shares[:1], 50_000)[0], draw(moved[1:2] / moved[1].sum(), 50_000)[0]])  # [2, 64]
    m = SteadyMemory(2, (memory[:2],))
    load, after, used = m.plan(w, True)
    np.testing.assert_array_equal(load, w + np.stack([memory[0], np.zeros(64)]))
    assert used.tolist() == [True, False]
    np.testing.assert_array_equal(after.windows[0], np.stack([memory[0], np.zeros(64)]))


def _drifting_trace(tokens: int, seed: int = 5) -> np.ndarray:  # [40, 2, 16] counts
    """A smooth cosine mix of two Zipf profiles (benchmarks/issue29.py's `drift`), each step
    `tokens` multinomial draws per layer."""
    rng = np.random.default_rng(seed)
    a, b = (1 / (np.argsort(rng.random((2, 16)), 1) + 1.0) for _ in range(2))
    shares = cosine_drift(a, b, 40)  # [T, L, N]
    return np.array([[rng.multinomial(tokens, p) for p in step] for step in shares], float)


def test_replay_plans_a_drifting_load_with_tolerance_0_unless_the_window_is_noisy():
    def records(tokens):  # the drift rule alone: plans on the trend would follow the drift (below)
        r = simulate(_drifting_trace(tokens), 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False,
                     drift_trend=False)
        return r.policies["default"].rebalances

    recs = records(20000)
    drifting = [r.step for r in recs if r.move_tolerance == 0.0 and not r.shifted]
    assert drifting and max(drifting) == recs[-1].step, [(r.step, r.move_tolerance, r.shifted) for r in recs]
    assert all(r.move_tolerance == 0.03 for r in recs[:2])  # no checked gap yet at the first plans
    # the same drift on 200 tokens a step: window noise of that size hides it, keep the tolerance
    assert all(r.move_tolerance == 0.03 for r in records(200) if not r.shifted)
    # detection off: no checks, no drift either
    r0 = simulate(_drifting_trace(20000), 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.0, oracle=False)
    assert {r.move_tolerance for r in r0.policies["default"].rebalances} == {0.03}


def test_replay_keeps_the_tolerance_on_a_steady_load_whose_window_is_noisy():
    """A steady load drawn on 2,000 tokens a step, checked as if a step stood for many model
    tokens (`tokens_per_step`, as `eplb.core.scale`): the checks' gaps are the trace's own
    noise, beyond the tolerance, but the window's routing noise covers them: no drift."""
    trace = steady_trace(2000, experts=32)
    initial, steps = Placement.initial(2, 32, 48, 16), list(range(4, 24, 4))
    kw = dict(num_nodes=1, num_groups=1)
    on = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.05,
                       check_every=0.04, tokens_per_step=1e7)
    off = replay_policy(trace, initial, steps, 4, "default", kw, min_gain=0.0, shift_threshold=0.0)
    assert [b.record.move_tolerance for b in on] == [0.03] * len(steps)
    assert [b.record.experts_moved for b in on] == [b.record.experts_moved for b in off]


# ---- the runtime -------------------------------------------------------------------------
L, N, R = 2, 8, 4  # P = 12, 6 slots per GPU on 2 ranks


TOLERANCES: list[float] = []  # move tolerances the planner was called with (rank 0 plans)
LOADS: list[np.ndarray] = []  # the loads [L, N] it planned on


def _recording_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    from eplb.core.policy.registry import get_policy

    TOLERANCES.append(options.move_tolerance)
    LOADS.append(np.array(load))
    return get_policy("default")(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)


def _runtime(group, device, threshold):
    from eplb.core.config import EplbConfig
    from eplb.core.policy.registry import available_policies, register_policy

    if "test-shift-recording" not in available_policies():
        register_policy("test-shift-recording")(_recording_policy)
    from eplb.runtime import EplbRuntime
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=L, num_experts=N, top_k=2,
                   num_redundant_experts=R)
    cfg = EplbConfig(num_redundant_experts=R, window_size=4, rebalance_interval=8, control_interval=2,
                     min_gain=0.0, shift_threshold=threshold, policy="test-shift-recording")
    return EplbRuntime(MoEModel(args, group=group, device=device), cfg, group=group)


def _physical(rt, logical: np.ndarray, rank: int) -> torch.Tensor:  # [L, N] -> [L, P] this rank's counts
    """Per-slot counts of a logical load under the placement in force, split evenly over an
    expert's replicas (each rank counts the same)."""
    return torch.tensor(_slot_counts(rt.placement, logical), dtype=torch.int64)


def _slot_counts(placement, logical: np.ndarray) -> np.ndarray:  # [L, N] -> [L, P]
    p2l = placement.physical_to_logical  # [L, P]
    reps = np.stack([np.bincount(row, minlength=N) for row in p2l])  # [L, N]
    per = logical[np.arange(L)[:, None], p2l] / reps[np.arange(L)[:, None], p2l]  # [L, P]
    return np.rint(per)


def _hot(experts) -> np.ndarray:  # [L, N]
    load = np.full((L, N), 10.0)
    load[:, list(experts)] = 400.0
    return load


def _shift_body(rank, world, threshold):
    from eplb.ops.metrics import EplbMetrics

    device = device_for(rank)
    rt = _runtime(dist.group.WORLD, device, threshold)
    metrics = EplbMetrics(rt, interval=4)
    triggers, gauges = [], []
    for step in range(1, 25):
        load = _hot([4, 5]) if step <= 16 else _hot([0, 6]) if step <= 19 else _hot([1, 3])
        rt.expert_load_pass.copy_(_physical(rt, load, rank).to(device))
        event = rt.step()
        if event is not None:
            triggers.append((step, event.trigger))
            gauges.append(tuple(metrics.value(name, **labels) for name, labels in (
                ("eplb_rebalance_layers_ratio", {"basis": "steady_windows"}),
                ("eplb_rebalance_layers_ratio", {"basis": "drift_trend"}),
                ("eplb_rebalance_move_tolerance", {}))))
    rt.close()
    # the layers planned on earlier steady windows: only the steady plan at 16 had one (the
    # window of the plan at 8, both layers: LOADS[1] below), none after the shift
    assert [e.steady_layers for e in rt.events] == ([0, 0, 0] if not threshold else [0, L, 0, 0])
    assert all(e.summary()["steady_layers"] == e.steady_layers for e in rt.events)
    if threshold:
        assert f", earlier steady windows in {L} of {L} layers" in rt.events[1].describe(), rt.events[1].describe()
    assert "earlier steady windows" not in rt.events[0].describe()
    # the metrics of the last planned rebalance, read as each one finished
    want_tol = [0.03, 0.03, 0.0, 0.0] if threshold else [0.03, 0.03, 0.03]
    want_steady = [0.0, 1.0, 0.0, 0.0] if threshold else [0.0, 0.0, 0.0]
    assert gauges == [(s, 0.0, t) for s, t in zip(want_steady, want_tol)], gauges
    if threshold:
        # steady until 16 (plans at 8 and 16), the shift at 17 seen at the check of step 18,
        # one early rebalance only: the next shift (20) waits for the schedule (24)
        assert triggers == [(8, "interval"), (16, "interval"), (18, "shift"), (24, "interval")], triggers
        assert rt.events[2].balancedness_after.min() > 0.9
        # planned with move tolerance 0 after a shift: the early plan, and the one at 24
        # (the load changed again at 20), the steady ones with the config's 0.03
        want = [0.03, 0.03, 0.0, 0.0]
    else:
        assert triggers == [(8, "interval"), (16, "interval"), (24, "interval")], triggers
        want = [0.03, 0.03, 0.03]
    assert [e.move_tolerance for e in rt.events] == want  # what the events report, every rank
    if rank == 0:
        assert TOLERANCES == want, TOLERANCES
        if threshold:  # the early plan saw the load since the shift only: steps 17, 18 of both ranks
            np.testing.assert_allclose(LOADS[2], 2 * 2 * _hot([0, 6]), rtol=0.01)
            # the steady plan at 16 saw its window (13-16) and the one of the plan at 8 (5-8)
            # (EplbConfig.steady_windows); the one at 24, after the shift, its window alone
            np.testing.assert_allclose(LOADS[1], 2 * 2 * 4 * _hot([4, 5]), rtol=0.01)
            np.testing.assert_allclose(LOADS[3], 2 * 4 * _hot([1, 3]), rtol=0.01)
        else:  # no shift detection: no telling a steady load, each plan sees its window alone
            np.testing.assert_allclose(LOADS[1], 2 * 4 * _hot([4, 5]), rtol=0.01)
    if threshold:
        # the steady check at 16 joined the noise history: the gap of steps 13-16 (the
        # window's 4 steps since the plan at 8; both ranks' counts under its placement) less
        # its routing noise, by hand
        placed = rt.events[0].placement
        gpu = 2 * 4 * _slot_counts(placed, _hot([4, 5])).reshape(L, 2, -1).sum(-1)  # [L, M]
        b = gpu.mean(1) / gpu.max(1)  # [L]
        routing = np.mean(b * np.sqrt(2 * np.log(2) / gpu.max(1)))
        predicted = rt.events[0].balancedness_after.mean()
        assert rt.targets.shift.noise == (pytest.approx(predicted - b.mean() - routing),), \
            (rt.targets.shift.noise, predicted, b.mean(), routing, [e.trigger for e in rt.events])
        assert routing > 0.005  # visible next to the gap


@pytest.mark.parametrize("threshold", [0.05, 0.0])
def test_runtime_rebalances_early_once_after_a_shift(threshold):
    run_distributed(_shift_body, 2, threshold)


def _drift_body(rank, world, threshold):
    """After the first plan, the load drifts from experts 4, 5 towards two experts that plan
    left alone on GPU 0: the plan at 16 is checked on steps 13-16 and re-plans with move
    tolerance 0, not as a shift but as a drift; with detection off (threshold 0), not."""
    device = device_for(rank)
    rt = _runtime(dist.group.WORLD, device, threshold)
    target, loads, noise = None, {}, None
    for step in range(1, 17):
        if target is None and rt.events:  # the same on every rank: the broadcast placement
            p2l = rt.placement.physical_to_logical[0]  # [P]
            reps = np.bincount(p2l, minlength=N)
            only0 = set(p2l[:len(p2l) // 2].tolist()) - set(p2l[len(p2l) // 2:].tolist())
            target, start = sorted(e for e in only0 if reps[e] == 1)[:2], step
        x = 0.0 if target is None else (step - start) / 32
        load = np.full((L, N), 10.0)
        load[:, [4, 5]] += 400 * (1 - x)
        if target is not None:
            load[:, target] += 400 * x
        loads[step] = load
        rt.expert_load_pass.copy_(_physical(rt, load, rank).to(device))
        event = rt.step()
        if step == 16:
            noise = rt.targets.shift.noise
            assert event is not None and event.trigger == "interval"
    rt.close()
    # by hand: the counts of steps 13-16 (both ranks) under the plan of step 8
    placed = rt.events[0].placement
    counts = sum(_slot_counts(placed, loads[s]) for s in range(13, 17))  # [L, P]
    gpu = 2 * counts.reshape(L, 2, -1).sum(-1)  # [L, M]
    b = gpu.mean(1) / gpu.max(1)  # [L]
    routing = np.mean(b * np.sqrt(2 * np.log(2) / gpu.max(1)))  # the check's, and the window's
    variation = rt.events[0].balancedness_after.mean() - b.mean() - routing
    assert noise == (pytest.approx(variation),)
    assert variation > 0.03 + routing + 0.02  # drifting, with room
    want = [0.03, 0.0] if threshold else [0.03, 0.03]
    if rank == 0:
        assert TOLERANCES == want, TOLERANCES
    assert [e.move_tolerance for e in rt.events] == want  # what the events report, every rank
    assert rt.events[1].describe().endswith(f", move tolerance {want[1]:g}")
    assert rt.events[1].summary()["move_tolerance"] == want[1]


@pytest.mark.parametrize("threshold", [0.05, 0.0])
def test_runtime_plans_a_drifting_load_with_tolerance_0(threshold):
    run_distributed(_drift_body, 2, threshold)
