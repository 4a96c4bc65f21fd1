"""EplbMetrics: gauges from known per-GPU loads (one process and 2 gloo ranks, rank 0
aggregates), rebalance counters and histograms, failures, opt-in replicas, window fill,
placement age, and the exact exposed names and types."""
from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from _dist import device_for, run_distributed
from eplb.core.config import EplbConfig
from eplb.ops.metrics import EplbMetrics
from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.runtime import EplbRuntime, RebalanceError

L, N, R = 2, 8, 4  # layers, logical experts, redundant slots: P = 12

# name -> (type, label names); `eplb_expert_replicas` only with per_expert_replicas=True,
# `eplb_gpu_layer_load_tokens` only with per_layer_gpu_load=True
EXPECTED = {
    "eplb_balancedness_ratio": ("gauge", {"layer"}),
    "eplb_balancedness_overall_ratio": ("gauge", set()),
    "eplb_gpu_load_tokens": ("gauge", {"gpu"}),
    "eplb_rebalances_total": ("counter", {"trigger", "outcome"}),
    "eplb_rebalance_duration_seconds": ("histogram", {"phase"}),
    "eplb_experts_moved_total": ("counter", set()),
    "eplb_bytes_moved_total": ("counter", set()),
    "eplb_rebalance_balancedness_ratio": ("gauge", {"when"}),
    "eplb_rebalance_layers_ratio": ("gauge", {"basis"}),
    "eplb_rebalance_move_tolerance": ("gauge", set()),
    "eplb_expert_replicas": ("gauge", {"layer", "expert"}),
    "eplb_gpu_layer_load_tokens": ("gauge", {"layer", "gpu"}),
    "eplb_load_window_fill_ratio": ("gauge", set()),
    "eplb_placement_age_seconds": ("gauge", set()),
    "eplb_steps_total": ("counter", set()),
    "eplb_info": ("gauge", {"version", "policy", "num_gpus", "num_nodes", "num_slots", "num_layers"}),
}


def make_runtime(group=None, device="cpu", transport=None, **config) -> EplbRuntime:
    """`transport`: a transport object for the runtime (e.g. `breakable_transport()`)."""
    from moe import MoEArgs, MoEModel

    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=L, num_experts=N, top_k=2,
                   num_redundant_experts=R)
    # min_gain 0: these tests need rebalances that move (on one GPU every plan gains 0)
    cfg = dict(num_redundant_experts=R, window_size=4, rebalance_interval=0, control_interval=0,
               min_gain=0.0)
    cfg.update(config)
    return EplbRuntime(MoEModel(args, group=group, device=device), EplbConfig(**cfg), group=group,
                       transport=transport)


def skewed_pass(scale: int = 1, rank: int = 0) -> torch.Tensor:  # [L, P]
    """Physical counts of one step: slots 4..7 (experts 4..7, one replica each at start)
    are hot, so a plan moves replicas and the placement changes."""
    load = torch.ones(L, N + R, dtype=torch.int64)
    load[:, 4:8] = 20
    load[1] *= 2
    return load * scale * (rank + 1)


def step_with(rt: EplbRuntime, load_pass: torch.Tensor):
    rt.expert_load_pass.copy_(load_pass)
    return rt.step()


