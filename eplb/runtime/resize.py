"""Planned resize of the expert-parallel group: grow or shrink the number of EP ranks
while every rank is alive (elastic EP, the planned half; a rank that dies mid-resize is
not handled: docs/reliability.md). Torch's world is fixed, so a resize changes which ranks
of the world form the EP group (shrink {0,1,2,3} -> {0,1}: ranks 2 and 3 send the experts
only they hold and release their slots; grow {0,1} -> {0,1,2,3}: idle ranks join):

    result = resize_expert_parallel(model, old_ranks=[0, 1, 2, 3], new_ranks=[0, 1],
                                    runtime=runtime, load="window")   # on EVERY world rank
    runtime = result.runtime   # the new group's EplbRuntime (None on ranks outside it)

The pure part (the transfer plan, the request checks) is `eplb.core.resize_plan`,
re-exported here. On a rank of the union of old and new ranks the resize then: agrees on
the request (one all_gather, `agree_sizes`); plans and broadcasts (the first old rank
sends the placement in force and the planned one with `broadcast_arrays`, as the runtime
does); re-allocates, moves (`execute_resize`: `batch_isend_irecv` from the old slot
tensors into NEWLY allocated ones, layer by layer) and verifies (`eplb.runtime.verify`,
the rebalance's checksums); builds the new runtime on groups made on every world rank
(`EplbGroups.create(..., world_collective=True)`: torch names them by a world-wide
counter, so the names agree whatever groups each rank made before).

S (slots per rank) changes, so every new member re-allocates its expert storage
(`update_physical_experts_metadata(..., reallocate=True)`): views and CUDA graphs over
the old tensors are stale afterwards; the old EplbRuntime (and its EplbMetrics or
EplbServer) must be dropped, which frees the old slots. Peak memory: old plus new slots.

The weights first go into `Placement.initial` of the new size (what a fresh EplbRuntime
assumes); given a load (or `load="window"`, the old runtime's window) the new runtime
then moves to the placement planned for the new size with `apply_placement` (trigger
"resize"). A runtime constructor taking "the placement the weights hold" would save
that second transfer. The model must implement, besides `MixtureOfExperts`,
`update_physical_experts_metadata(P, S, reallocate=True)`, `set_expert_parallel_group`
and `release_expert_slots()` (`moe.MoEModel` does).

The point-to-point execution (`execute_resize`) and the resize's errors are in
`eplb.runtime.resize_transfer`; this module is one function per step of the resize.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.core.loadio import as_load
from eplb.core.placement import Placement
from eplb.core.planning import plan
from eplb.core.resize_plan import (LayerResizePlan, ResizePlan, ResizeSizes, agree_sizes,
                                   check_request, config_digest, plan_resize)
from eplb.runtime.groups import EplbGroups, group_ranks
from eplb.runtime.plan_broadcast import PlanBroadcastError, broadcast_arrays
from eplb.runtime.resize_transfer import (ResizeError, ResizeVerificationError, TransferHook,
                                          execute_resize)
from eplb.runtime.verify import expected_checksums, slot_checksums

__all__ = [
    "LayerResizePlan",
    "ResizePlan",
    "ResizeResult",
    "plan_resize",
    "resize_expert_parallel",
]

RESIZE_METHODS = ("update_physical_experts_metadata", "set_expert_parallel_group",
                  "release_expert_slots")

@dataclass
class ResizeResult:
    """What `resize_expert_parallel` did, as seen from one rank."""

    member: bool  # this rank is in the new EP group
    runtime: Any  # the new group's EplbRuntime, None outside it
    group: Any  # the new EP process group (None outside it)
    placement: Placement | None  # the placement in force after the resize (new group members)
    old_ranks: tuple[int, ...]
    new_ranks: tuple[int, ...]
    num_physical_experts: int  # P after the resize
    experts_moved: int  # experts received over the network, all ranks (the resize transfer)
    local_copies: int  # new slots filled from an old slot on the same rank
    bytes_received: int  # by this rank, resize transfer only
    seconds: float
    event: Any = None  # RebalanceEvent of the move to the planned placement, if any


@dataclass(frozen=True)
class _Request:
    """One rank's side of a resize, as `resize_expert_parallel` checked it."""

    model: Any
    runtime: Any
    config: EplbConfig | None  # the new runtime's, before the resize sets P and nodes
    old_ranks: tuple[int, ...]
    new_ranks: tuple[int, ...]
    num_physical_experts: int | None
    load: Any
    load_steps: float | None  # the steps an array load adds up (decode-aware packing)
    kind: int  # eplb.core.resize_plan.LOAD_KINDS
    verify: bool
    ranks_per_node: int | None
    union_group: Any  # every rank of old and new: the agreement, plan, transfer
    new_group: Any  # the new EP group
    groups: EplbGroups  # the new runtime's groups (made on every world rank)
    device: torch.device
    transfer_hook: TransferHook | None
    t0: float

    @property
    def is_old(self) -> bool:
        return dist.get_rank() in self.old_ranks

    @property
    def is_new(self) -> bool:
        return dist.get_rank() in self.new_ranks


