"""GET /load on a real 2-rank gloo job (rank 0 serves it over HTTP on 127.0.0.1): every
figure equals the test's own record of the load it fed the model (each rank's
`expert_load_view` counts, mapped through the placement in force when they were counted),
and the planner's own window (`recorder.window_load`, computed by all ranks with its
collective); the HTTP thread runs no collective; `eplb plan` reads the saved answer.
Also: 503 before the first metrics update, 404 without export_load, open like the other
GETs. Every loop is bounded."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.ops.cli import main
from eplb.ops.metrics import EplbMetrics
from eplb.core.planning import plan
from eplb.ops.server import EplbServer
from test_metrics import L, N, R, make_runtime
from test_server import Job, request

P = N + R
W = 5  # window_size
INTERVAL = 3  # metrics interval
STEPS = 16  # rebalances (interval 6) at 6 and 12: the placement changes under the test
TOKEN = "load-token-0123456789"


def load_pass(rank: int, step: int) -> np.ndarray:  # [L, P] what rank `rank` counts at `step`
    rng = np.random.default_rng(1000 * step + rank)
    load = rng.integers(0, 30, size=(L, P))
    load[:, :2] += 200 * (step % 4)  # a drifting hot spot: plans differ between rebalances
    return load


def logical_of(load: np.ndarray, p2l: np.ndarray) -> np.ndarray:  # [L, P] -> [L, N]
    out = np.zeros((L, N), dtype=np.int64)
    for layer in range(L):
        np.add.at(out[layer], p2l[layer], load[layer])
    return out


def fetch(url: str) -> dict:
    with urllib.request.urlopen(url + "/load", timeout=10) as r:
        assert r.headers["Content-Type"] == "application/json"
        return json.loads(r.read())


def _body(rank, world, decay, tmp):
    device = device_for(rank)
    rt = make_runtime(dist.group.WORLD, device, rebalance_interval=6, window_size=W,
                      policy="deepseek", load_decay=decay, min_gain=0.0, control_interval=0)
    m = EplbMetrics(rt, interval=INTERVAL)
    S = P // world
    server = EplbServer(rt, m, port=0, token=TOKEN).start() if rank == 0 else None
    collectives_off_main = []
    if rank == 0:  # the HTTP thread must never run a collective: watch every all_reduce
        real = dist.all_reduce

        def watched(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                collectives_off_main.append(threading.current_thread().name)
            return real(*args, **kwargs)

        dist.all_reduce = watched
        status, headers, body = request(server, "GET", "/load")  # nothing measured yet
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body) == {"error": "no load recorded yet: the first snapshot is taken "
                                             "at step 3 (the first metrics update)"}

    # the test's own record: per step, every rank's counts and the placement they were counted on
    logical_steps, gpu_steps = [], []  # [L, N] and [L, M] per step, all ranks together
    last_change = 0  # the step after which the placement in force began
    answers = 0
    try:
        for step in range(1, STEPS + 1):
            p2l = rt.placement.physical_to_logical.copy()  # [L, P], the same on every rank
            loads = [load_pass(r, step) for r in range(world)]
            logical_steps.append(sum(logical_of(x, p2l) for x in loads))
            gpu_steps.append(sum(x.reshape(L, world, S).sum(-1) for x in loads))
            rt.expert_load_pass.copy_(torch.from_numpy(loads[rank]).to(device))
            t_before = time.time()
            event = rt.step()
            t_after = time.time()
            if step % INTERVAL == 0:
                # the planner's own window, through its collective, on every rank
                planner_logical, _ = rt.recorder.window_load(rt.group, decay=decay)
                if rank == 0:
                    d = fetch(server.url)  # over HTTP, from the server's thread
                    answers += 1
                    n = min(step, W)
                    ages = np.arange(n)  # newest first
                    expect = sum(decay ** int(a) * logical_steps[step - 1 - a].astype(np.float64)
                                 for a in ages)  # [L, N]
                    got = np.array(d["logical_count"])
                    if decay == 1:
                        assert got.dtype.kind == "i"  # plain counts stay integers
                        assert (got == expect).all()
                    else:
                        assert got == pytest.approx(expect, rel=1e-12)
                    assert got == pytest.approx(planner_logical.cpu().numpy(), rel=1e-12)
                    g = min(step - last_change, W)  # per-GPU window: since the placement began
                    assert d["gpu_steps"] == g
                    assert d["gpu_load"] == sum(gpu_steps[step - 1 - a] for a in range(g)).tolist()
                    assert d["total_logical_count"] == sum(logical_steps).tolist()
                    assert d["total_steps"] == step and d["step"] == step and d["steps"] == n
                    assert t_before <= d["time"] <= t_after
                    assert (d["layers"], d["experts"], d["gpus"]) == (L, N, world)
                    assert (d["window_size"], d["load_decay"], d["interval"]) == (W, decay, INTERVAL)
                    if step == 9:  # `eplb plan` reads the saved answer as is
                        saved = tmp / f"load_{decay}.json"
                        saved.write_text(json.dumps(d))
                        out = tmp / f"plan_{decay}.json"
                        assert main(["plan", str(saved), "--num-gpus", str(world), "--num-slots",
                                     str(P), "--out", str(out)]) == 0
                        mine = plan(expect, world, P)
                        assert json.loads(out.read_text())["physical_to_logical"] == \
                            mine.physical_to_logical.tolist()
            if event is not None and not event.skipped:
                last_change = step  # the hook ran before this rebalance: later steps are new
        assert [e.step for e in rt.events] == [6, 12]
        assert sum(not e.skipped for e in rt.events) >= 1  # the per-GPU window did restart
        if rank == 0:
            assert answers == STEPS // INTERVAL
            # open like the other GETs (no token); state-changing methods need the token
            assert request(server, "HEAD", "/load")[0] == 200
            assert request(server, "POST", "/load")[0] == 401
            assert request(server, "POST", "/load",
                           headers={"Authorization": f"Bearer {TOKEN}"})[0] == 405
            assert collectives_off_main == []
    finally:
        if server is not None:
            server.stop()


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_load_on_two_ranks_equals_the_recorded_load(tmp_path, decay):
    run_distributed(_body, 2, decay, tmp_path)
    assert (tmp_path / f"plan_{decay}.json").is_file()


def test_load_disabled_is_404_and_listed_in_the_index():
    rt = make_runtime()
    m = EplbMetrics(rt, interval=1, export_load=False)
    assert m.load_snapshot() is None
    with EplbServer(rt, m) as srv:
        rt.expert_load_pass.fill_(1)
        rt.step()
        status, _, body = request(srv, "GET", "/load")
        assert status == 404 and "not enabled" in json.loads(body)["error"]
        assert m.load_snapshot() is None
        status, _, body = request(srv, "GET", "/")
        assert "GET /load" in json.loads(body)["endpoints"]
    with EplbServer(rt, None) as srv:  # no metrics at all
        assert request(srv, "GET", "/load")[0] == 404


def test_load_gzip_for_clients_that_ask(monkeypatch):
    import gzip

    import eplb.ops.server
    from eplb.ops.client import fetch_load

    j = Job()
    try:
        j.wait_steps(4)
        status, headers, plain = request(j.server, "GET", "/load", headers={"Accept-Encoding": "gzip"})
        assert status == 200 and "content-encoding" not in headers  # small: sent as is
        monkeypatch.setattr(eplb.ops.server, "_GZIP_MIN", 0)
        status, headers, body = request(j.server, "GET", "/load", headers={"Accept-Encoding": "gzip"})
        assert status == 200 and headers["content-encoding"] == "gzip"
        d = json.loads(gzip.decompress(body))
        assert d["layers"] == L and len(d["logical_count"]) == L
        status, headers, _ = request(j.server, "GET", "/load")  # did not ask: never gzipped
        assert "content-encoding" not in headers
        assert fetch_load(j.server.url)["layers"] == L  # the client asks and unpacks
    finally:
        j.close()
