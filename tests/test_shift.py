"""Shift-aware rebalancing (issue 29): the pure decision (`planning.ShiftState`), the replay
that uses it (`simulate.replay_policy`), and the runtime that uses the same function."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.placement import Placement
from eplb.core.planning import ShiftState, plan_tolerance
from eplb.core.simulate import replay_policy, simulate


# ---- the decision ------------------------------------------------------------------------
def test_no_decision_before_a_prediction_and_a_noise_level():
    s = ShiftState()
    assert not s.shifted(0.1, 4)  # no plan yet
    s = s.planned(0.95)
    assert not s.shifted(0.1, 4)  # no steady gap measured yet: nothing to compare to
    s = s.checked(0.94, 4, shifted=False)
    assert s.noise == ((pytest.approx(0.01), 4),)
    assert s.shifted(0.1, 4)
    assert not s.shifted(0.1, 4, threshold=0)  # 0 = off


def test_threshold_is_above_twice_the_noise_scaled_to_the_steps():
    s = ShiftState().planned(0.9).checked(0.88, 4, False).planned(0.9)  # gap 0.02 on 4 steps
    assert s.expected_gap(4) == pytest.approx(0.02)
    assert s.expected_gap(1) == pytest.approx(0.04)  # 1 step: sqrt(4) times the noise
    # 4 steps: a shift above 0.05 + 2 * 0.02 = 0.09
    assert not s.shifted(0.9 - 0.089, 4)
    assert s.shifted(0.9 - 0.091, 4)
    # 1 step: above 0.05 + 2 * 0.04 = 0.13
    assert not s.shifted(0.9 - 0.129, 1)
    assert s.shifted(0.9 - 0.131, 1)
    assert not s.shifted(0.0, 0)  # nothing measured


def test_noise_keeps_the_smallest_of_the_last_steady_gaps_only():
    s = ShiftState().planned(1.0)
    for gap in (0.2, 0.03, 0.1, 0.08):
        s = s.checked(1.0 - gap, 4, shifted=False)
    assert [round(g, 6) for g, _ in s.noise] == [0.03, 0.1, 0.08]  # the last 3
    assert s.expected_gap(4) == pytest.approx(0.03)
    assert s.checked(0.0, 4, shifted=True) == s  # a shift's gap is not noise
    assert plan_tolerance(True, 0.03) == 0.0 and plan_tolerance(False, 0.03) == 0.03


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
        from eplb.core.simulate import step_imbalance
        per = np.concatenate([step_imbalance(trace[max(b.start, lo):min(b.end, hi)], b.placement).mean(1)
                              for b in blocks if b.end > lo and b.start < hi])
        return per.mean()

    for lo in (9, 17):  # the steps after each early rebalance, up to the next scheduled plan
        assert served(on, lo, lo + 3) < served(off, lo, lo + 3) - 0.2


def test_replay_on_a_steady_load_is_the_schedule_alone():
    rng = np.random.default_rng(3)
    shares = rng.lognormal(0, 1, (2, 16))
    trace = np.array([[rng.multinomial(20000, p / p.sum()) for p in shares] for _ in range(24)], float)
    a = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False)
    b = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.0, oracle=False)
    ra, rb = a.policies["default"].rebalances, b.policies["default"].rebalances
    assert not any(r.shifted or r.early for r in ra)
    assert [r.slots_changed for r in ra] == [r.slots_changed for r in rb]
    assert np.array_equal(a.policies["default"].layer_imbalance, b.policies["default"].layer_imbalance)


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
    p2l = rt.placement.physical_to_logical  # [L, P]
    reps = np.stack([np.bincount(row, minlength=N) for row in p2l])  # [L, N]
    per = logical[np.arange(L)[:, None], p2l] / reps[np.arange(L)[:, None], p2l]  # [L, P]
    return torch.tensor(np.rint(per), dtype=torch.int64)


def _hot(experts) -> np.ndarray:  # [L, N]
    load = np.full((L, N), 10.0)
    load[:, list(experts)] = 400.0
    return load


def _shift_body(rank, world, threshold):
    device = device_for(rank)
    rt = _runtime(dist.group.WORLD, device, threshold)
    triggers = []
    for step in range(1, 25):
        load = _hot([4, 5]) if step <= 16 else _hot([0, 6]) if step <= 19 else _hot([1, 3])
        rt.expert_load_pass.copy_(_physical(rt, load, rank).to(device))
        event = rt.step()
        if event is not None:
            triggers.append((step, event.trigger))
    rt.close()
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
    if rank == 0:
        assert TOLERANCES == want, TOLERANCES
        if threshold:  # the early plan saw the load since the shift only: steps 17, 18 of both ranks
            np.testing.assert_allclose(LOADS[2], 2 * 2 * _hot([0, 6]), rtol=0.01)


@pytest.mark.parametrize("threshold", [0.05, 0.0])
def test_runtime_rebalances_early_once_after_a_shift(threshold):
    run_distributed(_shift_body, 2, threshold)
