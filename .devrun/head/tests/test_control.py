"""Rebalance requests from other threads: thread-safe, served at the same step on all ranks."""
import threading

import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.runtime.control import RebalanceRequests
from eplb.runtime import EplbRuntime


def _model(group=None, device="cpu"):
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8, top_k=2,
                   num_redundant_experts=4)
    return args, MoEModel(args, group=group, device=device)


def test_requests_are_thread_safe_and_tracked():
    reqs = RebalanceRequests()
    ids = []
    threads = [threading.Thread(target=lambda: ids.extend(reqs.request("http") for _ in range(50)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids) == list(range(1, 201))
    assert reqs.has_pending()
    running = reqs.start(step=7)
    assert sorted(running) == sorted(ids) and not reqs.has_pending()
    reqs.finish(running[:1], error="boom")
    reqs.finish(running[1:], result={"experts_moved": 3})
    assert reqs.status(running[0])["state"] == "failed" and reqs.status(running[0])["error"] == "boom"
    assert reqs.status(running[1]) | {"requested_at": 0, "finished_at": 0} == {
        "id": running[1], "trigger": "http", "state": "done", "requested_at": 0, "finished_at": 0,
        "step": 7, "result": {"experts_moved": 3}, "error": None}
    assert reqs.status(10_000) is None


def test_request_served_at_next_control_check_single_process():
    from moe import sample_tokens

    args, model = _model()
    rt = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0, control_interval=3))
    rid = rt.request_rebalance("test")
    assert rt.rebalance_status(rid)["state"] == "pending"
    events = []
    for step in range(4):
        model(sample_tokens(args, 16, seed=step))
        events.append(rt.step())
    assert [e is not None for e in events] == [False, False, True, False]
    status = rt.rebalance_status(rid)
    assert status["state"] == "done" and status["step"] == 3
    assert status["result"]["trigger"] == "request" and "experts_moved" in status["result"]


def _request_body(rank, world):
    from moe import sample_tokens

    args, model = _model(dist.group.WORLD, device_for(rank))
    rt = EplbRuntime(model, EplbConfig(num_redundant_experts=4, rebalance_interval=0, control_interval=2))
    rid = None
    if rank == 0:  # only rank 0 is asked, from another thread (as the HTTP server would)
        t = threading.Thread(target=lambda: setattr(rt, "_rid", rt.request_rebalance("http")))
        t.start()
        t.join()
        rid = rt._rid
    served = []
    for step in range(6):
        model(sample_tokens(args, 16, seed=10 * step + rank, device=device_for(rank)))
        if rt.step() is not None:
            served.append(rt.steps)
    assert served == [2], served  # every rank rebalanced at the same first control check
    if rank == 0:
        assert rt.rebalance_status(rid)["state"] == "done"


def test_request_on_one_rank_rebalances_all_ranks():
    run_distributed(_request_body, 2)
