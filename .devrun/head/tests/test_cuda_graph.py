"""CUDA-graph safety: a captured MoE forward keeps computing the right function across
rebalances, because the runtime rewrites weights and maps in place (same storage).

GPU only: every test here is skipped without CUDA; the two-GPU test also needs
EPLB_TEST_BACKEND=nccl (as on the GPU machine) and two visible GPUs.
"""
from __future__ import annotations

import contextlib
import faulthandler
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import BACKEND, device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.runtime import EplbRuntime
from moe import DenseMoEModel, MoEArgs, MoEModel, sample_tokens
from test_moe import random_bias, random_placement

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16 end to end (the grouped-GEMM path); the dense oracle computes the same function
# in a different order, so outputs agree to bf16 precision, not bitwise
BF16_TOL = dict(atol=6e-2, rtol=6e-2)
ARGS = dict(hidden_size=128, intermediate_size=64, num_layers=2, num_experts=8, top_k=2,
            num_redundant_experts=4, num_shared_experts=1, dtype=torch.bfloat16)


def _bias(args: MoEArgs, seed: int) -> torch.Tensor:  # [L, N] skewed, so replicas matter
    return random_bias(args, seed)


_random_placement = random_placement  # every expert once plus P - N random replicas


def _fold(load: torch.Tensor, p2l: np.ndarray, N: int) -> torch.Tensor:  # [L, P] -> [L, N]
    idx = torch.from_numpy(np.array(p2l, dtype=np.int64)).to(load.device)
    return torch.zeros(load.shape[0], N, dtype=load.dtype, device=load.device).scatter_add_(
        1, idx, load)


@contextlib.contextmanager
def _no_host_sync():
    """Any synchronising CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _capture(model: MoEModel, static_x: torch.Tensor, nccl: bool = False):
    """Warm up on a side stream (kernels chosen, communicators up), then capture one
    forward of `static_x`; returns (graph, static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local" if nccl else "global"):
        static_y = model(static_x)
    torch.cuda.synchronize()
    return graph, static_y


def _replay(graph, static_x, static_y, runtime: EplbRuntime, x: torch.Tensor):
    """Copy x into the captured input, zero the load pass, replay; (output, load [L, P])."""
    static_x.copy_(x)
    runtime.expert_load_pass.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return static_y.clone(), runtime.expert_load_pass.clone()


def _eager(model: MoEModel, runtime: EplbRuntime, x: torch.Tensor):
    runtime.expert_load_pass.zero_()
    y = model(x)
    return y, runtime.expert_load_pass.clone()


@needs_cuda
def test_single_gpu_forward_and_recording_have_no_host_sync():
    """The whole single-GPU forward (routing, replica choice, load counting, grouped GEMM)
    and runtime.step() (folding the counts into the window) run without a host sync."""
    args = MoEArgs(**ARGS)
    model = MoEModel(args, device="cuda")
    model.set_routing_bias(_bias(args, 1).cuda())
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, window_size=8,
                                            rebalance_interval=0, control_interval=0))
    x = sample_tokens(args, 96, seed=1, device="cuda")
    model(x)  # first call: kernel selection, lazy init
    runtime.step()
    torch.cuda.synchronize()
    assert all(layer.experts.use_grouped_mm for layer in model.moe_layers)
    with _no_host_sync():
        for _ in range(3):
            model(x)
            runtime.step()
    torch.cuda.synchronize()
    logical, _ = runtime.recorder.window_load()
    assert torch.equal(logical.sum(1).cpu(), torch.full((2,), 4 * 96 * args.top_k))


@needs_cuda
def test_a_size_first_seen_inside_a_capture_is_not_cached_unfilled():
    """`moe.dispatch` caches small per-size tables; one first made inside a capture holds
    nothing until replay, so it must not be cached: an eager forward of that size after
    the capture still routes right (equal to the same model's before, load included)."""
    from moe.dispatch import _CONSTANTS

    args = MoEArgs(**ARGS)
    model = MoEModel(args, device="cuda")
    x = sample_tokens(args, 77, seed=4, device="cuda")  # a T*K no other test uses
    model.expert_load_view.zero_()
    want = model(x)
    want_load = model.expert_load_view.clone()
    model(sample_tokens(args, 64, seed=5, device="cuda"))  # kernels warmed up
    torch.cuda.synchronize()
    _CONSTANTS.clear()  # this size's tables are now made inside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x)
    torch.cuda.synchronize()
    model.expert_load_view.zero_()
    assert torch.equal(model(x), want)  # eager, after the capture
    assert torch.equal(model.expert_load_view, want_load)


