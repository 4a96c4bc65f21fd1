"""The calling conventions of issue 28 ("Conventions"), for the HF wrapper (`moe.hf`) and
the reference model (`moe.MoEModel`):

* `group=None` is torch's default group when torch.distributed is initialised;
* R is given once: the runtime takes `num_redundant_experts` from the model;
* a job that never calls `runtime.step()` is warned once;
* ranks that run different numbers of forwards get one clear error;
* the unwrapped transformers model handed to the runtime is refused with the fix.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from _hf import require_transformers
from eplb import EplbConfig, EplbRuntime

SIZES = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, num_layers=2)


def _moe_args(**kw):
    from moe import MoEArgs

    base = dict(hidden_size=16, intermediate_size=16, num_layers=2, num_experts=8, top_k=2,
                num_redundant_experts=2, seed=0)
    base.update(kw)
    return MoEArgs(**base)


# ---- 1. group=None is the default group when dist is initialised ----------------------

def _none_is_world(rank: int, world: int) -> None:
    from moe import MoEModel
    from moe.hf import expert_parallel
    from moe.hf.configs import tiny_model

    ep = expert_parallel(tiny_model("qwen3_moe", seed=0, **SIZES), 2)  # no group
    assert (ep.ep_size, ep.ep_rank, ep.num_local_physical_experts) == (world, rank, 10 // world)
    ref = MoEModel(_moe_args())  # no group
    assert (ref.ep_size, ref.ep_rank, ref.num_local_physical_experts) == (world, rank, 10 // world)
    for model in (ep, ref):
        runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=2, rebalance_interval=0))
        try:
            x = (torch.randint(3, 200, (1, 6)) if model is ep
                 else torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)))
            with torch.no_grad():
                model(x)
            runtime.step()
            assert runtime.rebalance() is not None
        finally:
            runtime.close()


def test_group_none_is_the_default_group():
    require_transformers()
    run_distributed(_none_is_world, 2, timeout=120)


def test_group_none_without_dist_is_one_process():
    from moe import MoEModel

    assert not dist.is_initialized()
    model = MoEModel(_moe_args())
    assert (model.group, model.ep_size, model.num_local_physical_experts) == (None, 1, 10)


# ---- 2. R is given once: the runtime takes it from the model ---------------------------

def _models_with_two_redundant():
    """(name, model) with N = 8, P = 10, one process: the reference model and, where
    transformers is installed, the HF wrapper."""
    from moe import MoEModel

    models = [("MoEModel", MoEModel(_moe_args()))]
    try:
        from moe.hf import expert_parallel
        from moe.hf.configs import tiny_model
    except ImportError:  # pragma: no cover - transformers missing
        return models
    models.append(("ExpertParallelModel", expert_parallel(tiny_model("qwen3_moe", **SIZES), 2)))
    return models


def test_runtime_takes_redundant_experts_from_the_model(caplog):
    import logging

    for name, model in _models_with_two_redundant():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eplb.core.config"):
            runtime = EplbRuntime(model, EplbConfig(rebalance_interval=10))
        try:
            assert runtime.config.num_redundant_experts == 2, name
            assert "num_redundant_experts not set: using 2" in caplog.text, name
        finally:
            runtime.close()
        # a value set is still checked against the model, with the fix in the message
        with pytest.raises(ValueError, match="num_physical_experts=10; set num_redundant_experts=2"):
            EplbRuntime(model, EplbConfig(num_redundant_experts=4))
        EplbRuntime(model, EplbConfig(num_redundant_experts=2)).close()


def test_config_without_model_defaults_to_no_redundant_experts():
    assert EplbConfig().num_redundant_experts is None
    assert EplbConfig().verify(8, 2).num_redundant_experts == 0
    assert EplbConfig().verify(8, 2, num_physical_experts=12).num_redundant_experts == 4


# ---- 5. the unwrapped transformers model is refused with the fix -----------------------

def test_unwrapped_hf_model_is_refused_with_the_fix():
    require_transformers()
    from moe.hf.configs import tiny_model

    with pytest.raises(TypeError, match=r"Qwen3MoeForCausalLM is a transformers model: pass what "
                                        r"`moe\.hf\.expert_parallel\(model, R\)` returns"):
        EplbRuntime(tiny_model("qwen3_moe", **SIZES), EplbConfig())
    # anything else keeps the generic message
    with pytest.raises(TypeError, match="does not implement MixtureOfExperts"):
        EplbRuntime(torch.nn.Linear(2, 2), EplbConfig())


# ---- 3. a job that never calls runtime.step() is warned once ---------------------------

def _forward(model, x, n: int, runtime=None) -> None:
    with torch.no_grad():
        for _ in range(n):
            model(x)
            if runtime is not None:
                runtime.step()


def _inputs(name: str, rank: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    if name == "MoEModel":
        return torch.randn(4, 16, generator=gen)
    return torch.randint(3, 200, (1, 4), generator=gen)


def test_forwards_without_step_warn_once(caplog):
    import logging

    from eplb.protocol import ForwardCounter

    N = ForwardCounter.WARN_AFTER
    for name, model in _models_with_two_redundant():
        runtime = EplbRuntime(model, EplbConfig(rebalance_interval=0))
        x = _inputs(name)
        try:
            with caplog.at_level(logging.WARNING, logger="eplb.runtime"):
                caplog.clear()
                model.set_record_load(False)
                _forward(model, x, N + 5)  # not recording load (warm-up): no warning
                model.set_record_load(True)
                _forward(model, x, N - 1)
                assert "runtime.step()" not in caplog.text, name
                _forward(model, x, 1)  # the N-th forward recording load, never stepped
                warned = [r for r in caplog.records if "runtime.step()" in r.getMessage()]
                assert len(warned) == 1, (name, caplog.text)
                assert "call runtime.step() after each forward" in warned[0].getMessage()
                _forward(model, x, N + 5)  # only once
                assert len([r for r in caplog.records if "runtime.step()" in r.getMessage()]) == 1
            runtime.close()
            runtime = EplbRuntime(model, EplbConfig(rebalance_interval=0))
            with caplog.at_level(logging.WARNING, logger="eplb.runtime"):
                caplog.clear()
                _forward(model, x, 3, runtime)  # stepped after each forward: no warning
                for _ in range(2):  # stepped once per generate()-like burst: no warning
                    _forward(model, x, N + 5)
                    runtime.step()
                assert "runtime.step()" not in caplog.text, (name, caplog.text)
        finally:
            runtime.close()


# ---- 4. ranks that run different numbers of forwards get one clear error ---------------

def _extra_forward(rank: int, world: int) -> None:
    from datetime import timedelta

    from moe import MoEModel
    from moe.hf import expert_parallel
    from moe.hf.configs import tiny_model

    builders = [("MoE layer 0", lambda g: MoEModel(_moe_args(), group=g)),
                ("model.layers.0.mlp.experts",
                 lambda g: expert_parallel(tiny_model("qwen3_moe", **SIZES), 2, g))]
    for layer_name, build in builders:
        # the matched forwards on a group with the default timeout (a loaded machine may
        # keep one rank seconds behind), the extra one on a group with a short timeout, so
        # that its all-to-all fails within seconds
        group = dist.new_group(backend="gloo")
        short = dist.new_group(backend="gloo", timeout=timedelta(seconds=4))
        model = build(group)
        x = _inputs("MoEModel" if layer_name == "MoE layer 0" else "hf", rank)
        _forward(model, x, 2)
        model.set_expert_parallel_group(short)
        if rank == 0:  # one forward more than rank 1
            with pytest.raises(RuntimeError) as info:
                _forward(model, x, 1)
            msg = str(info.value)
            assert msg.startswith(f"{layer_name}: the expert all-to-all failed in forward 3 "
                                  "of this layer on rank 0"), msg
            assert "every rank of the EP group must run the same number of forwards" in msg, msg
            assert info.value.__cause__ is not None
        dist.barrier()  # the world group: rank 1 waits here for rank 0's error


def test_extra_forward_on_one_rank_is_one_clear_error():
    require_transformers()
    run_distributed(_extra_forward, 2, timeout=90)


def _forward_counts_differ(rank: int, world: int) -> None:
    """Rank 1 runs its second forward through another model on the same group: the
    collectives pair up, but the runtime's model ran one forward fewer on rank 1."""
    from moe import MoEModel

    model, other = MoEModel(_moe_args()), MoEModel(_moe_args())
    runtime = EplbRuntime(model, EplbConfig(rebalance_interval=0, control_interval=2))
    x = _inputs("MoEModel", rank)
    try:
        _forward(model, x, 1, runtime)
        _forward(model if rank == 0 else other, x, 1)
        with pytest.raises(RuntimeError, match=(
                "EP ranks ran different numbers of forwards by step 2: this rank "
                f"{2 - rank}, the ranks between 1 and 2; every rank of the EP group must run "
                "the same number of forwards")):
            runtime.step()
    finally:
        runtime.close()


def test_runtime_compares_forward_counts_at_the_control_check():
    run_distributed(_forward_counts_differ, 2, timeout=90)
