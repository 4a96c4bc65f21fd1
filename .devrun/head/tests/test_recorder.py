"""LoadRecorder: physical -> logical folding, per-GPU sums, the ring window, and the
one all-reduce of window_load()."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import device_for, run_distributed
from eplb.runtime.recorder import LoadRecorder

CPU = torch.device("cpu")
# L=2 layers, N=4 logical experts, M=2 GPUs, S=3 slots per GPU -> P=6 slots
L, N, M, S = 2, 4, 2, 3
P = M * S
# layer 0: expert 0 has three replicas (slots 0, 4, 5); layer 1: experts 1 and 3 have two
P2L = torch.tensor([[0, 1, 2, 3, 0, 0],
                    [3, 2, 1, 0, 1, 3]], dtype=torch.int64)  # [L, P]


def logical_of(load_pass: torch.Tensor, p2l: torch.Tensor, n: int = N) -> torch.Tensor:  # [L, N]
    """Reference fold with plain loops."""
    out = torch.zeros(p2l.shape[0], n, dtype=torch.int64)
    for layer in range(p2l.shape[0]):
        for slot in range(p2l.shape[1]):
            out[layer, p2l[layer, slot]] += load_pass[layer, slot]
    return out


def gpu_of(load_pass: torch.Tensor, m: int = M, s: int = S) -> torch.Tensor:  # [L, M]
    return torch.stack([load_pass[:, g * s:(g + 1) * s].sum(1) for g in range(m)], dim=1)


def step_load(step: int) -> torch.Tensor:  # [L, P], distinct per step
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 50, (L, P), generator=g, dtype=torch.int64)


def test_record_folds_replicas_into_logical_and_sums_per_gpu():
    rec = LoadRecorder(L, N, M, S, window_size=4, device=CPU)
    load = torch.tensor([[1, 2, 3, 4, 10, 100],
                         [5, 6, 7, 8, 20, 200]], dtype=torch.int64)  # [L, P]
    rec.record(load.clone(), P2L)
    # layer 0: expert 0 = slots 0 + 4 + 5 = 1 + 10 + 100; layer 1: expert 3 = slots 0 + 5
    want_logical = torch.tensor([[111, 2, 3, 4],
                                 [8, 7 + 20, 6, 5 + 200]], dtype=torch.int64)
    assert torch.equal(rec.logical_ring[0], want_logical)
    assert torch.equal(rec.logical_ring[0], logical_of(load, P2L))
    want_gpu = torch.tensor([[6, 114], [18, 228]], dtype=torch.int64)  # slots 0-2 | 3-5
    assert torch.equal(rec.gpu_ring[0], want_gpu)
    assert torch.equal(rec.last_gpu_load(), want_gpu)
    # counts are conserved by both views
    assert int(rec.logical_ring[0].sum()) == int(load.sum()) == int(rec.gpu_ring[0].sum())
    assert rec.fill == 1 and rec.steps_recorded == 1


def test_record_zeroes_the_pass_in_place():
    rec = LoadRecorder(L, N, M, S, window_size=2, device=CPU)
    load_pass = step_load(0)
    want = logical_of(load_pass, P2L)
    ptr = load_pass.data_ptr()
    rec.record(load_pass, P2L)
    assert load_pass.data_ptr() == ptr
    assert int(load_pass.abs().sum()) == 0
    # the ring holds a copy: reusing the pass does not change what was recorded
    load_pass += 7
    assert torch.equal(rec.logical_ring[0], want)


def test_ring_wraps_and_keeps_only_the_last_window():
    W = 3
    rec = LoadRecorder(L, N, M, S, window_size=W, device=CPU)
    loads = [step_load(t) for t in range(7)]
    fills = []
    for t, load in enumerate(loads):
        rec.record(load.clone(), P2L)
        fills.append(rec.fill)
        assert torch.equal(rec.last_gpu_load(), gpu_of(load)), t
    assert fills == [1, 2, 3, 3, 3, 3, 3]
    assert rec.steps_recorded == 7
    logical, gpu = rec.window_load()
    want_logical = sum(logical_of(x, P2L) for x in loads[-W:])
    want_gpu = sum(gpu_of(x) for x in loads[-W:])
    assert torch.equal(logical, want_logical)
    assert torch.equal(gpu, want_gpu)
    # the steps that fell out of the window really are gone
    assert not torch.equal(logical, sum(logical_of(x, P2L) for x in loads[-W - 1:]))


def test_window_load_before_the_window_fills():
    rec = LoadRecorder(L, N, M, S, window_size=5, device=CPU)
    logical, gpu = rec.window_load()
    assert logical.shape == (L, N) and gpu.shape == (L, M)
    assert int(logical.sum()) == 0 and int(gpu.sum()) == 0
    loads = [step_load(t) for t in range(2)]
    for x in loads:
        rec.record(x.clone(), P2L)
    logical, gpu = rec.window_load()
    assert rec.fill == 2
    assert torch.equal(logical, logical_of(loads[0], P2L) + logical_of(loads[1], P2L))
    assert torch.equal(gpu, gpu_of(loads[0]) + gpu_of(loads[1]))


def test_warm_up_records_nothing():
    """warm_up() runs window_load's kernels (the per-GPU part too) and changes no state."""
    rec = LoadRecorder(L, N, M, S, window_size=4, device=CPU)
    for decay in (1.0, 0.5):
        rec.warm_up(decay=decay)
        assert (rec.steps_recorded, rec.gpu_steps) == (0, 0)
        logical, gpu = rec.window_load(decay=decay)
        assert int(logical.sum()) == 0 and int(gpu.sum()) == 0
    x = step_load(0)
    rec.record(x.clone(), P2L)
    rec.warm_up()
    assert (rec.steps_recorded, rec.gpu_steps) == (1, 1)
    assert torch.equal(rec.window_load()[1], gpu_of(x))