@needs_cuda
def test_captured_forward_follows_rebalances():
    """Capture once; replay before and after two rebalances (a random placement through
    apply_placement, then one planned by runtime.rebalance() with weighted replicas).
    Every replay equals the eager forward bitwise and the dense oracle to bf16 precision,
    and its per-slot load is the new placement's (it folds to the oracle's logical load
    with the new maps, not with the old)."""
    args = MoEArgs(**ARGS)
    L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
    model, ref = MoEModel(args, device="cuda"), DenseMoEModel(args, "cuda")
    bias = _bias(args, 2).cuda()
    model.set_routing_bias(bias)
    ref.set_routing_bias(bias)
    # one GPU gains nothing in balance: min_gain 0 so every plan that differs moves
    config = EplbConfig(num_redundant_experts=P - N, window_size=4, rebalance_interval=0,
                        control_interval=0, weighted_replicas=True, min_gain=0.0)
    runtime = EplbRuntime(model, config)
    static_x = sample_tokens(args, 128, seed=0, device="cuda")
    graph, static_y = _capture(model, static_x)
    ptrs = [w.data_ptr() for ws in model.expert_weights for w in ws]
    map_ptrs = [t.data_ptr() for t in (runtime.logical_to_physical_map,
                                       runtime.logical_replica_count,
                                       runtime.logical_replica_cdf, runtime.expert_load_pass)]

    def check(x: torch.Tensor, placement: Placement, previous: Placement | None,
              even: bool = True) -> torch.Tensor:
        y, load = _replay(graph, static_x, static_y, runtime, x)  # [T, H], [L, P]
        y_eager, load_eager = _eager(model, runtime, x)
        assert torch.equal(y, y_eager) and torch.equal(load, load_eager)
        ref.reset_load()
        torch.testing.assert_close(y.float(), ref(x).float(), **BF16_TOL)
        assert torch.equal(load.sum(1).cpu(), torch.full((L,), x.shape[0] * args.top_k))
        assert torch.equal(_fold(load, placement.physical_to_logical, N), ref.logical_load)
        if previous is not None:  # the old maps would book the same counts elsewhere
            assert not torch.equal(_fold(load, previous.physical_to_logical, N), ref.logical_load)
        # a slot gets tokens only if it holds a chosen expert, and (even split) each
        # replicated expert with enough tokens reaches more than one of its slots
        chosen = (ref.logical_load > 0).cpu().numpy()  # [L, N]
        p2l = placement.physical_to_logical  # [L, P]
        holds_chosen = np.take_along_axis(chosen, p2l, 1)  # [L, P]
        assert not (load.cpu().numpy()[~holds_chosen]).any()
        for layer in range(L if even else 0):
            repl = [e for e in range(N)
                    if (p2l[layer] == e).sum() > 1 and int(ref.logical_load[layer, e]) >= 20]
            for e in repl:
                assert (load[layer].cpu().numpy()[p2l[layer] == e] > 0).sum() > 1, (layer, e)
        return load

    first = runtime.placement
    x = sample_tokens(args, 128, seed=1, device="cuda")
    check(x, first, None)

    second = _random_placement(L, N, P, 1, seed=5)
    runtime.apply_placement(second)
    load = check(x, second, first)

    # the runtime's own path: record the replays, plan with weighted replicas, move
    for step in range(3):
        _replay(graph, static_x, static_y, runtime, sample_tokens(args, 128, seed=10 + step,
                                                                  device="cuda"))
        runtime.step()
    event = runtime.rebalance()
    third = runtime.placement
    assert event.slots_changed > 0 and third != second
    load3 = check(x, third, second, even=third.shares is None)
    assert not torch.equal(load3, load)

    assert ptrs == [w.data_ptr() for ws in model.expert_weights for w in ws]
    assert map_ptrs == [t.data_ptr() for t in (runtime.logical_to_physical_map,
                                               runtime.logical_replica_count,
                                               runtime.logical_replica_cdf,
                                               runtime.expert_load_pass)]


def _two_gpu_graph_worker(rank: int, world: int) -> None:
    """Prints a failure at once (the process group's teardown can then block on the
    peer, hiding it) and every thread's stack if the rank hangs."""
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        _two_gpu_graph_body(rank, world)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()


def _say(rank: int, what: str) -> None:  # progress, shown when the test fails
    print(f"[rank {rank}] {what}", file=sys.stderr, flush=True)


def _two_gpu_graph_body(rank: int, world: int) -> None:
    device = device_for(rank)
    args = MoEArgs(**ARGS, dispatch_mode="fixed")
    L, N, P = args.num_layers, args.num_experts, args.num_physical_experts
    model, ref = MoEModel(args, group=dist.group.WORLD, device=device), DenseMoEModel(args, device)
    bias = _bias(args, 3).to(device)
    model.set_routing_bias(bias)
    ref.set_routing_bias(bias)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=P - N, window_size=4,
                                            rebalance_interval=0, control_interval=0,
                                            min_gain=0.0),  # the test needs moves
                          group=dist.group.WORLD)
    T = 96  # "fixed" dispatch exchanges T*K-row blocks: the same T on every rank
    static_x = sample_tokens(args, T, seed=rank, device=device)
    model(static_x)  # communicators and kernels warm
    torch.cuda.synchronize()
    _say(rank, "eager forward done")
    with _no_host_sync():  # "fixed" dispatch: the EP forward needs no split sizes on the host
        model(static_x)
    torch.cuda.synchronize()
    _say(rank, "no host sync in the EP forward")
    graph, static_y = _capture(model, static_x, nccl=True)
    _say(rank, "captured")

    x = sample_tokens(args, T, seed=50 + rank, device=device)
    for placement in (runtime.placement, _random_placement(L, N, P, world, seed=7)):
        if placement is not runtime.placement:
            runtime.apply_placement(placement)  # moves between the GPUs, outside the graph
            _say(rank, "rebalanced")
        y, load = _replay(graph, static_x, static_y, runtime, x)
        _say(rank, "replayed")
        ref.reset_load()
        torch.testing.assert_close(y.float(), ref(x).float(), **BF16_TOL)
        assert torch.equal(_fold(load, placement.physical_to_logical, N), ref.logical_load)
        y_eager, _ = _eager(model, runtime, x)
        assert torch.equal(y, y_eager)


@needs_cuda
@pytest.mark.skipif(BACKEND != "nccl", reason="needs EPLB_TEST_BACKEND=nccl (GPU machine)")
def test_captured_two_gpu_forward_with_fixed_dispatch_follows_rebalance():
    """Two GPUs, NCCL, `dispatch_mode="fixed"`: the EP forward (all-to-alls included) is
    captured once and replayed across a rebalance that moves experts between the GPUs."""
    run_distributed(_two_gpu_graph_worker, 2, timeout=240)
