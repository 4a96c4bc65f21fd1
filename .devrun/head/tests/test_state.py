"""`moe.state`: one copy of the EPLB bookkeeping for both model families (issue 31).
The reference `MoEModel` and `moe.hf`'s `ExpertParallelModel` must refuse the same
mistakes with the same words (the hf copy once lost the cdf, P / S type and non-member
checks), and keep working through a resize the same way."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from moe import MoEArgs, MoEModel
from moe.state import EplbLayerState, EplbModelState

FAMILIES = ["reference", "hf"]


def _model(family: str, group=None):
    """(model, N, P) with N = 8 experts, P = 10 slots over `group`'s ranks."""
    if family == "reference":
        args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=2, num_experts=8,
                       top_k=2, num_redundant_experts=2)
        return MoEModel(args, group)
    from _hf import require_transformers
    require_transformers()
    from moe.hf import expert_parallel
    from moe.hf.configs import tiny_model
    model = tiny_model("qwen3_moe", seed=0, num_experts=8, top_k=2, hidden_size=32,
                       intermediate_size=16, num_layers=2)
    return expert_parallel(model, 2, group)


def test_both_families_take_the_state_from_moe_state_with_no_copy_of_their_own():
    from moe.hf.experts import ExpertParallelExperts
    from moe.hf.model import ExpertParallelModel
    from moe.layer import MoELayer

    shared = [n for n in vars(EplbModelState) if not n.startswith("__")]
    for cls in (MoEModel, ExpertParallelModel):
        assert issubclass(cls, EplbModelState)
        assert not set(shared) & set(vars(cls)), set(shared) & set(vars(cls))
    shared = [n for n in vars(EplbLayerState) if not n.startswith("__")
              and n not in ("get_expert_weights", "replace_slots")]
    for cls in (MoELayer, ExpertParallelExperts):
        assert issubclass(cls, EplbLayerState)
        assert not set(shared) & set(vars(cls)), set(shared) & set(vars(cls))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_mistakes_are_refused_with_the_same_words(family):
    model = _model(family)
    L, N, R = model.num_moe_layers, model.num_logical_experts, model.logical_to_physical_map.shape[-1]
    with pytest.raises(ValueError, match=r"logical_replica_cdf: first dim 3 != num_moe_layers \(2\)"):
        model.set_eplb_replica_weights(torch.ones(3, N, R))
    with pytest.raises(ValueError, match=r"logical_replica_cdf: shape \(2, 8, 9\)"):
        model.set_eplb_replica_weights(torch.ones(L, N, 9))
    with pytest.raises(ValueError, match="logical_replica_cdf: needs a floating dtype"):
        model.set_eplb_replica_weights(torch.ones(L, N, R, dtype=torch.int64))
    for bad in (True, 10.0, 0, "10"):
        with pytest.raises(ValueError, match=r"num_physical_experts: must be an int >= 1"):
            model.update_physical_experts_metadata(bad, 5)
        with pytest.raises(ValueError, match=r"num_local_physical_experts: must be an int >= 1"):
            model.update_physical_experts_metadata(10, bad)
    with pytest.raises(ValueError, match=r"must be a multiple of num_local_physical_experts"):
        model.update_physical_experts_metadata(10, 4)
    with pytest.raises(ValueError, match=r"expert_load_view: first dim 3 != num_moe_layers"):
        model.set_eplb_state(torch.zeros(3, 10, dtype=torch.int64),
                             model.logical_to_physical_map, model.logical_replica_count)
    with pytest.raises(ValueError, match=r"mode: 'fast' is not 'exact' or 'fixed'"):
        model.set_dispatch_mode("fast")
    with pytest.raises(ValueError, match=r"group: 1 ranks x 10 local slots != num_physical"):
        model.update_physical_experts_metadata(20, 10)
        model.set_expert_parallel_group(None)


@pytest.mark.parametrize("family", FAMILIES)
def test_resize_release_and_back(family):
    """The shared resize steps on one process: more slots (fresh zero tensors, routing
    dropped until set_eplb_state), release (empty slots, forward refused), back."""
    from moe import eplb_state_for
    from eplb.core.placement import Placement

    model = _model(family)
    before = [t.data_ptr() for t in model.expert_weights[0]]
    model.update_physical_experts_metadata(12, 12)
    assert model.num_redundant_experts == 4 and model.num_local_physical_experts == 12
    assert all(t.shape[0] == 12 and t.abs().sum() == 0 for t in model.expert_weights[0])
    assert [t.data_ptr() for t in model.expert_weights[0]] != before
    assert all(layer.logical_to_physical_map is None for layer in model.moe_layers)
    model.set_expert_parallel_group(None)
    model.set_eplb_state(*eplb_state_for(Placement.initial(2, 8, 12, 1)))
    assert all(layer.num_physical_experts == 12 for layer in model.moe_layers)
    model.release_expert_slots()
    assert model.num_local_physical_experts == 0
    assert all(t.shape[0] == 0 for ws in model.expert_weights for t in ws)
    with pytest.raises(RuntimeError, match="set_eplb_state was never called"):
        model.moe_layers[0].begin_forward(1, torch.device("cpu"))


def _non_member(rank, world, family):
    model = _model(family, dist.new_group([0, 1]))  # P = 10 over 2 ranks
    solo = dist.new_group([0])  # rank 1 is not a member
    if rank == 1:
        with pytest.raises(ValueError, match="group: this process is not a member of it"):
            model.set_expert_parallel_group(solo)
        assert model.group is not solo


@pytest.mark.parametrize("family", FAMILIES)
def test_a_group_this_rank_is_not_in_is_refused(family):
    if family == "hf":
        from _hf import require_transformers
        require_transformers()
    run_distributed(_non_member, 2, family)