def test_per_gpu_window_only_covers_steps_since_placement_change():
    W = 8
    rec = LoadRecorder(L, N, M, S, window_size=W, device=CPU)
    old = [step_load(t) for t in range(3)]
    for x in old:
        rec.record(x.clone(), P2L)
    rec.on_placement_change()
    logical, gpu = rec.window_load()
    assert int(gpu.sum()) == 0  # nothing measured on the new placement yet
    assert torch.equal(logical, sum(logical_of(x, P2L) for x in old))  # logical history kept

    new_p2l = P2L.flip(1).contiguous()  # another placement of the same experts
    new = [step_load(10 + t) for t in range(2)]
    for x in new:
        rec.record(x.clone(), new_p2l)
    logical, gpu = rec.window_load()
    assert torch.equal(gpu, gpu_of(new[0]) + gpu_of(new[1]))
    # logical counts fold each step with the placement it was counted under
    assert torch.equal(logical, sum(logical_of(x, P2L) for x in old)
                       + sum(logical_of(x, new_p2l) for x in new))

    # more steps than the window since the change: per-GPU part is the last W steps
    more = [step_load(20 + t) for t in range(W + 2)]
    for x in more:
        rec.record(x.clone(), new_p2l)
    logical, gpu = rec.window_load()
    assert torch.equal(gpu, sum(gpu_of(x) for x in more[-W:]))
    assert torch.equal(logical, sum(logical_of(x, new_p2l) for x in more[-W:]))


