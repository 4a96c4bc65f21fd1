"""Checks at registration and on the recorded load, for any model: replicas of one expert
hold bitwise-equal weights in every registered tensor (start-up layout: slot p holds expert
p mod N), registered tensors are [S, ...] and the layer's own, and a model that counts no
load gets one warning and rebalances that move nothing."""
import logging

import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.runtime import NO_LOAD, EplbRuntime
from eplb.ops.client import describe_status
from test_runtime import _args, _skewed_bias, check_committed


def _flip_bit(t: torch.Tensor, index: int = 5) -> None:
    """Flip the lowest bit of element `index` of `t` (float32) in place."""
    with torch.no_grad():
        t.reshape(-1).view(torch.int32)[index] ^= 1


def _with_bias(model):
    """Give every MoE layer of `model` a third expert tensor, a bias [S, H] filled in the
    start-up layout (slot p holds expert p mod N), returned by its get_expert_weights."""
    S, N, H = model.num_local_physical_experts, model.num_logical_experts, model.args.hidden_size
    for i, layer in enumerate(model.moe_layers):
        experts = [(model.ep_rank * S + s) % N for s in range(S)]
        layer.bias = torch.stack([torch.full((H,), 100.0 * i + e, device=model.device)
                                  for e in experts])  # [S, H]
        layer.get_expert_weights = (lambda l=layer: [l.experts.w13, l.experts.w2, l.bias])
    return model


def _bad_registration_body(rank, world, case):
    from moe import MoEModel

    device = device_for(rank)
    args = _args(num_layers=2)  # N = 8, P = 12: rank 1 holds slots 6..11 = experts 6, 7, 0..3
    model = MoEModel(args, group=dist.group.WORLD, device=device)
    if case == "last-tensor":
        _with_bias(model)
    if rank == 1:
        if case == "w2-bit":  # slot 9 (local 3) = expert 1, layer 1, tensor 1
            _flip_bit(model.moe_layers[1].get_expert_weights()[1][3])
        elif case == "last-tensor":  # slot 8 (local 2) = expert 0, layer 0, tensor 2 only
            _flip_bit(model.moe_layers[0].bias[2])
        elif case == "permuted":  # slots 8 and 9 hold experts 1 and 0: another order
            with torch.no_grad():
                for layer in model.moe_layers:
                    for w in layer.get_expert_weights():
                        w[[2, 3]] = w[[3, 2]]
        elif case == "dim0":  # only this rank registers a tensor of 5 rows
            layer = model.moe_layers[1]
            layer.get_expert_weights = lambda: [layer.experts.w13[:5], layer.experts.w2]
    with pytest.raises(ValueError) as err:
        EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0))
    msg = str(err.value)
    want = {"w2-bit": ["layer 1, expert 1: tensor 1", "slot(s) [9]", "rank(s) [1]",
                       "differs from slot 1 (rank 0)"],
            "last-tensor": ["layer 0, expert 0: tensor 2", "slot(s) [8]"],
            "permuted": ["layer 0, expert 0: tensor 0", "slot(s) [8]", "mismatches in all"],
            "dim0": (["expert_weights[1][0] has shape (5, 32, 32)",
                      "num_local_physical_experts=6"] if rank == 1
                     else ["rank(s) [1] registered expert weights that do not fit"])}[case]
    for part in want:
        assert part in msg, msg
    if case != "dim0":
        assert "slot p must hold logical expert p mod N (N=8, P=12" in msg, msg


@pytest.mark.parametrize("case", ["w2-bit", "last-tensor", "permuted", "dim0"])
def test_bad_registration_raises_on_every_rank(case):
    run_distributed(_bad_registration_body, 2, case, timeout=120)


def _good_registration_body(rank, world):
    from moe import MoEModel, sample_tokens

    device = device_for(rank)
    args = _args(num_layers=2)
    model = _with_bias(MoEModel(args, group=dist.group.WORLD, device=device))
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0,
                                            window_size=4, min_gain=0.0))
    assert [len(ws) for ws in runtime.expert_weights] == [3, 3]
    for step in range(4):
        model.set_routing_bias(_skewed_bias(step, 2, 8).to(device))
        model(sample_tokens(args, 48, seed=100 * step + rank, device=device))
        runtime.step()
    event = runtime.rebalance()
    assert not event.skipped and event.slots_changed > 0
    check_committed(args, runtime, device)
    runtime.close()


def test_good_registration_with_three_tensors_constructs_and_rebalances():
    run_distributed(_good_registration_body, 2)


def test_dim0_message_one_process():
    from moe import MoEModel

    model = MoEModel(_args(num_layers=2))
    layer = model.moe_layers[0]
    layer.get_expert_weights = lambda: [layer.experts.w13, layer.experts.w2.transpose(0, 1)]
    with pytest.raises(ValueError, match=r"expert_weights\[0\]\[1\] has shape \(32, 12, 16\); dim 0 "
                                         r"must be the local slot count num_local_physical_experts=12"):
        EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0))


