"""Checks of what a model registers with the runtime, with errors every rank raises alike.

`check_model` refuses what is not a `MixtureOfExperts` (with the fix for an unwrapped
transformers model); `model_device` is where its experts live.

`expert_weights_problem` looks at this rank's tensors (one list per MoE layer, each
`[S, ...]`, sharing memory with what the layer itself reads); `check_registration` makes
every rank reach the same verdict (one small all_gather) and, when experts have
replicas, checks that the replicas of each expert are bitwise equal in the start-up
layout (slot p holds expert p mod N).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.placement import Placement
from eplb.protocol import is_unwrapped_hf_model, missing_members
from eplb.runtime.verify import slot_checksums

__all__ = ["check_model", "check_registration", "check_slots", "expert_weights_problem",
           "model_device"]


def check_model(model) -> None:
    """TypeError unless `model` implements MixtureOfExperts; ValueError without MoE layers."""
    missing = missing_members(model)
    if missing and is_unwrapped_hf_model(model):
        raise TypeError(f"{type(model).__name__} is a transformers model: pass what "
                        "`moe.hf.expert_parallel(model, R)` returns (the expert-parallel "
                        "wrapper, which implements MixtureOfExperts), not the model itself")
    if missing:
        raise TypeError(f"{type(model).__name__} does not implement MixtureOfExperts: "
                        f"missing {', '.join(missing)}")
    if model.num_moe_layers < 1:
        raise ValueError("model has no MoE layers (num_moe_layers must be >= 1)")


def check_slots(model, world_size: int) -> None:
    """ValueError unless the model's slots split evenly: S * world_size == P."""
    P, S = model.num_physical_experts, model.num_local_physical_experts
    if S * world_size != P:
        raise ValueError(f"model has num_local_physical_experts={S} on each of {world_size} "
                         f"ranks, but num_physical_experts={P} (expected {P // world_size})")


def model_device(model) -> torch.device:
    """The device of the model's first expert tensor (else first parameter, else CPU)."""
    for w in getattr(model, "expert_weights", None) or []:
        for t in w:
            return t.device
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def expert_weights_problem(model, expert_weights: list[list[torch.Tensor]], S: int) -> str | None:
    """What is wrong with this rank's registered expert tensors, or None: one list of
    tensors per MoE layer, each `[S, ...]`, sharing memory with the tensors the layer
    itself returns (`get_expert_weights`, when the layer has it)."""
    L = model.num_moe_layers
    if len(expert_weights) != L:
        return (f"model.expert_weights has {len(expert_weights)} layers after "
                f"set_eplb_state, expected num_moe_layers={L}")
    for i, ws in enumerate(expert_weights):
        if not ws:
            return f"expert_weights[{i}] holds no tensor: register the layer's expert tensors"
        for j, t in enumerate(ws):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != S:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                return (f"expert_weights[{i}][{j}] has shape {shape}; dim 0 must be the "
                        f"local slot count num_local_physical_experts={S} (one row per "
                        f"slot this rank holds)")
    layers = list(model.moe_layers)
    if len(layers) != L:
        return None
    for i, (layer, ws) in enumerate(zip(layers, expert_weights)):
        get = getattr(layer, "get_expert_weights", None)
        if not callable(get):
            continue
        used = {u.untyped_storage().data_ptr() for u in get()}
        for j, t in enumerate(ws):
            if t.untyped_storage().data_ptr() not in used:
                return (f"expert_weights[{i}][{j}] shares no memory with the tensors "
                        f"moe_layers[{i}].get_expert_weights() returns: the runtime would "
                        f"move weights the layer never reads; register the layer's own "
                        f"tensors (or views of them), not copies")
    return None

def check_registration(problem: str | None, expert_weights: list[list[torch.Tensor]],
                       placement: Placement, rank: int, world_size: int, device: torch.device,
                       group) -> None:
    """Raise the same ValueError on every rank when any rank's expert tensors do not
    fit (`problem`) or when replicas of one expert are not bitwise equal in the
    start-up layout (slot p holds expert p mod N). Collective over the plan group:
    one all_gather of [2] ints, then one of per-slot checksums [L, S, T] int64 (only
    when some expert has replicas)."""
    L, N, P = placement.num_layers, placement.num_logical_experts, placement.num_slots
    M, S = world_size, P // world_size
    T = 0 if problem else max(len(ws) for ws in expert_weights)  # tensors per layer
    if M > 1:
        heads = _gather(group, world_size, torch.tensor([problem is not None, T], dtype=torch.int64))  # [M, 2]
        bad = [r for r in range(M) if heads[r, 0]]
        if bad and problem is None:
            problem = (f"rank(s) {bad} registered expert weights that do not fit (see the "
                       f"error there)")
        elif not bad and len(set(heads[:, 1].tolist())) > 1:
            problem = (f"ranks register different numbers of expert tensors per layer: "
                       f"{heads[:, 1].tolist()} (rank by rank)")
    if problem:
        raise ValueError(f"EplbRuntime{f' (rank {rank})' if M > 1 else ''}: {problem}")
    if P == N:  # no expert has a replica
        return
    mine = torch.zeros(L, S, T, dtype=torch.int64, device=device)  # [L, S, T]
    for i, ws in enumerate(expert_weights):
        for j, w in enumerate(ws):
            mine[i, :, j] = slot_checksums([w]).to(device)  # [S]
    mine = mine.cpu()
    every = _gather(group, world_size, mine) if M > 1 else mine[None]  # [M, L, S, T]
    cs = every.permute(1, 0, 2, 3).reshape(L, P, T).numpy()  # [L, P, T]
    mismatches = []  # (layer, expert, tensor, slots that differ from the expert's first)
    for i in range(L):
        for e in range(min(N, P - N)):  # experts with more than one replica
            slots = np.arange(e, P, N)  # [replicas of e]
            for j in range(T):
                differ = slots[cs[i, slots, j] != cs[i, e, j]]
                if differ.size:
                    mismatches.append((i, e, j, differ.tolist()))
    if mismatches:
        i, e, j, differ = mismatches[0]
        more = f" ({len(mismatches)} such mismatches in all)" if len(mismatches) > 1 else ""
        raise ValueError(
            f"EplbRuntime: replicas of one expert are not bitwise equal: layer {i}, "
            f"expert {e}: tensor {j} (expert_weights[{i}][{j}]) of slot(s) {differ} "
            f"(rank(s) {[p // S for p in differ]}) differs from slot {e} (rank {e // S})"
            f"{more}. At start-up slot p must hold logical expert p mod N (N={N}, "
            f"P={P} slots, rank r holds slots [r*S, (r+1)*S), S={S}), the layout of "
            f"Placement.initial: fill the slots in that order, with the same weights for "
            f"every replica, before creating the runtime")

def _gather(group, world_size: int, t: torch.Tensor) -> torch.Tensor:
    """All ranks' `t` (CPU) stacked, over the plan group: [M, *t.shape]."""
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts)
