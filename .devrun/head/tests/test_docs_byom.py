"""docs/bring-your-own-model.md runs: every Python block marked `<!-- test: NAME -->` is
extracted and executed on CPU (one process; the own-model example also on two gloo
ranks), the self-check it documents fails on a layer that clones its maps, and the
runtime's registration checks the page describes fire on the page's tiny model."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from _hf import require_transformers
import torch
import torch.distributed as dist

from _dist import run_distributed

DOC = Path(__file__).resolve().parents[1] / "docs" / "bring-your-own-model.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- test: ([\w-]+) -->\n\Z")  # right before the fence
OWN_MODEL = ("layer", "model", "run", "self-check")  # one namespace, in this order
TESTED = {"layout", "dispatch-api", *OWN_MODEL, "hf", "hf-expert-parallel"}


def blocks() -> dict[str, tuple[int, str]]:
    """name -> (line of the block's first code line in the doc, code). Raises on a Python
    block without a marker and on a name used twice."""
    text = DOC.read_text()
    found: dict[str, tuple[int, str]] = {}
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start(1))  # 0-based line of the first code line
        mark = MARK.search(text, 0, m.start())
        if mark is None:
            raise AssertionError(f"{DOC.name}:{line + 1}: python block without <!-- test: NAME -->")
        name = mark.group(1)
        if name in found:
            raise AssertionError(f"{DOC.name}:{line + 1}: block name {name!r} used twice")
        found[name] = (line, m.group(1))
    return found


def run_blocks(names, namespace: dict) -> dict:
    """Execute the named blocks in `namespace`, in order; tracebacks point at the doc's lines."""
    found = blocks()
    for name in names:
        line, code = found[name]
        exec(compile("\n" * line + code, str(DOC), "exec"), namespace)
    return namespace


def test_every_python_block_is_marked_and_run():
    assert set(blocks()) == TESTED


def test_layout():
    run_blocks(["layout"], {})


def test_layout_matches_slot_experts():
    require_transformers()  # safetensors comes with it
    from eplb import Placement
    from moe.hf.experts import slot_experts

    for N, R, W in ((4, 2, 2), (8, 0, 4), (4, 6, 2), (6, 2, 4)):
        P, S = N + R, (N + R) // W
        p2l = Placement.initial(3, N, P, W).physical_to_logical
        for r in range(W):
            for layer in range(3):
                assert p2l[layer, r * S:(r + 1) * S].tolist() == slot_experts(N, P, r, S)


def test_dispatch_api():
    run_blocks(["dispatch-api"], {})


# ---- the own-model example ------------------------------------------------------------
def _own_model(group, names=OWN_MODEL, patch=None) -> dict:
    torch.manual_seed(0)
    ns = run_blocks(["layer"], {"group": group})
    if patch is not None:
        patch(ns)
    return run_blocks([n for n in names if n != "layer"], ns)


def test_own_model_one_process():
    ns = _own_model(None)
    runtime, model = ns["runtime"], ns["model"]
    try:
        assert [e.step for e in runtime.events] == [8, 16, 16, 16]  # 2 interval, 2 self-check
        assert [e.trigger for e in runtime.events[2:]] == ["api", "api"]
        assert runtime.placement.policy != "self-check"  # moved back
        assert model.expert_weights[0][0] is model.layers[0].w
        logical, _ = runtime.recorder.local_window()  # [L, N]: the last 8 steps' counts (2b)
        assert logical.sum(1).tolist() == [8 * 32 * 2] * 2
    finally:
        runtime.close()


def _clone_maps(ns):
    """Break contract 2a: the layer keeps copies of the maps."""
    cls = ns["TinyMoELayer"]
    keep = cls.set_eplb_state

    def set_eplb_state(self, i, load, l2p, count):
        keep(self, i, load, l2p.clone(), count.clone())

    cls.set_eplb_state = set_eplb_state


def test_self_check_fails_on_cloned_maps():
    ns = _own_model(None, names=("layer", "model", "run"), patch=_clone_maps)
    try:
        with pytest.raises(AssertionError, match="not close"):
            run_blocks(["self-check"], ns)
    finally:
        ns["runtime"].close()


def _own_model_body(rank, world):
    ns = _own_model(dist.group.WORLD)
    runtime = ns["runtime"]
    try:
        assert runtime.world_size == 2 and ns["model"].num_local_physical_experts == 3
        assert ns["model"].layers[0].w.shape == (3, 16, 16)
        assert [e.step for e in runtime.events] == [8, 16, 16, 16]
    finally:
        runtime.close()


def test_own_model_two_ranks():
    run_distributed(_own_model_body, 2, timeout=120)


# ---- what the contracts section says the runtime catches --------------------------------
def _tiny(**config):
    from eplb import EplbConfig, EplbRuntime

    ns = run_blocks(["layer", "model"], {"group": None})
    model = ns["TinyMoEModel"]()
    return ns, model, lambda: EplbRuntime(model, EplbConfig(num_redundant_experts=2, **config))


def test_no_load_warns_and_skips(caplog):
    """2a/2b: a layer that adds into a copy of the load view."""
    ns, model, runtime_for = _tiny(zero_load_warn_steps=4, rebalance_interval=8, window_size=8)
    for layer in model.layers:
        layer.set_eplb_state = (lambda i, load, l2p, count, layer=layer: type(layer).set_eplb_state(
            layer, i, load.clone(), l2p, count))
    runtime = runtime_for()
    try:
        events = []
        with caplog.at_level(logging.WARNING, logger="eplb.runtime"):
            for _ in range(8):
                model(torch.randn(8, 16))
                events.append(runtime.step())
        assert "the model recorded no load in 4 steps: expert_load_view is still all zero" in caplog.text
        event = events[-1]
        assert event.skipped and event.skip_reason.startswith("no load recorded")
        assert event.slots_changed == 0
    finally:
        runtime.close()


def test_registered_copy_is_refused():
    """2a: a copied expert tensor in model.expert_weights."""
    ns, model, runtime_for = _tiny()
    keep = model.set_eplb_state

    def set_eplb_state(*tensors):
        keep(*tensors)
        model.expert_weights[:] = [[w.clone() for w in ws] for ws in model.expert_weights]

    model.set_eplb_state = set_eplb_state
    with pytest.raises(ValueError, match=r"expert_weights\[0\]\[0\] shares no memory with the "
                                         r"tensors moe_layers\[0\]\.get_expert_weights\(\) returns"):
        runtime_for()


def test_experts_not_on_dim0_are_refused():
    """2c: a tensor with the experts on dim 1."""
    ns, model, runtime_for = _tiny()
    layer = model.layers[1]
    layer.get_expert_weights = lambda: [layer.w.transpose(0, 1)]  # [H, S, H]
    with pytest.raises(ValueError, match=r"expert_weights\[1\]\[0\] has shape \(16, 6, 16\); dim 0 "
                                         r"must be the local slot count num_local_physical_experts=6"):
        runtime_for()


def test_unequal_replicas_are_refused():
    """2c: slot 4 (expert 0's second replica) holds other weights."""
    ns, model, runtime_for = _tiny()
    with torch.no_grad():
        model.layers[0].w[4] += 1e-3
    with pytest.raises(ValueError, match=r"replicas of one expert are not bitwise equal: layer 0, "
                                         r"expert 0: tensor 0 .* slot\(s\) \[4\] .* differs from slot 0"):
        runtime_for()


# ---- Hugging Face --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    require_transformers()
    from moe.hf.configs import tiny_model

    path = tmp_path_factory.mktemp("qwen3_moe")
    tiny_model("qwen3_moe").save_pretrained(path)
    return str(path)


def _hf(path, group, input_ids) -> dict:
    ns = run_blocks(["hf"], {"path": path, "group": group, "input_ids": input_ids})
    ep, runtime = ns["ep"], ns["runtime"]
    try:
        assert ns["tokens"].shape == (input_ids.shape[0], input_ids.shape[1] + 8)
        assert ep.expert_bytes_read > 0 and runtime.steps == 2
        run_blocks(["hf-expert-parallel"], ns)
        assert ns["ep"].num_local_physical_experts == ep.num_local_physical_experts
    finally:
        runtime.close()
    return ns


def test_hf_one_process(tiny_checkpoint):
    ns = _hf(tiny_checkpoint, None, torch.randint(3, 256, (2, 6)))
    assert ns["ep"].num_physical_experts == 10 and ns["ep"].num_local_physical_experts == 10


def _hf_body(rank, world, path):
    """Different batches per rank; generate() with min = max new tokens, then synced_gpus
    with a different max_new_tokens per rank (the EP group is the default group)."""
    gen = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(3, 256, (1 + rank, 5 + 3 * rank), generator=gen)
    ns = _hf(path, dist.group.WORLD, input_ids)
    ep = ns["ep"]
    assert ep.num_local_physical_experts == 5
    out = ep.generate(input_ids, max_new_tokens=3 + 3 * rank, synced_gpus=True)
    assert out.shape[1] <= input_ids.shape[1] + 3 + 3 * rank


@pytest.mark.slow
def test_hf_two_ranks(tiny_checkpoint):
    run_distributed(_hf_body, 2, tiny_checkpoint, timeout=300)