def _window_load_all_reduces(rank: int, world: int) -> None:
    device = device_for(rank)
    rec = LoadRecorder(L, N, M, S, window_size=4, device=device)
    p2l = P2L.to(device)
    loads = [step_load(t) * (rank + 1) for t in range(3)]  # rank-specific counts
    for x in loads:
        rec.record(x.clone().to(device), p2l)
    mine_logical = sum(logical_of(x, P2L) for x in loads)
    mine_gpu = sum(gpu_of(x) for x in loads)
    logical, gpu = rec.window_load()
    # every rank's counts are (rank + 1) x the same base: the sum over ranks is 1 + 2 + ... + world
    factor = world * (world + 1) // 2
    assert torch.equal(logical.cpu(), mine_logical // (rank + 1) * factor)
    assert torch.equal(gpu.cpu(), mine_gpu // (rank + 1) * factor)
    # the local ring itself is not modified by the reduction
    assert torch.equal(rec.logical_ring.sum(0).cpu(), mine_logical)
    assert np.array_equal(rec.last_gpu_load().cpu().numpy(), gpu_of(loads[-1]).numpy())


def test_window_load_sums_over_ranks():
    run_distributed(_window_load_all_reduces, 2)


# ---- decay: a step k steps older than the newest weighs decay**k -------------------------

def test_decay_weights_by_age_newest_first():
    W = 4
    rec = LoadRecorder(L, N, M, S, window_size=W, device=CPU)
    loads = [step_load(t) for t in range(6)]  # the ring wraps: holds steps 2..5
    for x in loads:
        rec.record(x.clone(), P2L)
    d = 0.5
    logical, gpu = rec.window_load(decay=d)
    assert logical.dtype == torch.float64
    want = sum(d ** age * logical_of(x, P2L).double() for age, x in enumerate(reversed(loads[-W:])))
    assert torch.allclose(logical, want, rtol=0, atol=1e-9)
    # the per-GPU part stays a plain (integer) sum of what was measured
    assert gpu.dtype == torch.int64
    assert torch.equal(gpu, sum(gpu_of(x) for x in loads[-W:]))


def test_decay_one_is_the_plain_sum_and_stays_int64():
    rec = LoadRecorder(L, N, M, S, window_size=3, device=CPU)
    loads = [step_load(t) for t in range(5)]
    for x in loads:
        rec.record(x.clone(), P2L)
    plain, _ = rec.window_load()
    same, _ = rec.window_load(decay=1.0)
    assert same.dtype == torch.int64 and torch.equal(plain, same)
    assert torch.equal(plain, sum(logical_of(x, P2L) for x in loads[-3:]))


def test_decay_before_the_window_fills_and_hand_example():
    rec = LoadRecorder(1, 2, 1, 2, window_size=5, device=CPU)
    p2l = torch.tensor([[0, 1]])
    for counts in ([8, 0], [0, 4], [2, 2]):  # oldest first
        rec.record(torch.tensor([counts]), p2l)
    logical, _ = rec.window_load(decay=0.5)
    # newest [2, 2] x 1 + [0, 4] x 0.5 + [8, 0] x 0.25; empty ring entries add nothing
    assert logical.tolist() == [[2 + 0 + 2.0, 2 + 2 + 0.0]]


def test_decay_matches_the_simulator_window():
    from eplb.core.simulate import window_load as sim_window

    W = 3
    rec = LoadRecorder(L, N, M, S, window_size=W, device=CPU)
    loads = [step_load(t) for t in range(7)]
    for x in loads:
        rec.record(x.clone(), P2L)
    trace = np.stack([logical_of(x, P2L).numpy() for x in loads]).astype(np.float64)  # [T, L, N]
    got, _ = rec.window_load(decay=0.7)
    assert np.allclose(got.numpy(), sim_window(trace, len(loads), W, 0.7), rtol=1e-12)


def test_decay_out_of_range_is_rejected():
    rec = LoadRecorder(L, N, M, S, window_size=2, device=CPU)
    for bad in (0, -0.5, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="decay"):
            rec.window_load(decay=bad)


def _decayed_window_all_reduces(rank: int, world: int) -> None:
    device = device_for(rank)
    rec = LoadRecorder(L, N, M, S, window_size=4, device=device)
    p2l = P2L.to(device)
    loads = [step_load(t) * (rank + 1) for t in range(5)]
    for x in loads:
        rec.record(x.clone().to(device), p2l)
    d = 0.25
    mine = sum(d ** age * logical_of(x, P2L).double() for age, x in enumerate(reversed(loads[-4:])))
    logical, gpu = rec.window_load(decay=d)
    factor = world * (world + 1) // 2
    assert logical.dtype == torch.float64 and gpu.dtype == torch.int64
    assert torch.allclose(logical.cpu(), mine / (rank + 1) * factor, rtol=1e-12)
    assert torch.equal(gpu.cpu(), sum(gpu_of(x) for x in loads[-4:]) // (rank + 1) * factor)


def test_decayed_window_sums_over_ranks():
    run_distributed(_decayed_window_all_reduces, 2)


def test_runtime_rebalance_passes_decay_and_planner_knobs():
    """rebalance() plans on the decay-weighted window with the config's move_tolerance and
    weighted_replicas (seen by a registered policy, the public way in)."""
    from eplb import EplbRuntime, register_policy
    from eplb.core.policy.registry import get_policy
    from eplb.core.config import EplbConfig
    from moe import MoEArgs, MoEModel, sample_tokens

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8, top_k=2,
                   num_redundant_experts=4, seed=1)
    model = MoEModel(args)
    cfg = EplbConfig(num_redundant_experts=4, window_size=3, rebalance_interval=0, load_decay=0.5,
                     move_tolerance=0.3, weighted_replicas=False, policy="test-recorder-spy")
    seen = {}

    @register_policy("test-recorder-spy")
    def spy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options):
        seen["load"], seen["options"] = np.array(load), options
        return get_policy("default")(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)

    runtime = EplbRuntime(model, cfg)
    for step in range(4):
        model(sample_tokens(args, 16, seed=step))
        runtime.step()
    want, _ = runtime.recorder.window_load(decay=0.5)
    runtime.rebalance()
    assert np.allclose(seen["load"], want.numpy())
    assert not np.allclose(seen["load"], runtime.recorder.window_load()[0].numpy())
    assert seen["options"].move_tolerance == 0.3 and seen["options"].weighted is False


def test_window_since_plan_covers_only_the_steps_after_the_last_plan():
    """What shift detection measures and an early rebalance plans on (issue 29): the
    counts of the steps since `on_plan()` (and since the last placement change), at most
    the window, logical counts as a plain sum."""
    rec = LoadRecorder(L, N, M, S, window_size=4, device=CPU)
    loads = [step_load(k) for k in range(6)]
    for k in range(3):
        rec.record(loads[k].clone(), P2L)
    rec.on_plan()
    for k in range(3, 5):
        rec.record(loads[k].clone(), P2L)
    assert rec.steps_since_plan == 2
    logical, gpu = rec.window_load(since_plan=True)
    want = sum(logical_of(loads[k], P2L) for k in (3, 4))
    assert torch.equal(logical, want)
    assert torch.equal(gpu, sum(gpu_of(loads[k]) for k in (3, 4)))
    full, _ = rec.window_load()  # the plain window: steps 1..4
    assert torch.equal(full, sum(logical_of(loads[k], P2L) for k in range(1, 5)))
    for k in range(5, 9):  # more steps than the window since the change: the window
        rec.record(step_load(k), P2L)
    logical, _ = rec.window_load(since_plan=True)
    assert torch.equal(logical, sum(logical_of(step_load(k), P2L) for k in range(5, 9)))
    rec.on_placement_change()  # a change drops the per-GPU history: nothing measured yet
    assert rec.steps_since_plan == 0
