"""Asynchronous rebalance on real gloo ranks: planning and transfers run in a background
thread while the step loop serves. Every forward equals the dense reference, every layer's
weights match its committed maps at every step (a layer switches weights and maps together
at a step boundary that all ranks agree on), and failures abort consistently."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import BACKEND, assert_same_on_every_rank, device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.runtime import EplbRuntime
from test_runtime import _args, _skewed_bias, check_committed


def _serving_body(rank, world, transport="nccl", launch="auto"):
    from moe import DenseMoEModel, MoEModel, sample_tokens

    device = device_for(rank)
    args = _args(num_layers=4, num_redundant_experts=world)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, window_size=4,
                                            rebalance_interval=6, move_tolerance=0.0,
                                            async_rebalance=True, transport=transport,
                                            exchange_launch=launch))
    assert runtime.transport.name == transport
    reference = DenseMoEModel(args, device=device)
    L, N = args.num_layers, args.num_experts
    ptrs = [w.data_ptr() for ws in runtime.expert_weights for w in ws]
    events, flight_steps, switched_mid_flight = [], 0, 0
    for step in range(48):
        bias = _skewed_bias(step, L, N).to(device)
        model.set_routing_bias(bias)
        reference.set_routing_bias(bias)
        x = sample_tokens(args, 48, seed=1000 * step + rank, device=device)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
        check_committed(args, runtime, device)
        committed_before = runtime.physical_to_logical.clone()
        event = runtime.step()
        # every rank switches each layer at the same agreed step: the maps the ranks
        # route by are equal after every step (not only once the rebalance is done)
        for maps in (runtime.physical_to_logical, runtime.logical_to_physical_map,
                     runtime.logical_replica_count):
            assert_same_on_every_rank(maps)
        if runtime.rebalance_in_flight:
            flight_steps += 1
            # "auto" launches from the step loop exactly on CUDA with the NCCL transport
            in_step = launch == "step" or (launch == "auto" and device.type == "cuda"
                                           and transport == "nccl")
            assert runtime._change.launch_in_step == in_step
            changed = (runtime.physical_to_logical != committed_before).any(1).sum().item()
            assert changed <= 1, "at most one layer switches per step"
            switched_mid_flight += changed
        if event is not None:
            events.append(event)
            assert event.steps_in_flight >= 1
            assert np.array_equal(runtime.placement.physical_to_logical,
                                  runtime.physical_to_logical.cpu().numpy())
    last = runtime.finish_rebalance()
    events += [last] if last is not None else []
    check_committed(args, runtime, device)
    assert len(events) >= 3 and flight_steps > 0
    assert switched_mid_flight > 0, "no layer switched while the rebalance was in flight"
    assert sum(e.slots_changed for e in events) > 0
    assert [w.data_ptr() for ws in runtime.expert_weights for w in ws] == ptrs
    assert_same_on_every_rank(runtime.physical_to_logical)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_async_rebalance_serves_correctly_at_every_step(world):
    run_distributed(_serving_body, world)


@pytest.mark.parametrize("launch", ["step", "thread"])
def test_async_rebalance_launching_exchanges_from_the_step_loop_or_the_thread(launch):
    """Both places an exchange can be launched from serve exactly (on CPU "auto" is the
    thread; on 2 GPUs with NCCL it is the step loop, covered by the test above)."""
    run_distributed(_serving_body, 2, "nccl", launch)


@pytest.mark.skipif(BACKEND != "nccl" or torch.cuda.device_count() < 2,
                    reason="CUDA IPC needs EPLB_TEST_BACKEND=nccl and 2 GPUs (GPU machine)")
def test_async_rebalance_over_cuda_ipc():
    run_distributed(_serving_body, 2, "ipc")


def _sync_ipc_body(rank, world):
    """Synchronous rebalances over CUDA IPC move each layer in place (`IpcTransport.move`):
    every forward still equals the dense reference, weights match the maps after each."""
    from moe import DenseMoEModel, MoEModel, sample_tokens

    device = device_for(rank)
    args = _args(num_layers=3, num_redundant_experts=world)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, window_size=4,
                                            rebalance_interval=5, move_tolerance=0.0,
                                            async_rebalance=False, transport="ipc"))
    reference = DenseMoEModel(args, device=device)
    ptrs = [w.data_ptr() for ws in runtime.expert_weights for w in ws]
    events = []
    for step in range(30):
        bias = _skewed_bias(step, args.num_layers, args.num_experts).to(device)
        model.set_routing_bias(bias)
        reference.set_routing_bias(bias)
        x = sample_tokens(args, 48, seed=1000 * step + rank, device=device)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
        event = runtime.step()
        check_committed(args, runtime, device)
        events += [event] if event is not None else []
    assert len(events) >= 3 and sum(e.slots_changed for e in events) > 0
    assert runtime.transport.moves > 0, "the synchronous rebalance did not move in place"
    assert [w.data_ptr() for ws in runtime.expert_weights for w in ws] == ptrs
    assert_same_on_every_rank(runtime.physical_to_logical)


@pytest.mark.skipif(BACKEND != "nccl" or torch.cuda.device_count() < 2,
                    reason="CUDA IPC needs EPLB_TEST_BACKEND=nccl and 2 GPUs (GPU machine)")
def test_sync_rebalance_over_cuda_ipc_moves_in_place():
    run_distributed(_sync_ipc_body, 2)


def _explicit_body(rank, world):
    from moe import MoEModel, sample_tokens

    device = device_for(rank)
    args = _args(num_layers=3, num_redundant_experts=world)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, rebalance_interval=0,
                                            move_tolerance=0.0, control_interval=1,
                                            async_rebalance=True))
    seen = []
    runtime.add_listener(seen.append)
    model.set_routing_bias(_skewed_bias(0, args.num_layers, args.num_experts).to(device))
    model(sample_tokens(args, 64, seed=rank, device=device))
    runtime.step()
    assert runtime.rebalance() is None and runtime.rebalance_in_flight
    event = runtime.finish_rebalance()
    assert event is not None and seen == [event] and not runtime.rebalance_in_flight
    check_committed(args, runtime, device)
    # a request (HTTP path) is served asynchronously and reported when it completes
    rid = runtime.request_rebalance("http") if rank == 0 else None
    states = []
    for _ in range(40):
        model(sample_tokens(args, 64, seed=rank, device=device))
        runtime.step()
        if rank == 0:
            states.append(runtime.rebalance_status(rid)["state"])
        if not runtime.rebalance_in_flight and len(seen) == 2:
            break
    assert len(seen) == 2 and seen[1].trigger == "request"
    if rank == 0:
        assert "running" in states and states[-1] == "done"
    runtime.close()  # not a collective; releases the runtime's own groups
    assert runtime.closed and runtime.groups.control is None and runtime.groups.transfer is None
    with pytest.raises(RuntimeError, match="closed"):
        runtime.step()
    runtime.close()  # idempotent


def test_explicit_and_requested_async_rebalances():
    run_distributed(_explicit_body, 2)


def _failure_body(rank, world, failing_ranks, asynchronous, launch="auto"):
    """An exchange that raises at the second changed layer on `failing_ranks`: every rank
    aborts at the same layer (the others may first wait for the failed rank until the
    transfer timeout), nothing raises in async mode, the failure is counted, the model
    keeps serving exactly, and the next rebalance succeeds on a fresh transfer group."""
    from _faults import Fault, moving_target, p2p_transport
    from moe import DenseMoEModel, MoEModel, sample_tokens

    from eplb.ops.metrics import EplbMetrics
    from eplb.runtime import RebalanceError

    device = device_for(rank)
    args = _args(num_layers=4, num_redundant_experts=world)
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    # the fault is injected through the transport object the runtime is given
    fault = Fault("exchange", 2, "raise", ranks=failing_ranks)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, rebalance_interval=0,
                                            async_rebalance=asynchronous, transfer_timeout=2.0,
                                            exchange_launch=launch),
                          transport=p2p_transport([fault], rank))
    metrics = EplbMetrics(runtime, interval=1000)
    failures = []
    runtime.add_failure_listener(lambda trigger, e: failures.append((trigger, e)))
    reference = DenseMoEModel(args, device=device)
    old = runtime.placement
    # same on every rank; every rank's slots change in every layer, so every rank's
    # transport sees the second changed layer as its second exchange
    target = moving_target(old.physical_to_logical, world, args.num_experts, seed=5)
    new = old.with_physical_to_logical(target, "test")
    if asynchronous:
        assert runtime.apply_placement(new, wait=False) is None and runtime.rebalance_in_flight
        for _ in range(2000):
            runtime.step()
            # every rank routes by the same maps after every step, matching its weights
            for maps in (runtime.physical_to_logical, runtime.logical_to_physical_map,
                         runtime.logical_replica_count):
                assert_same_on_every_rank(maps)
            check_committed(args, runtime, device)
            if not runtime.rebalance_in_flight:
                break
    else:
        with pytest.raises(RebalanceError, match="after 1 of 4 changed layers"):
            runtime.apply_placement(new)
    assert bool(fault.fired) == (rank in failing_ranks)
    assert not runtime.rebalance_in_flight and len(failures) == 1
    assert "after 1 of 4 changed layers" in str(failures[0][1])
    assert metrics.value("eplb_rebalances_total", trigger="api", outcome="failure") == 1
    p2l = runtime.placement.physical_to_logical
    assert np.array_equal(p2l[:1], target[:1]) and np.array_equal(p2l[1:], old.physical_to_logical[1:])
    check_committed(args, runtime, device)
    x = sample_tokens(args, 32, seed=rank, device=device)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    runtime.apply_placement(new)  # the next change goes through
    check_committed(args, runtime, device)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    runtime.close()  # threads of the aborted change end by their group's timeout
    assert not runtime._stale


@pytest.mark.parametrize("failing,asynchronous,launch", [
    pytest.param((0, 1, 2, 3), True, "auto", marks=pytest.mark.slow),
    pytest.param((1,), True, "auto", marks=pytest.mark.slow),  # async kept below, launched in step
    ((1,), False, "auto"), ((1,), True, "step")])
def test_failed_exchange_aborts_every_rank_at_the_same_layer(failing, asynchronous, launch):
    run_distributed(_failure_body, 4, failing, asynchronous, launch, timeout=120)


def test_config_fields():
    assert EplbConfig(async_rebalance=True, transfer_timeout=5).verify(8, 2, 8).async_rebalance
    for launch in ("auto", "thread", "step"):
        assert EplbConfig(exchange_launch=launch).verify(8, 2, 8).exchange_launch == launch
    for bad in (dict(async_rebalance=1), dict(transfer_timeout=0), dict(transfer_timeout=float("nan")),
                dict(transfer_timeout=True), dict(transfer_timeout="5"),
                dict(exchange_launch="later"), dict(exchange_launch=None)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EplbConfig(**bad).verify(8, 2, 8)



def test_runtime_keeps_the_newest_events_only():
    from moe import MoEModel

    args = _args(num_layers=1, num_redundant_experts=0)
    runtime = EplbRuntime(MoEModel(args), EplbConfig(rebalance_interval=0))
    runtime.MAX_EVENTS = 3
    placement = runtime.placement
    for i in range(5):
        runtime.apply_placement(placement, trigger=f"t{i}")
    assert [e.trigger for e in runtime.events] == ["t2", "t3", "t4"]


def _one_rank_groups_body(rank, world):
    """Each rank runs its own one-rank EP group inside a larger world: its runtime talks to
    no one (no agreement, transport vote or broadcast leaks onto the world group)."""
    from moe import DenseMoEModel, MoEModel, sample_tokens

    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank, same order
    mine = groups[rank]
    args = _args(num_layers=2, num_redundant_experts=4)
    model = MoEModel(args, group=mine)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, window_size=2,
                                            rebalance_interval=2 + rank, control_interval=1,
                                            move_tolerance=0.0, transport="auto",
                                            async_rebalance=rank == 1), group=mine)
    reference = DenseMoEModel(args)
    for step in range(12):  # the ranks rebalance at different steps
        bias = _skewed_bias(step, args.num_layers, args.num_experts)
        model.set_routing_bias(bias)
        reference.set_routing_bias(bias)
        x = sample_tokens(args, 32, seed=step)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
        runtime.step()
    runtime.finish_rebalance()
    check_committed(args, runtime, torch.device("cpu"))
    assert runtime.events


def test_one_rank_ep_groups_inside_a_larger_world():
    if device_for(0).type == "cuda":
        pytest.skip("one-rank CPU groups; runs on gloo")
    run_distributed(_one_rank_groups_body, 2, timeout=120)