def test_registered_copies_are_refused():
    from moe import MoEModel

    class Copying(MoEModel):
        def set_eplb_state(self, *tensors):
            super().set_eplb_state(*tensors)
            self.expert_weights[:] = [[w.clone() for w in ws] for ws in self.expert_weights]

    with pytest.raises(ValueError, match=r"expert_weights\[0\]\[0\] shares no memory with the "
                                         r"tensors moe_layers\[0\]\.get_expert_weights\(\)"):
        EplbRuntime(Copying(_args(num_layers=2)),
                    EplbConfig(num_redundant_experts=4, rebalance_interval=0))


def test_replicas_on_one_rank_checked():
    """One process holds every slot: slots 8..11 replicate experts 0..3 on the same rank."""
    from moe import MoEModel

    model = MoEModel(_args(num_layers=2))
    _flip_bit(model.moe_layers[0].get_expert_weights()[1][11])
    with pytest.raises(ValueError, match=r"layer 0, expert 3: tensor 1 .* slot\(s\) \[11\] "
                                         r"\(rank\(s\) \[0\]\) differs from slot 3"):
        EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0))


# ---- a model that records no load -------------------------------------------------------
class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def no_load(self):
        return [m for m in self.messages if "recorded no load" in m]


def _snapshot(runtime):
    return ([[w.clone() for w in ws] for ws in runtime.expert_weights],
            [t.clone() for t in runtime._maps], runtime.placement)


def _assert_unchanged(runtime, snap):
    weights, maps, placement = snap
    assert runtime.placement is placement
    for ws, olds in zip(runtime.expert_weights, weights):
        for w, o in zip(ws, olds):
            assert torch.equal(w, o)
    for t, o in zip(runtime._maps, maps):
        assert torch.equal(t, o)


def _zero_load_body(rank, world, asynchronous):
    from moe import MoEModel, sample_tokens

    device = device_for(rank)
    args = _args(num_layers=2)
    L, N = args.num_layers, args.num_experts
    model = MoEModel(args, group=dist.group.WORLD if world > 1 else None, device=device)
    model.set_record_load(False)
    runtime = EplbRuntime(model, EplbConfig(
        num_redundant_experts=4, window_size=4, rebalance_interval=6, min_gain=0.0,
        zero_load_warn_steps=3, async_rebalance=asynchronous, planner_process=False))
    handler = _Warnings()
    logging.getLogger("eplb.runtime").addHandler(handler)
    snap = _snapshot(runtime)

    def serve(steps, first):
        events = []
        for step in range(first, first + steps):
            model.set_routing_bias(_skewed_bias(step, L, N).to(device))
            model(sample_tokens(args, 48, seed=100 * step + rank, device=device))
            events.append(runtime.step())
            if step + 1 == 2:
                assert handler.no_load() == []  # not before zero_load_warn_steps
        if asynchronous:
            events.append(runtime.finish_rebalance())
        return [e for e in events if e is not None]

    try:
        events = serve(8, 0)  # the interval rebalance at step 6 sees an all-zero window
        assert len(handler.no_load()) == (1 if rank == 0 else 0), handler.messages
        if rank == 0:
            assert "no load in 3 steps: expert_load_view is still all zero" in handler.no_load()[0]
        assert len(events) == 1, events
        event = events[0]
        assert event.skipped and event.skip_reason == NO_LOAD, event.summary()
        assert event.experts_moved == event.slots_changed == event.bytes_moved == 0
        assert "skipped: no load recorded" in event.describe()
        assert describe_status({"state": "done", "step": event.step, "result": event.summary()}
                               ).startswith(f"skipped at step {event.step}: no load recorded")
        _assert_unchanged(runtime, snap)
        if not asynchronous:
            again = runtime.rebalance()  # asked for: skipped alike
            assert again.skipped and again.skip_reason == NO_LOAD
            _assert_unchanged(runtime, snap)

        model.set_record_load(True)  # the model counts again: the next rebalance moves
        events = serve(6, 8)  # interval rebalance at step 12
        assert len(events) == 1 and not events[0].skipped, [e.summary() for e in events]
        assert events[0].slots_changed > 0 and runtime.placement is not snap[2]
        check_committed(args, runtime, device)
        assert len(handler.no_load()) == (1 if rank == 0 else 0)  # once, never again
    finally:
        logging.getLogger("eplb.runtime").removeHandler(handler)
        runtime.close()


def test_zero_load_warns_once_and_moves_nothing_two_ranks():
    run_distributed(_zero_load_body, 2, False)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_zero_load_one_process(asynchronous):
    _zero_load_body(0, 1, asynchronous)


def test_zero_load_warning_off_and_not_with_load(caplog):
    from moe import MoEModel, sample_tokens

    args = _args(num_layers=2)
    for warn_steps, record in ((0, False), (2, True)):
        model = MoEModel(args)
        model.set_record_load(record)
        runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0,
                                                zero_load_warn_steps=warn_steps))
        with caplog.at_level(logging.WARNING, logger="eplb.runtime"):
            for step in range(4):
                model(sample_tokens(args, 16, seed=step))
                runtime.step()
        assert "recorded no load" not in caplog.text
        runtime.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_zero_load_warn_steps_validated(bad):
    with pytest.raises(ValueError, match="zero_load_warn_steps must be an int >= 0"):
        EplbConfig(zero_load_warn_steps=bad).verify(8, 2)
