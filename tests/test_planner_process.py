"""The planner process: the same placements as `plan()` in-process, errors carried back,
a dead child replaced, no child left behind; the runtime plans in it in asynchronous mode
(rank 0) unless the policy was registered at run time."""
import sys
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.runtime.planner_process import MALLOC_SETTINGS, PlannerProcess, PlannerProcessError
from eplb.core.planning import plan
from eplb.core.policy.registry import register_policy
from eplb.runtime import EplbRuntime


@pytest.fixture(scope="module")
def planner():
    p = PlannerProcess()
    yield p
    p.close()


CASES = [  # (L, N, M, P, nodes, groups, policy, weighted, with previous)
    (4, 64, 2, 72, 1, 1, "default", False, True),
    (3, 32, 4, 40, 2, 4, "default", False, False),
    (2, 16, 4, 24, 1, 1, "default", True, True),
    (3, 32, 4, 40, 2, 4, "deepseek", False, False),
]


@pytest.mark.parametrize("L,N,M,P,nodes,groups,policy,weighted,with_previous", CASES)
def test_same_placement_as_in_process(planner, L, N, M, P, nodes, groups, policy, weighted,
                                      with_previous):
    rng = np.random.default_rng(L * N + P)
    load = rng.zipf(1.4, size=(L, N)).astype(np.float64)  # [L, N]
    previous = Placement.initial(L, N, P, M, nodes) if with_previous else None
    kw = dict(previous=previous, move_tolerance=0.03, weighted=weighted)
    want = plan(load, M, P, nodes, groups, policy, **kw)
    got = planner.plan(load, M, P, nodes, groups, policy, **kw)
    assert isinstance(got, Placement)
    assert np.array_equal(got.physical_to_logical, want.physical_to_logical)
    assert (got.shares is None) == (want.shares is None)
    if want.shares is not None:
        assert np.array_equal(got.shares, want.shares)
    assert (got.num_logical_experts, got.num_gpus, got.num_nodes, got.policy) == (
        want.num_logical_experts, want.num_gpus, want.num_nodes, want.policy)


@pytest.mark.parametrize("dispatch, tiles", [(40.0, 128.0), (float("inf"), 128.0), (40.0, 0.0)])
def test_decode_aware_settings_reach_the_child(planner, dispatch, tiles):
    """`read_tokens`, `step_choices`, `dispatch_tokens` and `tile_rows` travel to the child:
    its plan is `plan()`'s with them, which differs from the plan without them here (cold
    experts)."""
    rng = np.random.default_rng(3)
    load = rng.lognormal(0.0, 2.5, size=(4, 64))  # [L, N] many cold experts
    kw = dict(read_tokens=100.0, step_choices=8 * 16 * 4.0, dispatch_tokens=dispatch, tile_rows=tiles)
    want = plan(load, 8, 72, **kw)
    got = planner.plan(load, 8, 72, **kw)
    assert np.array_equal(got.physical_to_logical, want.physical_to_logical)
    assert not np.array_equal(want.physical_to_logical, plan(load, 8, 72).physical_to_logical)


def test_bad_input_raises_the_same_value_error(planner):
    with pytest.raises(ValueError, match="multiple of num_gpus") as got:
        planner.plan(np.ones((2, 8)), 4, 9)
    with pytest.raises(ValueError) as want:
        plan(np.ones((2, 8)), 4, 9)
    assert str(got.value) == str(want.value)
    assert planner.alive  # a bad request does not end the child


def test_knows_the_built_in_policies_only(planner):
    assert {"default", "deepseek", "balanced"} <= set(planner.policies())
    assert not planner.can_plan("registered-at-run-time-only")


def test_a_child_that_dies_mid_request_fails_the_call_and_is_replaced():
    p = PlannerProcess()
    try:
        # the child's first request waits for its imports (about a second): kill it then
        killer = threading.Timer(0.2, p._proc.kill)
        killer.start()
        with pytest.raises(PlannerProcessError, match="exited"):
            p.plan(np.ones((2, 8)), 2, 8)
        killer.join()
        assert not p.alive
        got = p.plan(np.ones((2, 8)), 2, 8)  # a new child
        assert np.array_equal(got.physical_to_logical, plan(np.ones((2, 8)), 2, 8).physical_to_logical)
    finally:
        p.close()


def test_close_ends_the_child():
    p = PlannerProcess()
    proc = p._proc
    p.plan(np.ones((1, 4)), 2, 4)
    p.close()
    assert proc.poll() is not None and not p.alive
    p.close()  # idempotent


def _child_environ(p: PlannerProcess) -> dict:
    p.policies()  # the child has answered: it runs python (read earlier, its environ can be empty)
    with open(f"/proc/{p._proc.pid}/environ", "rb") as f:  # Linux: the child's environment at exec
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in pairs}


