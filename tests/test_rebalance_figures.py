"""The figures every rebalance reports are true.

On real gloo ranks and a skewed load with spare slots, the test keeps its own record of
the load the model counted (the per-GPU and per-expert sums of `expert_load_view` over
the window) and checks, against that record alone:

- `balancedness_before` is mean/max of the measured per-GPU window (to 1e-9);
- `balancedness_after` is the window's load on the new placement, computed here as
  `shared/tools/planeval.py` defines it, and is higher;
- `predicted_gain` is the difference of the two predictions; the plan phase took > 0 s;
- the same numbers reach the event, the log line, the Prometheus metrics and
  GET /rebalance/<id>, in every mode (synchronous, asynchronous with the planner in a
  process or in the thread, `apply_placement`);
- a rebalance with nothing to gain, or gaining less than `min_gain`, moves nothing and
  says so.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import urllib.request

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.ops.metrics import EplbMetrics
from eplb.core.planning import plan
from eplb.runtime import EplbRuntime
from eplb.ops.client import describe_status
from eplb.ops.server import EplbServer

WINDOW = 6


def _args():
    from moe import MoEArgs

    return MoEArgs(hidden_size=32, intermediate_size=16, num_layers=3, num_experts=8, top_k=2,
                   num_redundant_experts=4, seed=5)


def _bias(L: int, N: int, seed: int) -> torch.Tensor:
    """A heavily skewed routing bias [L, N], the same on every rank."""
    p = np.random.default_rng(seed).dirichlet(np.full(N, 0.2), size=L)  # [L, N]
    return torch.from_numpy(np.log(np.maximum(p, 1e-6))).float()


def measured_balancedness(gpu: np.ndarray) -> np.ndarray:  # [L, M] -> [L]
    gpu = gpu.astype(np.float64)
    return gpu.mean(1) / gpu.max(1)


def predicted_balancedness(load: np.ndarray, p2l: np.ndarray, num_gpus: int) -> np.ndarray:
    """planeval's definition: an expert's tokens split evenly over its replicas; [L]."""
    L, P = p2l.shape
    count = np.zeros(load.shape)  # [L, N]
    np.add.at(count, (np.repeat(np.arange(L), P), p2l.ravel()), 1)
    per_slot = np.take_along_axis(load, p2l, 1) / np.take_along_axis(count, p2l, 1)  # [L, P]
    gpu = per_slot.reshape(L, num_gpus, -1).sum(-1)  # [L, M]
    return gpu.mean(1) / gpu.max(1)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _serve(model, runtime, steps: int, bias: torch.Tensor, device, seed: int):
    """Run `steps` forwards + step(); return this test's own record of the load counted in
    them, all ranks summed: per GPU [L, M] and per logical expert [L, N]."""
    from moe import sample_tokens

    args = model.args
    L, M = runtime.placement.num_layers, runtime.world_size
    gpu = np.zeros((L, M), dtype=np.int64)
    logical = np.zeros((L, args.num_experts), dtype=np.int64)
    model.set_routing_bias(bias.to(device))
    for i in range(steps):
        x = sample_tokens(args, 64, seed=seed * 1000 + i * 7 + runtime.rank, device=device)
        with torch.no_grad():
            model(x)
        counts = runtime.expert_load_pass.clone()  # [L, P] this rank's counts of the pass
        dist.all_reduce(counts)
        p2l = runtime.physical_to_logical.cpu().numpy()  # [L, P]
        c = counts.cpu().numpy()
        gpu += c.reshape(L, M, -1).sum(-1)
        for layer in range(L):
            np.add.at(logical[layer], p2l[layer], c[layer])
        assert runtime.step() is None
    return gpu, logical


def _wait_event(model, runtime, bias, device):
    """Serve until the rebalance in flight (or requested) returns its event."""
    from moe import sample_tokens

    model.set_routing_bias(bias.to(device))
    for i in range(200):
        x = sample_tokens(model.args, 64, seed=99_000 + i, device=device)
        with torch.no_grad():
            model(x)
        event = runtime.step()
        if event is not None:
            return event
    raise AssertionError("no rebalance event within 200 steps")


def _figures_body(rank, world, mode):
    from moe import MoEModel

    device = device_for(rank)
    args = _args()
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    L, N, M = args.num_layers, args.num_experts, world
    config = EplbConfig(num_redundant_experts=args.num_redundant_experts, window_size=WINDOW,
                        rebalance_interval=0, control_interval=1, min_gain=0.0,
                        # every plan with the config's move tolerance, as recomputed below (a
                        # shift or a drift plans with 0: tests/test_shift.py)
                        shift_threshold=0.0,
                        async_rebalance=mode.startswith("async"),
                        planner_process=mode == "async-process")
    runtime = EplbRuntime(model, config)
    metrics = EplbMetrics(runtime, interval=1)
    server = EplbServer(runtime, metrics, port=0).start() if rank == 0 else None
    lines = _Lines()
    logging.getLogger("eplb.runtime").addHandler(lines)
    logging.getLogger("eplb.runtime").setLevel(logging.INFO)
    initial = runtime.placement
    weights_before = [[w.clone() for w in ws] for ws in runtime.expert_weights]
    bias = _bias(L, N, seed=11)

    # ---- a rebalance on a skewed window: every reported figure from our own record ----
    gpu, logical = _serve(model, runtime, WINDOW - 1, bias, device, seed=1)
    rid = runtime.request_rebalance("test") if rank == 0 and mode != "apply" else None
    # the step that agrees on the request records its own load first: count it too
    from moe import sample_tokens

    x = sample_tokens(args, 64, seed=777 + rank, device=device)
    with torch.no_grad():
        model(x)
    counts = runtime.expert_load_pass.clone()
    dist.all_reduce(counts)
    c, p2l0 = counts.cpu().numpy(), runtime.physical_to_logical.cpu().numpy()
    gpu += c.reshape(L, M, -1).sum(-1)
    for layer in range(L):
        np.add.at(logical[layer], p2l0[layer], c[layer])
    if mode == "apply":
        assert runtime.step() is None  # nothing requested: apply_placement reads the window
        target = plan(logical, M, initial.num_slots, previous=initial)
        event = runtime.apply_placement(target, trigger="api")
    else:
        event = runtime.step()
        if event is None:
            event = _wait_event(model, runtime, bias, device)
    want_before = measured_balancedness(gpu)  # [L]
    want_after = predicted_balancedness(logical.astype(np.float64), event.placement.physical_to_logical, M)
    want_initial = predicted_balancedness(logical.astype(np.float64), initial.physical_to_logical, M)
    np.testing.assert_allclose(event.balancedness_before, want_before, rtol=0, atol=1e-9)
    np.testing.assert_allclose(event.balancedness_after, want_after, rtol=0, atol=1e-9)
    assert want_after.mean() > want_before.mean() + 0.02, (want_before, want_after)
    assert not event.skipped and event.slots_changed > 0 and event.experts_moved > 0
    assert event.predicted_gain == pytest.approx(want_after.mean() - want_initial.mean(), abs=1e-9)
    if mode != "apply":
        assert event.seconds_plan > 0
    assert event.move_tolerance == (None if mode == "apply" else config.move_tolerance)  # apply: no plan
    assert event.describe().endswith("" if mode == "apply" else ", move tolerance 0.03"), event.describe()
    if not mode.startswith("async"):
        assert event.steps_in_flight == 0
    line = f"{want_before.mean():.4f} -> {want_after.mean():.4f} (predicted)"
    if rank == 0:
        ours = [s for s in lines.lines if s.startswith(f"rebalance at step {event.step} ")]
        assert len(ours) == 1 and line in ours[0], (line, lines.lines)
        if not mode.startswith("async"):
            assert " over " not in ours[0], ours[0]
        m = metrics.value
        assert m("eplb_rebalance_balancedness_ratio", when="before") == pytest.approx(want_before.mean(), abs=1e-9)
        assert m("eplb_rebalance_balancedness_ratio", when="after") == pytest.approx(want_after.mean(), abs=1e-9)
        trigger = "api" if mode == "apply" else "request"
        assert m("eplb_rebalances_total", trigger=trigger, outcome="success") == 1
        assert m("eplb_rebalance_duration_seconds_sum", phase="plan") == pytest.approx(event.seconds_plan)
        if mode != "apply":
            assert m("eplb_rebalance_duration_seconds_sum", phase="plan") > 0
            with urllib.request.urlopen(f"{server.url}/rebalance/{rid}", timeout=10) as r:
                status = json.load(r)
            assert status["state"] == "done", status
            got = status["result"]
            assert got["balancedness_before"] == pytest.approx(want_before.mean(), abs=1e-9)
            assert got["balancedness_after"] == pytest.approx(want_after.mean(), abs=1e-9)
            assert got["predicted_gain"] == pytest.approx(event.predicted_gain, abs=1e-12)
            assert got["move_tolerance"] == config.move_tolerance == 0.03  # detection off: the config's
            assert got["outcome"] == "success" and got["skipped"] is False
            # what `eplb trigger --wait` prints for it
            assert describe_status(status).startswith(
                f"done at step {status['step']}: balancedness {want_before.mean():.3f} -> "
                f"{want_after.mean():.3f} (predicted), {event.experts_moved} experts moved")

    # ---- the same window again: the plan is the placement in force, nothing to gain ----
    placed = runtime.placement
    snapshot = [[w.clone() for w in ws] for ws in runtime.expert_weights]
    steps_since_change = runtime.recorder.gpu_steps
    again = runtime.rebalance("api")
    if again is None:  # asynchronous: served by the next steps
        again = _wait_event(model, runtime, bias, device)
    assert again.skipped and again.predicted_gain == 0.0, again.summary()
    assert again.slots_changed == again.experts_moved == again.bytes_moved == 0
    assert runtime.placement is placed
    for ws, olds in zip(runtime.expert_weights, snapshot):
        for w, o in zip(ws, olds):
            assert torch.equal(w, o)
    assert runtime.recorder.gpu_steps >= steps_since_change  # measured window kept
    assert "skipped: nothing to gain" in again.describe()
    if rank == 0:
        assert metrics.value("eplb_rebalances_total", trigger="api", outcome="skipped") == 1
        assert any("skipped: nothing to gain" in s for s in lines.lines)

    # ---- a plan that gains, but less than min_gain: skipped, with its figures ----
    runtime.config = dataclasses.replace(runtime.config, min_gain=0.9)
    gpu, logical = _serve(model, runtime, WINDOW, _bias(L, N, seed=23), device, seed=2)
    snapshot = [[w.clone() for w in ws] for ws in runtime.expert_weights]
    small = runtime.rebalance("api")
    if small is None:
        small = _wait_event(model, runtime, _bias(L, N, seed=23), device)
    kept = predicted_balancedness(logical.astype(np.float64), placed.physical_to_logical, M)
    assert small.skipped and 0 < small.predicted_gain < 0.9, small.summary()
    np.testing.assert_allclose(small.balancedness_before, measured_balancedness(gpu), rtol=0, atol=1e-9)
    np.testing.assert_allclose(small.balancedness_after, kept, rtol=0, atol=1e-9)
    fresh = plan(logical, M, placed.num_slots, previous=placed)
    want_gain = predicted_balancedness(logical.astype(np.float64), fresh.physical_to_logical, M).mean() - kept.mean()
    assert small.predicted_gain == pytest.approx(want_gain, abs=1e-9)
    assert small.experts_moved == 0 and runtime.placement is placed
    for ws, olds in zip(runtime.expert_weights, snapshot):
        for w, o in zip(ws, olds):
            assert torch.equal(w, o)
    assert "< min gain 0.9000" in small.describe()
    assert describe_status({"state": "done", "step": small.step, "result": small.summary()}) == (
        f"skipped at step {small.step}: predicted gain {small.predicted_gain:+.4f} < min gain "
        f"0.9000; balancedness {measured_balancedness(gpu).mean():.4f}, nothing moved")
    if rank == 0:
        assert metrics.value("eplb_rebalances_total", trigger="api", outcome="skipped") == 2
        assert metrics.value("eplb_rebalance_balancedness_ratio", when="after") == pytest.approx(kept.mean(), abs=1e-9)
    del weights_before
    if server is not None:
        server.stop()
    runtime.close()


@pytest.mark.parametrize("mode", ["sync", "async-process", "async-thread", "apply"])
def test_every_reported_figure_comes_from_the_recorded_window(mode):
    run_distributed(_figures_body, 2, mode, timeout=240)


def test_min_gain_is_checked():
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="min_gain"):
            EplbConfig(min_gain=bad).verify(8, 2)
    assert EplbConfig(min_gain=0).verify(8, 2).min_gain == 0