@dataclass(frozen=True)
class _Plans:
    """The placements every rank of the union got from the first old rank, and the plan."""

    old_p2l: np.ndarray  # [L, P_old] in force before the resize
    target_p2l: np.ndarray  # [L, P_new] Placement.initial, what the transfer writes
    planned_p2l: np.ndarray | None  # [L, P_new] planned on the load, moved to afterwards
    planned_shares: np.ndarray | None  # [L, P_new] its replica shares (weighted), if any
    resize: ResizePlan


def _ranks_per_node(world_size: int) -> int | None:
    """Ranks per node from torchrun's LOCAL_WORLD_SIZE (None: one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and 0 < int(local) < world_size and world_size % int(local) == 0:
        return int(local)
    return None


def _device_of(model) -> torch.device:
    for ws in getattr(model, "expert_weights", None) or []:
        for t in ws:
            return t.device
    return torch.device("cpu")


def _destroy(*groups) -> None:
    """Destroy groups this resize made that nothing will use (None and the world are
    skipped; torch skips non-member handles). Their names come from torch's world-wide
    counter and are never reused, so destroying them frees no name for a later group."""
    for g in groups:
        if g is not None and g is not dist.group.WORLD:
            dist.destroy_process_group(g)


def resize_expert_parallel(model, old_ranks: Sequence[int], new_ranks: Sequence[int], *,
                           runtime=None, config: EplbConfig | None = None,
                           num_physical_experts: int | None = None, load: Any = None,
                           load_steps: float | None = None,
                           verify: bool = True, ranks_per_node: int | None = None,
                           transfer_hook: TransferHook | None = None) -> ResizeResult:
    """Move the EP group from the global ranks `old_ranks` to `new_ranks` (planned: all
    alive). Call on EVERY rank of the default group, in the same order, with the same
    `old_ranks`, `new_ranks`, `num_physical_experts`, kind of `load` and `ranks_per_node`
    (it creates process groups, a collective over the world).

    model: on every rank taking part; on old members the model the old group serves, on
        a joining rank any model of the same args (its slot contents are ignored).
    runtime: the old EplbRuntime, required on every old member (it knows the placement
        in force); unusable afterwards.
    config: EplbConfig of the new runtime; default: the old runtime's. Joining ranks have
        none, so they must pass it; every new member must end up with the same settings
        (checked). `num_redundant_experts` and `num_nodes` are set by the resize.
    num_physical_experts: P after the resize (default: unchanged); must divide over the
        new ranks and be >= N.
    load: None (the new group starts on `Placement.initial`), "window" (plan on the old
        runtime's recorded window: a collective over the old group) or a logical load
        [L, N] (read on the first old rank); with a load the new runtime then moves to
        `plan(load, M_new, P_new, ...)` with the config's policy, move tolerance and, when
        one step's load is known (the window's steps, or `load_steps`), decode-aware packing.
    load_steps: the steps an array `load` adds up (its sum over them is one step's token-
        expert choices, as a rebalance's window); None: not known, packing off.
    verify: compare every new slot's checksum with its expert's old one (one all_gather);
        a mismatch raises ResizeVerificationError on every rank.
    ranks_per_node: for the same-node sender preference and the new group's node count;
        default from LOCAL_WORLD_SIZE.
    transfer_hook: a test seam for fault injection (see `TransferHook`); None in use.

    Requests that cannot work (ranks outside the world, sizes that do not divide, a
    model or runtime that does not match `old_ranks`, configs that differ) raise
    ValueError on every rank involved before any weight moves.
    """
    t0 = time.perf_counter()
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("resize_expert_parallel: torch.distributed is not initialized")
    world, me = dist.get_world_size(), dist.get_rank()
    old_ranks, new_ranks, kind = check_request(old_ranks, new_ranks, world, num_physical_experts,
                                               load, ranks_per_node, load_steps)
    if ranks_per_node is None:
        ranks_per_node = _ranks_per_node(world)

    # process groups: collectives over the whole world, same order on every rank (so
    # torch's world-wide counter names them alike, whatever groups each rank made before)
    union = tuple(sorted(set(old_ranks) | set(new_ranks)))
    new_group = dist.group.WORLD if len(new_ranks) == world else dist.new_group(list(new_ranks))
    union_group = dist.group.WORLD if len(union) == world else (
        new_group if union == new_ranks else dist.new_group(list(union)))
    cfg = config if config is not None else getattr(runtime, "config", None)
    device = _device_of(model)
    groups = EplbGroups.create(new_group, cfg.transfer_timeout if cfg is not None else 300.0,
                               world_collective=True, device=device, ranks=list(new_ranks),
                               spares=2)  # renew() after an aborted rebalance takes these
    if me not in union:
        return ResizeResult(False, None, None, None, old_ranks, new_ranks,
                            num_physical_experts or 0, 0, 0, 0, time.perf_counter() - t0)
    rq = _Request(model, runtime, cfg, old_ranks, new_ranks, num_physical_experts, load, load_steps, kind,
                  bool(verify), ranks_per_node, union_group, new_group, groups, device,
                  transfer_hook, t0)
    try:
        try:
            sizes, new_cfg = _agree(rq)
            plans = _plan(rq, sizes, new_cfg)
            received = _move(rq, sizes, plans)
        except BaseException:  # the new group never served: drop it and its groups
            _destroy(groups.control, groups.plan, groups.transfer, groups.tokens,
                     *sum(groups.spares, ()), new_group)
            raise
        return _new_runtime(rq, sizes, new_cfg, plans, received)
    finally:
        if union_group is not dist.group.WORLD and union_group is not new_group:
            dist.destroy_process_group(union_group)


def _local_problem(rq: _Request) -> str | None:
    """Why this rank cannot take part as asked (None: it can)."""
    model, runtime, me = rq.model, rq.runtime, dist.get_rank()
    missing = [m for m in ("num_moe_layers", "num_logical_experts", "num_physical_experts",
                           "num_local_physical_experts", "expert_weights") + RESIZE_METHODS
               if not hasattr(model, m)]
    if missing:
        return f"model: {type(model).__name__} lacks {', '.join(missing)} (needed to resize)"
    if rq.is_old:
        if runtime is None:
            return f"runtime: rank {me} is in old_ranks, so it must pass its EplbRuntime"
        if runtime.model is not model:
            return "runtime: runs another model than `model`"
        if group_ranks(runtime.group) != list(rq.old_ranks):
            return (f"old_ranks: {list(rq.old_ranks)} but rank {me}'s runtime runs on the group "
                    f"{group_ranks(runtime.group)}")
        if runtime.placement.num_slots != model.num_physical_experts or \
                model.num_local_physical_experts * len(rq.old_ranks) != model.num_physical_experts:
            return (f"model: {model.num_local_physical_experts} local slots x {len(rq.old_ranks)} "
                    f"old ranks != num_physical_experts ({model.num_physical_experts})")
    if rq.is_new and rq.config is None:
        return f"config: rank {me} joins the EP group without a runtime, so it must pass config"
    return None


def _agree(rq: _Request) -> tuple[ResizeSizes, EplbConfig | None]:
    """Local checks, then one all_gather over the union so every rank reaches the same
    verdict (`agree_sizes`: ValueError everywhere, nothing moved) and the same sizes.
    Returns them and the new runtime's config (None outside the new group without one)."""
    error, model = _local_problem(rq), rq.model
    P_old = model.num_physical_experts if (rq.is_old and error is None) else -1
    mine = torch.tensor([int(error is not None), rq.kind, config_digest(rq.config) if rq.is_new else 0,
                         getattr(model, "num_moe_layers", -1), getattr(model, "num_logical_experts", -1),
                         P_old, int(rq.verify), rq.ranks_per_node or 0, rq.num_physical_experts or 0],
                        dtype=torch.int64, device=rq.device)  # [len(REQUEST_ROW)]
    ranks_u = group_ranks(rq.union_group)
    parts = [torch.empty_like(mine) for _ in ranks_u]
    dist.all_gather(parts, mine, group=rq.union_group)
    if error is not None:
        raise ValueError(error)
    sz = agree_sizes(torch.stack(parts).cpu().numpy(), ranks_u, rq.old_ranks, rq.new_ranks,
                     rq.ranks_per_node)
    new_cfg = None if rq.config is None else dataclasses.replace(
        rq.config, num_redundant_experts=sz.P_new - sz.N, num_nodes=sz.num_nodes,
        initial_placement=None)
    return sz, new_cfg


def _plan(rq: _Request, sz: ResizeSizes, new_cfg: EplbConfig | None) -> _Plans:
    """The first old rank sends the placement in force and, given a load, the one planned
    for the new size (`broadcast_arrays`: a planning error fails every rank); every rank
    then plans the transfer into `Placement.initial` of the new size."""
    window, steps = None, rq.load_steps
    if rq.kind == 1 and rq.is_old:  # collective over the old group
        rt = rq.runtime
        window, _ = rt.recorder.window_load(rt.group, decay=rt.config.load_decay)
        steps = rt.recorder.window_steps(rt.config.load_decay)
    L, N, M_new = sz.L, sz.N, len(rq.new_ranks)

    def make():  # on the first old rank only
        if not rq.kind:
            return rq.runtime.placement.physical_to_logical, None, None
        source = as_load(window.cpu().numpy() if rq.kind == 1 else rq.load)  # [L, N]
        if source.shape != (L, N):
            raise ValueError(f"load: shape {list(source.shape)} does not fit the model's "
                             f"[L, N] = [{L}, {N}]")
        cfg = new_cfg.verify(N, M_new, num_physical_experts=sz.P_new)
        choices = float(source.sum(1).mean()) / steps if steps else 0.0  # per step and layer
        reads = cfg.read_tokens if choices > 0 else 0.0  # as a rebalance (Rank0Planner.plan_here)
        planned = plan(source, M_new, sz.P_new, cfg.num_nodes, rq.model.num_expert_groups,
                       cfg.policy, move_tolerance=cfg.move_tolerance, weighted=cfg.weighted_replicas,
                       read_tokens=reads, step_choices=choices,
                       dispatch_tokens=cfg.dispatch_tokens, tile_rows=cfg.tile_rows)
        return rq.runtime.placement.physical_to_logical, planned.physical_to_logical, planned.shares

    root = rq.old_ranks[0]
    try:
        old_p2l, planned_p2l, shares = broadcast_arrays(
            make, [(L, sz.P_old), (L, sz.P_new), (L, sz.P_new)], rq.union_group,
            src=group_ranks(rq.union_group).index(root), device=rq.device)
    except PlanBroadcastError:
        raise ValueError(f"resize aborted: planning the new placement failed on rank {root} "
                         "(see its error); nothing was moved") from None
    old_p2l = old_p2l.astype(np.int64)  # [L, P_old]
    planned_p2l = None if planned_p2l is None else planned_p2l.astype(np.int64)  # [L, P_new]
    target = Placement.initial(L, N, sz.P_new, M_new, sz.num_nodes)  # what a fresh runtime assumes
    rs_plan = plan_resize(old_p2l, target.physical_to_logical, rq.old_ranks, rq.new_ranks,
                          rq.ranks_per_node)
    return _Plans(old_p2l, target.physical_to_logical, planned_p2l, shares, rs_plan)


def _move(rq: _Request, sz: ResizeSizes, plans: _Plans) -> int:
    """Re-allocate the new members' slots, move the weights, release a leaver's slots,
    verify. Returns the bytes this rank received."""
    model = rq.model
    old_weights = [list(ws) for ws in model.expert_weights] if rq.is_old else None
    old_sums = None
    if rq.verify and rq.is_old:
        old_sums = torch.stack([slot_checksums(ws) for ws in old_weights])  # [L, S_old]
    new_weights = None
    if rq.is_new:
        model.update_physical_experts_metadata(sz.P_new, sz.S_new, reallocate=True)
        new_weights = [list(ws) for ws in model.expert_weights]
    try:
        received = execute_resize(plans.resize, old_weights, new_weights, rq.union_group,
                                  transfer_hook=rq.transfer_hook)
    except Exception as e:
        raise ResizeError(f"resize transfer failed ({type(e).__name__}: {e}); the expert "
                          "weights are incomplete: reload them before serving") from e
    del old_weights
    if rq.is_old and not rq.is_new:
        model.release_expert_slots()
    if rq.verify:
        _verify_resize(rq, sz, plans, old_sums, new_weights)
    return received


def _verify_resize(rq: _Request, sz: ResizeSizes, plans: _Plans, old_sums: torch.Tensor | None,
                   new_weights: list | None) -> None:
    """One all_gather of every rank's old [L, S_old] and new [L, S_new] slot checksums;
    every rank compares every new slot with `expected_checksums` (its expert's first old
    slot, as a rebalance does), so all ranks raise together on a mismatch."""
    L, S_old, S_new = sz.L, sz.S_old, sz.S_new
    mine = torch.zeros(L, S_old + S_new, dtype=torch.int64, device=rq.device)  # [L, S_old + S_new]
    if old_sums is not None:
        mine[:, :S_old] = old_sums
    if new_weights is not None:
        mine[:, S_old:] = torch.stack([slot_checksums(ws) for ws in new_weights])
    ranks_u = group_ranks(rq.union_group)
    parts = [torch.empty_like(mine) for _ in ranks_u]
    dist.all_gather(parts, mine, group=rq.union_group)
    table = dict(zip(ranks_u, (p.cpu().numpy() for p in parts)))  # rank -> [L, S_old + S_new]
    old_all = np.concatenate([table[r][:, :S_old] for r in rq.old_ranks], axis=1)  # [L, P_old]
    new_all = np.concatenate([table[r][:, S_old:] for r in rq.new_ranks], axis=1)  # [L, P_new]
    for layer in range(L):
        experts = plans.target_p2l[layer]  # [P_new]
        want = expected_checksums(plans.old_p2l[layer], old_all[layer], experts)  # [P_new]
        bad = np.flatnonzero(want != new_all[layer])
        if bad.size:
            raise ResizeVerificationError(
                layer, bad.tolist(),
                f"resize verification failed on layer {layer}: new slots {bad.tolist()} (experts "
                f"{experts[bad].tolist()}) differ from their expert's old checksum; the "
                "expert weights are inconsistent: reload them before serving")


def _new_runtime(rq: _Request, sz: ResizeSizes, new_cfg: EplbConfig | None, plans: _Plans,
                 received: int) -> ResizeResult:
    """On the new members: the new group's runtime, on the groups the resize made, then
    the move to the planned placement if any."""
    from eplb.runtime import EplbRuntime

    rs = plans.resize
    if not rq.is_new:
        return ResizeResult(False, None, None, None, rq.old_ranks, rq.new_ranks, sz.P_new,
                            rs.experts_moved, rs.local_copies, received, time.perf_counter() - rq.t0)
    rq.model.set_expert_parallel_group(rq.new_group)
    runtime = EplbRuntime(rq.model, new_cfg, group=rq.new_group, groups=rq.groups)
    event = None
    if plans.planned_p2l is not None:
        new = runtime.placement.with_physical_to_logical(plans.planned_p2l, runtime.config.policy,
                                                         plans.planned_shares)
        event = runtime.apply_placement(new, trigger="resize")
    return ResizeResult(True, runtime, rq.new_group, runtime.placement, rq.old_ranks, rq.new_ranks,
                        sz.P_new, rs.experts_moved, rs.local_copies, received,
                        time.perf_counter() - rq.t0, event)