def test_child_keeps_its_freed_heap_unless_the_user_says_otherwise(monkeypatch):
    """The child starts with glibc's trim and mmap thresholds raised (plans without page
    faults on their temporaries); a value the user set in the environment wins."""
    for name in MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    p = PlannerProcess()
    try:
        env = _child_environ(p)
        assert env["MALLOC_TRIM_THRESHOLD_"] == str(256 * 1024 * 1024)
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(64 * 1024 * 1024)
        assert p.plan(np.ones((1, 4)), 2, 4).num_slots == 4  # and it plans
    finally:
        p.close()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    p = PlannerProcess()
    try:
        env = _child_environ(p)
        assert env["MALLOC_TRIM_THRESHOLD_"] == "131072"
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(64 * 1024 * 1024)
    finally:
        p.close()
    p = PlannerProcess(malloc_settings={})  # glibc's defaults: only what the environment sets
    try:
        env = _child_environ(p)
        assert env["MALLOC_TRIM_THRESHOLD_"] == "131072"
        assert "MALLOC_MMAP_THRESHOLD_" not in env
    finally:
        p.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe sizes are a Linux call")
def test_pipes_hold_a_whole_request_and_larger_ones_still_pass():
    """Both pipes to the child are grown to 1 MiB, read back from the OS (so a DeepSeek-V3
    request, about 250 KiB, is written without waiting for the child to drain it), and a
    request larger than the pipe still goes through whole."""
    import fcntl
    with open("/proc/sys/fs/pipe-max-size") as f:
        limit = int(f.read())
    p = PlannerProcess()
    try:
        sizes = [fcntl.fcntl(pipe.fileno(), fcntl.F_GETPIPE_SZ) for pipe in (p._proc.stdin, p._proc.stdout)]
        if limit >= 1 << 20:  # below it, a root parent still gets 1 MiB and others keep 64 KiB
            assert sizes == [1 << 20] * 2, (sizes, limit)
        load = np.random.default_rng(0).random((600, 256)) * 100  # [L, N] float64: 1.2 MB pickled
        assert np.array_equal(p.plan(load, 8, 264).physical_to_logical, plan(load, 8, 264).physical_to_logical)
    finally:
        p.close()


def test_child_exits_when_its_parent_closes_the_pipe():
    """The child serves until stdin closes, so it never outlives its parent process."""
    p = PlannerProcess()
    proc = p._proc
    proc.stdin.close()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() == 0
    p.close()


def _runtime_body(rank, world):
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8, top_k=2,
                   num_redundant_experts=world, seed=0).validate(world)
    model = MoEModel(args, group=dist.group.WORLD, device=device_for(rank))
    cfg = EplbConfig(num_redundant_experts=world, rebalance_interval=0, async_rebalance=True)
    runtime = EplbRuntime(model, cfg)
    if rank == 0:
        assert runtime.planner.process is not None and runtime.planner.process.alive
        proc = runtime.planner.process._proc
    else:
        assert runtime.planner.process is None  # only rank 0 plans
    if rank == 0:  # experts 2 and 3 (rank 0's slots 2, 3; no replica elsewhere) hot
        runtime.expert_load_pass[:, 2:4] = 100
    runtime.step()
    assert runtime.rebalance() is None  # asynchronous: planned in the child on rank 0
    event = runtime.finish_rebalance()
    assert event is not None and event.slots_changed > 0
    # every rank got rank 0's plan, which the in-process planner reproduces
    load = np.zeros((2, 8))
    load[:, 2:4] = 100
    want = plan(load, world, args.num_physical_experts, 1, 1, "default",
                previous=Placement.initial(2, 8, args.num_physical_experts, world),
                move_tolerance=cfg.move_tolerance)
    assert np.array_equal(runtime.placement.physical_to_logical, want.physical_to_logical)
    runtime.close()
    if rank == 0:
        assert runtime.planner.process is None and proc.poll() is not None


def test_async_runtime_plans_in_the_child_on_rank_0():
    run_distributed(_runtime_body, 2)


@register_policy("test-planner-process-local")
def _local_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    from eplb.core.policy.registry import get_policy

    return get_policy("default")(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)


def test_policy_registered_at_run_time_is_planned_in_the_thread(caplog):
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8, top_k=2,
                   num_redundant_experts=2, seed=0).validate(1)
    model = MoEModel(args)
    with caplog.at_level("INFO", logger="eplb.runtime"):
        runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=2, async_rebalance=True,
                                                policy="test-planner-process-local",
                                                rebalance_interval=0, min_gain=0.0))
    assert runtime.planner.process is None
    assert "not built in" in caplog.text
    runtime.expert_load_pass[:, 0] = 100
    runtime.step()
    runtime.rebalance()
    assert runtime.finish_rebalance().slots_changed > 0
    runtime.close()


def test_planner_process_can_be_turned_off():
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=1, num_experts=4, top_k=2,
                   num_redundant_experts=0, seed=0).validate(1)
    runtime = EplbRuntime(MoEModel(args), EplbConfig(async_rebalance=True, planner_process=False))
    assert runtime.planner.process is None
    runtime.close()
    with pytest.raises(ValueError, match="planner_process must be a bool"):
        EplbConfig(planner_process="yes").verify(4, 1, 4)