def exposed(metrics: EplbMetrics) -> tuple[dict, dict]:
    """(family name as exposed -> type, sample name -> [labels]) from generate_latest."""
    text = generate_latest(metrics.registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    samples: dict[str, list[dict]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s.labels)
    return types, samples


def breakable_transport(rank: int = 0):
    """The point-to-point transport wrapped so that `broken_rebalances` can fail it."""
    from _faults import p2p_transport

    return p2p_transport([], rank)


def breakable_policy(base: str = "default") -> str:
    """The name of a registered policy that plans like `base` until `broken_rebalances`
    arms it (tests/_faults.py PolicySwitch)."""
    from _faults import PolicySwitch

    return PolicySwitch.get(f"faults-{base}", base).name


@contextlib.contextmanager
def broken_rebalances(rt: EplbRuntime):
    """Inside, every rebalance of `rt` fails: its policy (made with `breakable_policy`)
    raises "transfer failed" when rank 0 plans, and every exchange of its transport (made
    with `breakable_transport`) raises "transfer failed" (a lost peer, an OOM while
    staging, ...). Injected through the objects the runtime was given; nothing patched."""
    from _faults import Fault, FaultyTransport, PolicySwitch

    assert isinstance(rt.transport, FaultyTransport), "make the runtime with breakable_transport()"
    switch = PolicySwitch._made[rt.config.policy]  # KeyError: not a breakable_policy
    fault = Fault("exchange", None, "raise", message="transfer failed")
    switch.arm(RuntimeError("transfer failed"))
    rt.transport.faults.append(fault)
    try:
        yield
    finally:
        switch.disarm()
        rt.transport.faults.remove(fault)


def test_names_types_and_labels_exactly():
    rt = make_runtime()
    m = EplbMetrics(rt, interval=1, per_expert_replicas=True, per_layer_gpu_load=True)
    step_with(rt, skewed_pass())
    rt.rebalance()
    step_with(rt, skewed_pass())
    types, samples = exposed(m)
    for name, (kind, labels) in EXPECTED.items():
        assert types.get(name) == kind, (name, types.get(name))
        sample = name + "_count" if kind == "histogram" else name
        assert sample in samples, name
        assert all(set(lbl) - {"le"} == labels for lbl in samples[sample]), (name, samples[sample][:2])
    assert {lbl["trigger"] for lbl in samples["eplb_rebalances_total"]} >= {"interval", "request", "api", "initial"}
    assert {lbl["outcome"] for lbl in samples["eplb_rebalances_total"]} == {"success", "failure", "skipped"}
    assert {lbl["phase"] for lbl in samples["eplb_rebalance_duration_seconds_count"]} == {
        "plan", "transfer", "commit", "total"}
    assert {lbl["when"] for lbl in samples["eplb_rebalance_balancedness_ratio"]} == {"before", "after"}
    info = samples["eplb_info"][0]
    assert info == {"version": "0.1.0", "policy": "default", "num_gpus": "1", "num_nodes": "1",
                    "num_slots": "12", "num_layers": "2"}
    assert not EplbMetrics(make_runtime()).value("eplb_expert_replicas", layer="0", expert="0")
    assert len(samples["eplb_gpu_layer_load_tokens"]) == L * 1  # L x M series, M = 1 here
    # off by default: absent from the exposition (not 0), even after load was measured
    rt2 = make_runtime()
    m2 = EplbMetrics(rt2, interval=1)
    step_with(rt2, skewed_pass())
    types2, samples2 = exposed(m2)
    assert "eplb_gpu_layer_load_tokens" not in types2 and "eplb_gpu_layer_load_tokens" not in samples2
    assert m2.value("eplb_gpu_load_tokens", gpu="0") is not None
    with pytest.raises(ValueError, match="interval"):
        EplbMetrics(rt, interval=0)


def test_single_process_gauges_counters_and_failures():
    rt = make_runtime(control_interval=2, transport=breakable_transport(), policy=breakable_policy())
    m = EplbMetrics(rt, interval=3)
    v = m.value
    assert v("eplb_steps_total") == 0 and v("eplb_load_window_fill_ratio") == 0
    assert v("eplb_balancedness_overall_ratio") is None  # nothing measured yet
    assert v("eplb_rebalances_total", trigger="interval", outcome="success") == 0
    for k in range(1, 3):
        step_with(rt, skewed_pass(k))
    assert v("eplb_gpu_load_tokens", gpu="0") is None  # updated every 3 steps only
    step_with(rt, skewed_pass(3))
    per_step = int(skewed_pass().sum())  # all layers, the only GPU
    assert v("eplb_gpu_load_tokens", gpu="0") == pytest.approx(per_step * (1 + 2 + 3) / 3)
    assert v("eplb_balancedness_ratio", layer="1") == 1.0  # one GPU is always balanced
    assert v("eplb_balancedness_overall_ratio") == 1.0
    assert v("eplb_steps_total") == 3 and v("eplb_load_window_fill_ratio") == 0.75
    step_with(rt, skewed_pass(1))
    assert v("eplb_load_window_fill_ratio") == 1.0

    event = rt.rebalance()  # api, at step 4: the accumulator restarts with the new placement
    assert event.slots_changed > 0
    assert v("eplb_rebalances_total", trigger="api", outcome="success") == 1
    assert v("eplb_experts_moved_total") == event.experts_moved
    assert v("eplb_bytes_moved_total") == event.bytes_moved
    for phase, seconds in (("plan", event.seconds_plan), ("transfer", event.seconds_transfer),
                           ("commit", event.seconds_commit), ("total", event.seconds)):
        assert v("eplb_rebalance_duration_seconds_count", phase=phase) == 1
        assert v("eplb_rebalance_duration_seconds_sum", phase=phase) == pytest.approx(seconds)
    assert v("eplb_rebalance_balancedness_ratio", when="before") == pytest.approx(
        event.balancedness_before.mean())
    assert v("eplb_rebalance_balancedness_ratio", when="after") == pytest.approx(
        event.balancedness_after.mean())
    step_with(rt, skewed_pass(1))
    step_with(rt, skewed_pass(7))  # step 6: the update covers steps 5 and 6 only
    assert v("eplb_gpu_load_tokens", gpu="0") == pytest.approx(per_step * (1 + 7) / 2)

    # failures: an exception out of rebalance() counts once, under its trigger
    with broken_rebalances(rt):
        with pytest.raises(RebalanceError, match="transfer failed"):
            rt.rebalance()
        assert v("eplb_rebalances_total", trigger="api", outcome="failure") == 1
        assert v("eplb_rebalances_total", trigger="api", outcome="success") == 1
        rid = rt.request_rebalance("http")  # served (and failing) inside step() at step 8
        step_with(rt, skewed_pass())
        with pytest.raises(RebalanceError, match="transfer failed"):
            step_with(rt, skewed_pass())
        assert rt.rebalance_status(rid)["state"] == "failed"
        assert v("eplb_rebalances_total", trigger="request", outcome="failure") == 1
        with pytest.raises(RebalanceError):
            rt.apply_placement(Placement.initial(L, N, N + R, 1), trigger="api")
        assert v("eplb_rebalances_total", trigger="api", outcome="failure") == 2
    rid = rt.request_rebalance("http")
    step_with(rt, skewed_pass())
    event = step_with(rt, skewed_pass())
    assert event is not None
    assert rt.rebalance_status(rid)["state"] == "done"
    # the load has not changed since the api rebalance: its plan may equal the placement in
    # force, which is a skipped rebalance (nothing to gain) even with min_gain 0
    outcome = "skipped" if event.skipped else "success"
    other = "success" if event.skipped else "skipped"
    assert v("eplb_rebalances_total", trigger="request", outcome=outcome) == 1
    assert v("eplb_rebalances_total", trigger="request", outcome=other) == 0
    assert v("eplb_rebalances_total", trigger="request", outcome="failure") == 1
    assert v("eplb_experts_moved_total") == sum(e.experts_moved for e in rt.events)
    assert v("eplb_steps_total") == rt.steps == 10


def test_listener_failure_after_success_is_not_a_failure():
    rt = make_runtime()
    m = EplbMetrics(rt)

    def broken(event):
        raise KeyError("a later listener fails")

    rt.add_listener(broken)
    step_with(rt, skewed_pass())
    with pytest.raises(KeyError):
        rt.rebalance()
    assert m.value("eplb_rebalances_total", trigger="api", outcome="success") == 1
    assert m.value("eplb_rebalances_total", trigger="api", outcome="failure") == 0


def test_opt_in_replicas_follow_the_placement():
    rt = make_runtime()
    m = EplbMetrics(rt, per_expert_replicas=True)
    _, samples = exposed(m)
    assert len(samples["eplb_expert_replicas"]) == L * N

    def replicas():
        return np.array([[m.value("eplb_expert_replicas", layer=str(layer), expert=str(e))
                          for e in range(N)] for layer in range(L)])

    assert (replicas() == rt.placement.replica_count()).all()
    step_with(rt, skewed_pass())
    rt.rebalance()
    assert (replicas() == rt.placement.replica_count()).all()
    assert replicas()[:, 4:8].min() > 1  # the hot experts got the replicas


def test_placement_age_and_initial_rebalances(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "p.json"
    Placement(np.stack([rng.permutation(np.arange(N + R) % N) for _ in range(L)]), N, 1).save(path)
    rt = make_runtime(initial_placement=str(path))  # an "initial" rebalance before attaching
    m = EplbMetrics(rt)
    assert m.value("eplb_rebalances_total", trigger="initial", outcome="success") == 1
    time.sleep(0.05)
    age = m.value("eplb_placement_age_seconds")
    assert age >= 0.05
    step_with(rt, skewed_pass())
    event = rt.rebalance()
    assert event.slots_changed > 0
    assert m.value("eplb_placement_age_seconds") < age
    time.sleep(0.02)
    step_with(rt, skewed_pass())
    before = m.value("eplb_placement_age_seconds")
    if rt.rebalance().slots_changed == 0:  # nothing changed: the age keeps growing
        assert m.value("eplb_placement_age_seconds") >= before


# ---- 2 gloo ranks: rank 0 aggregates -------------------------------------------------
def _two_rank_body(rank, world):
    device = device_for(rank)
    # deepseek replans from scratch, so this load surely moves experts (the move-aware
    # default could rightly keep the placement: experts 0-3 already have a replica per GPU)
    rt = make_runtime(dist.group.WORLD, device, rebalance_interval=4, window_size=4,
                      policy=breakable_policy("deepseek"), transport=breakable_transport(rank))
    m = EplbMetrics(rt, interval=4, per_layer_gpu_load=True)
    S = (N + R) // world

    def gpu0_hot(scale, r):  # [L, P]: slots 0..3 (all on GPU 0) hot, rank r counts (r+1)x
        load = torch.ones(L, N + R, dtype=torch.int64)
        load[:, :4] = 20
        load[1] *= 2
        return load * scale * (r + 1)

    def expected(scales):  # [L, M] all ranks, summed over the given steps
        total = sum(gpu0_hot(k, r).numpy() for k in scales for r in range(world))  # [L, P]
        return total.reshape(L, world, S).sum(-1)

    for k in range(1, 5):
        step_with(rt, gpu0_hot(k, rank).to(device))
    assert len(rt.events) == 1  # step 4: load update first, then the scheduled rebalance
    if rank == 0:
        gpu = expected(range(1, 5))  # [L, M]
        bal = balancedness_of_gpu_loads(gpu)  # [L]
        assert bal.min() < 0.9  # the hot experts all start on GPU 0
        for layer in range(L):
            assert m.value("eplb_balancedness_ratio", layer=str(layer)) == pytest.approx(bal[layer])
        assert m.value("eplb_balancedness_overall_ratio") == pytest.approx(bal.mean())
        for g in range(world):
            assert m.value("eplb_gpu_load_tokens", gpu=str(g)) == pytest.approx(gpu[:, g].sum() / 4)
            for layer in range(L):  # the opt-in per-layer series: [L, M] per step
                assert m.value("eplb_gpu_layer_load_tokens", layer=str(layer), gpu=str(g)) == \
                    pytest.approx(gpu[layer, g] / 4)
        assert len(exposed(m)[1]["eplb_gpu_layer_load_tokens"]) == L * world
    else:  # only rank 0 holds the aggregated view
        assert m.value("eplb_balancedness_overall_ratio") is None
        assert m.value("eplb_gpu_load_tokens", gpu="0") is None
        assert m.value("eplb_gpu_layer_load_tokens", layer="0", gpu="0") is None
    # events are the same on every rank, so are the counters
    assert m.value("eplb_rebalances_total", trigger="interval", outcome="success") == 1
    assert m.value("eplb_experts_moved_total") == rt.events[0].experts_moved > 0
    for k in (5, 6, 7, 8):
        step_with(rt, gpu0_hot(k, rank).to(device))
    if rank == 0:
        gpu = expected((5, 6, 7, 8))
        assert m.value("eplb_balancedness_overall_ratio") == pytest.approx(
            balancedness_of_gpu_loads(gpu).mean())
        assert m.value("eplb_gpu_load_tokens", gpu="1") == pytest.approx(gpu[:, 1].sum() / 4)
        per_layer = np.array([[m.value("eplb_gpu_layer_load_tokens", layer=str(layer), gpu=str(g))
                               for g in range(world)] for layer in range(L)])
        assert per_layer == pytest.approx(gpu / 4)
        assert per_layer.sum(0) == pytest.approx([m.value("eplb_gpu_load_tokens", gpu=str(g))
                                                  for g in range(world)])
    with broken_rebalances(rt), pytest.raises(
            RebalanceError, match="transfer failed|planning failed on rank 0"):
        rt.rebalance()
    assert m.value("eplb_rebalances_total", trigger="api", outcome="failure") == 1
    assert m.value("eplb_rebalances_total", trigger="interval", outcome="success") == 2
    assert m.value("eplb_steps_total") == 8
    assert m.value("eplb_info", version="0.1.0", policy="faults-deepseek", num_gpus="2", num_nodes="1",
                   num_slots="12", num_layers="2") == 1


def test_two_ranks_rank0_aggregates():
    run_distributed(_two_rank_body, 2)


# ---- skipped rebalances ----------------------------------------------------------------
def _skipped_event(rt, **kw):
    from eplb.runtime import RebalanceEvent

    d = dict(step=rt.steps, trigger="interval", balancedness_before=np.array([0.8, 0.9]),
             balancedness_after=np.array([0.81, 0.905]), experts_moved=0, local_copies=0,
             slots_changed=0, bytes_moved=0, seconds_plan=0.25, seconds_transfer=0.5,
             seconds_commit=0.125, placement=rt.placement)
    d.update(kw)
    event = RebalanceEvent(**d)
    event.skipped = True  # set after construction: works whether or not the field exists yet
    return event


def test_skipped_event_counts_as_skipped_with_plan_duration_only():
    rt = make_runtime()
    m = EplbMetrics(rt, interval=3)
    v = m.value
    step_with(rt, skewed_pass())
    age = v("eplb_placement_age_seconds")
    m._on_event(_skipped_event(rt))  # what runtime listeners receive
    assert v("eplb_rebalances_total", trigger="interval", outcome="skipped") == 1
    assert v("eplb_rebalances_total", trigger="interval", outcome="success") == 0
    assert v("eplb_rebalance_duration_seconds_count", phase="plan") == 1
    assert v("eplb_rebalance_duration_seconds_sum", phase="plan") == 0.25
    for phase in ("transfer", "commit", "total"):
        assert v("eplb_rebalance_duration_seconds_count", phase=phase) == 0, phase
    assert v("eplb_rebalance_balancedness_ratio", when="before") == pytest.approx(0.85)
    assert v("eplb_rebalance_balancedness_ratio", when="after") == pytest.approx(0.8575)
    assert v("eplb_experts_moved_total") == 0 and v("eplb_bytes_moved_total") == 0
    assert v("eplb_placement_age_seconds") >= age  # the placement did not change
    # nothing moved: the load accumulated so far still describes the placement in force
    step_with(rt, skewed_pass(2))
    step_with(rt, skewed_pass(3))  # step 3: the update covers steps 1..3
    assert v("eplb_gpu_load_tokens", gpu="0") == pytest.approx(int(skewed_pass().sum()) * 6 / 3)
    # an event without the field (older runtimes) is a success
    from types import SimpleNamespace

    plain = SimpleNamespace(**{k: getattr(_skipped_event(rt), k) for k in (
        "step", "trigger", "balancedness_before", "balancedness_after", "experts_moved",
        "bytes_moved", "seconds_plan", "seconds_transfer", "seconds_commit", "seconds",
        "slots_changed", "placement")})
    m._on_event(plain)
    assert v("eplb_rebalances_total", trigger="interval", outcome="success") == 1
    assert v("eplb_rebalance_duration_seconds_count", phase="transfer") == 1


def test_real_skipped_rebalance_is_counted_as_skipped():
    """On one GPU every plan gains nothing: with the default min_gain the runtime skips it."""
    from eplb.core.config import EplbConfig

    rt = make_runtime(min_gain=EplbConfig.min_gain)
    m = EplbMetrics(rt, interval=1)
    step_with(rt, skewed_pass())
    event = rt.rebalance()
    assert getattr(event, "skipped", None) is True, event
    v = m.value
    assert v("eplb_rebalances_total", trigger="api", outcome="skipped") == 1
    assert v("eplb_rebalances_total", trigger="api", outcome="success") == 0
    assert v("eplb_rebalance_duration_seconds_sum", phase="plan") == pytest.approx(event.seconds_plan)
    assert v("eplb_rebalance_duration_seconds_count", phase="total") == 0
    assert v("eplb_rebalance_balancedness_ratio", when="before") == pytest.approx(
        event.balancedness_before.mean())
    assert v("eplb_rebalance_balancedness_ratio", when="after") == pytest.approx(
        event.balancedness_after.mean())


def _runtime_triggers() -> set[str]:
    """Every trigger name the runtime can give a rebalance, read from its source: string
    literals passed to `_start(...)` or as `trigger=...`, and `trigger` parameters' defaults."""
    import ast
    import pathlib

    found = set()
    for path in (pathlib.Path(__file__).resolve().parents[1] / "eplb" / "runtime").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                args = node.args[:1] if func == "_start" else []
                args += [k.value for k in node.keywords if k.arg == "trigger"]
                found.update(a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pos = a.posonlyargs + a.args
                named = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
                found.update(d.value for arg, d in named
                             if arg.arg == "trigger" and isinstance(d, ast.Constant) and isinstance(d.value, str))
    return found


def test_every_runtime_trigger_has_a_zero_initialised_series():
    """eplb_rebalances_total starts every (trigger, outcome) at 0 so rate() works from the first
    scrape: each trigger the runtime can give an event (resize's included) must be in TRIGGERS."""
    from eplb.ops.metrics import TRIGGERS

    found = _runtime_triggers()
    assert {"interval", "request", "api", "initial", "shift", "resize"} <= found, found  # the reader sees them
    assert found <= set(TRIGGERS), f"triggers without a zero-initialised series: {sorted(found - set(TRIGGERS))}"
