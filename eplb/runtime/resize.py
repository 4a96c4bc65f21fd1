"""Planned resize of the expert-parallel group: grow or shrink the number of EP ranks
while every rank is alive (elastic EP, the planned half; a rank that dies is item 3's
fault handling, not this).

Torch's world is fixed at `init_process_group`, so a resize changes which ranks of the
world form the EP group:

    shrink 4 -> 2   world {0,1,2,3}; EP group {0,1,2,3} becomes {0,1}; ranks 2 and 3
                    send the experts only they hold and leave (their slots are released)
    grow   2 -> 4   world {0,1,2,3}; EP group {0,1}, ranks 2 and 3 idle (or left by an
                    earlier shrink); the EP group becomes {0,1,2,3}

    result = resize_expert_parallel(model, old_ranks=[0, 1, 2, 3], new_ranks=[0, 1],
                                    runtime=runtime, load="window")   # on EVERY world rank
    runtime = result.runtime   # the new group's EplbRuntime (None on ranks outside it)

Two halves, as in `eplb.runtime.transfer`:

* a **pure plan** (`plan_resize`, numpy only) over the union of old and new ranks: for
  every layer, which new slot is filled from an old slot of the same rank (no network),
  which (rank, expert) pairs arrive over the network and from which old holder (a
  holder on the receiver's node first, then the holder with the fewest sends so far,
  ties by ring distance, so the sends of one expert spread over its holders), and which
  new slots copy a just-received expert. Every rank computes the same plan;
* an **execution** (`execute_resize`) with `batch_isend_irecv` (gloo and NCCL) from the
  old slot tensors straight into NEWLY allocated ones, layer by layer.

A resize changes S (slots per rank), so the expert storage is re-allocated on every
rank of the new group (`update_physical_experts_metadata(..., reallocate=True)`): views
registered on the old tensors and CUDA graphs captured over them are stale afterwards
and must be re-created; the old EplbRuntime (and anything attached to it: EplbMetrics,
an EplbServer) belongs to the old group and must be dropped; the old slot tensors are
freed once it is. Peak memory during the resize is the old plus the new slot tensors.

The weights are first redistributed into `Placement.initial` of the new size, the
placement a fresh `EplbRuntime` assumes at construction; when a load is given (or the
old runtime's recorded window, `load="window"`), the new runtime then moves to the
placement planned for the new size with an ordinary `apply_placement` (trigger
"resize") on the new group. A runtime constructor that accepted "the placement the
weights already hold" would let the resize write the planned placement directly, in
one transfer instead of two.

The model must implement, besides `MixtureOfExperts`, `update_physical_experts_metadata
(P, S, reallocate=True)`, `set_expert_parallel_group(group)` and `release_expert_slots()`
(`moe.MoEModel` does).
"""
from __future__ import annotations

import dataclasses
import hashlib
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
from eplb.runtime.transfer import first_slot_of_expert, slot_checksums

__all__ = [
    "LayerResizePlan",
    "ResizePlan",
    "ResizeResult",
    "ResizeError",
    "ResizeVerificationError",
    "plan_resize",
    "execute_resize",
    "resize_expert_parallel",
]

RESIZE_METHODS = ("update_physical_experts_metadata", "set_expert_parallel_group",
                  "release_expert_slots")


class ResizeError(RuntimeError):
    """A resize could not complete after weights started to move."""


class ResizeVerificationError(ResizeError):
    """After a resize, a new slot's checksum differs from its expert's old checksum
    (raised on every rank of the union at once)."""

    def __init__(self, layer: int, bad_slots: list[int], message: str):
        super().__init__(message)
        self.layer = layer
        self.bad_slots = bad_slots  # new physical slot ids


# ==== planning (pure) ==================================================================


@dataclass(frozen=True, eq=False)
class LayerResizePlan:
    """Every move of one layer, for all ranks. Ranks are GLOBAL ranks; slots are local
    slot indices (old slots `0 .. S_old-1` of the sender, new slots `0 .. S_new-1`).

    Network rows (one per receiving rank and expert, sorted by (expert, receiver)):
    expert `recv_expert[t]` goes from old slot `src_slot[t]` of `src_rank[t]` into new
    slot `dst_slot[t]` of `dst_rank[t]`. Copy rows (on one rank, no network): new slot
    `copy_dst[c]` of `copy_rank[c]` takes old slot `copy_src[c]` of the same rank, or,
    where `copy_from_new[c]`, the new slot `copy_src[c]` just received."""

    recv_expert: np.ndarray  # [T]
    src_rank: np.ndarray  # [T]
    src_slot: np.ndarray  # [T] old local slot read by the sender
    dst_rank: np.ndarray  # [T]
    dst_slot: np.ndarray  # [T] new local slot received into
    copy_rank: np.ndarray  # [C]
    copy_dst: np.ndarray  # [C] new local slot written
    copy_src: np.ndarray  # [C] old local slot, or new local slot where copy_from_new
    copy_from_new: np.ndarray  # [C] bool

    @property
    def num_received(self) -> int:
        return len(self.recv_expert)

    @property
    def num_local_copies(self) -> int:
        """New slots filled from an old slot of the same rank."""
        return int((~self.copy_from_new).sum())


@dataclass(frozen=True, eq=False)
class ResizePlan:
    old_ranks: tuple[int, ...]  # global ranks of the old EP group, EP rank order
    new_ranks: tuple[int, ...]  # global ranks of the new EP group, EP rank order
    slots_per_rank_old: int  # S_old
    slots_per_rank_new: int  # S_new
    layers: list[LayerResizePlan]

    @property
    def experts_moved(self) -> int:
        """Experts received over the network, all layers and ranks."""
        return sum(lp.num_received for lp in self.layers)

    @property
    def local_copies(self) -> int:
        return sum(lp.num_local_copies for lp in self.layers)

    def sends_per_rank(self) -> dict[int, int]:
        """Network sends of every old rank, all layers."""
        out = {r: 0 for r in self.old_ranks}
        for lp in self.layers:
            for r in lp.src_rank.tolist():
                out[r] += 1
        return out


def _rank_list(name: str, ranks: Any, world_size: int | None = None) -> tuple[int, ...]:
    """Sorted tuple of distinct non-negative ints (< world_size when given); ValueError else."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ValueError(f"{name}: must be a sequence of ranks, got {ranks!r}")
    out = []
    for r in ranks:
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)):
            raise ValueError(f"{name}: ranks must be ints, got {r!r}")
        out.append(int(r))
    if not out:
        raise ValueError(f"{name}: must name at least one rank")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: duplicate ranks in {out}")
    bad = [r for r in out if r < 0 or (world_size is not None and r >= world_size)]
    if bad:
        limit = f"[0, {world_size})" if world_size is not None else ">= 0"
        raise ValueError(f"{name}: ranks {bad} outside {limit}")
    return tuple(sorted(out))


def plan_resize(old, new, old_ranks: Sequence[int], new_ranks: Sequence[int],
                ranks_per_node: int | None = None) -> ResizePlan:
    """Plan moving experts from placement `old` ([L, P_old] or a Placement) held by the
    EP group `old_ranks` (global ranks; EP rank i = the i-th smallest) to `new`
    ([L, P_new]) held by `new_ranks`. Slot p of a placement lives on EP rank p // S.

    `ranks_per_node`: global ranks r and r' share a node when r // ranks_per_node ==
    r' // ranks_per_node (None: one node). Deterministic: same inputs, same plan.
    """
    old_p2l = np.asarray(old.physical_to_logical if isinstance(old, Placement) else old)
    new_p2l = np.asarray(new.physical_to_logical if isinstance(new, Placement) else new)
    old_ranks, new_ranks = _rank_list("old_ranks", old_ranks), _rank_list("new_ranks", new_ranks)
    for name, a in (("old", old_p2l), ("new", new_p2l)):
        if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name}: physical_to_logical must be an integer [L, P] array, "
                             f"got {a.dtype} of shape {a.shape}")
        if a.size and a.min() < 0:
            raise ValueError(f"{name}: expert ids must be >= 0")
    if old_p2l.shape[0] != new_p2l.shape[0]:
        raise ValueError(f"old has {old_p2l.shape[0]} layers, new {new_p2l.shape[0]}")
    (L, P_old), P_new = old_p2l.shape, new_p2l.shape[1]
    M_old, M_new = len(old_ranks), len(new_ranks)
    if P_old % M_old:
        raise ValueError(f"old: {P_old} slots do not divide over {M_old} old_ranks")
    if P_new % M_new:
        raise ValueError(f"new: {P_new} slots do not divide over {M_new} new_ranks")
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool)
                                       or not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node: must be an int >= 1 or None, got {ranks_per_node!r}")
    S_old, S_new = P_old // M_old, P_new // M_new
    ring = max(old_ranks + new_ranks) + 1

    def node(r: int) -> int:
        return 0 if ranks_per_node is None else r // ranks_per_node

    sends = {r: 0 for r in old_ranks}  # network sends chosen so far, all layers
    layers = []
    for layer in range(L):
        first_old: dict[int, dict[int, int]] = {}  # rank -> expert -> first old local slot
        for p, e in enumerate(old_p2l[layer].tolist()):
            first_old.setdefault(old_ranks[p // S_old], {}).setdefault(e, p % S_old)
        missing = sorted(set(new_p2l[layer].tolist()) - set(old_p2l[layer].tolist()))
        if missing:
            raise ValueError(f"layer {layer}: experts {missing} are in the new placement but "
                             "no rank holds them in the old one")
        holders: dict[int, list[int]] = {}
        for r in old_ranks:
            for e in first_old.get(r, {}):
                holders.setdefault(e, []).append(r)

        pairs: list[tuple[int, int, int]] = []  # (expert, receiver, first new local slot)
        first_new: dict[tuple[int, int], int] = {}
        copies: list[tuple[int, int, int, bool]] = []  # (rank, dst, src, from_new)
        for q, e in enumerate(new_p2l[layer].tolist()):
            r, s = new_ranks[q // S_new], q % S_new
            if e in first_old.get(r, {}):
                copies.append((r, s, first_old[r][e], False))
            elif (r, e) in first_new:
                copies.append((r, s, first_new[(r, e)], True))
            else:
                first_new[(r, e)] = s
                pairs.append((e, r, s))

        def candidates(e: int, r: int) -> list[int]:
            same = [h for h in holders[e] if node(h) == node(r)]
            return same or holders[e]

        chosen: dict[tuple[int, int], int] = {}
        # scarce pairs first (fewest candidates), then by (expert, receiver)
        for e, r, _s in sorted(pairs, key=lambda t: (len(candidates(t[0], t[1])), t[0], t[1])):
            h = min(candidates(e, r), key=lambda c: (sends[c], (c - r) % ring))
            sends[h] += 1
            chosen[(e, r)] = h
        pairs.sort()

        def i64(x) -> np.ndarray:
            return np.asarray(x, dtype=np.int64).reshape(-1)

        layers.append(LayerResizePlan(
            recv_expert=i64([e for e, _, _ in pairs]),
            src_rank=i64([chosen[(e, r)] for e, r, _ in pairs]),
            src_slot=i64([first_old[chosen[(e, r)]][e] for e, r, _ in pairs]),
            dst_rank=i64([r for _, r, _ in pairs]),
            dst_slot=i64([s for _, _, s in pairs]),
            copy_rank=i64([c[0] for c in copies]), copy_dst=i64([c[1] for c in copies]),
            copy_src=i64([c[2] for c in copies]),
            copy_from_new=np.asarray([c[3] for c in copies], dtype=bool).reshape(-1),
        ))
    return ResizePlan(old_ranks, new_ranks, S_old, S_new, layers)


# ==== execution (torch.distributed) ====================================================


def _execute_layer(lp: LayerResizePlan, rank: int, old: Sequence[torch.Tensor] | None,
                   new: Sequence[torch.Tensor] | None, group) -> int:
    """One layer on one rank: post sends (from `old`) and receives (into `new`), copy the
    local rows, wait, copy received rows to their duplicates. Returns bytes received."""
    ops: list[tuple[int, str, int, int]] = []  # (expert, kind, peer, row) sorted below
    for t in np.flatnonzero(lp.src_rank == rank).tolist():
        ops.append((int(lp.recv_expert[t]), "send", int(lp.dst_rank[t]), t))
    for t in np.flatnonzero(lp.dst_rank == rank).tolist():
        ops.append((int(lp.recv_expert[t]), "recv", int(lp.src_rank[t]), t))
    # between two ranks each direction's messages go in ascending expert order on both sides
    ops.sort()
    p2p, keep, landing = [], [], []
    received = 0
    for _e, kind, peer, t in ops:
        for i in range(len(old if kind == "send" else new)):
            if kind == "send":
                src = old[i][int(lp.src_slot[t])]
                src = src if src.is_contiguous() else src.contiguous()
                keep.append(src)
                p2p.append(dist.P2POp(dist.isend, src, peer, group))
            else:
                dst = new[i][int(lp.dst_slot[t])]
                buf = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
                if buf is not dst:
                    landing.append((dst, buf))
                p2p.append(dist.P2POp(dist.irecv, buf, peer, group))
                received += buf.nbytes
    works = dist.batch_isend_irecv(p2p) if p2p else []
    mine = np.flatnonzero(lp.copy_rank == rank)
    for c in mine[~lp.copy_from_new[mine]].tolist():  # old -> new on this rank, no network
        for o, n in zip(old, new):
            n[int(lp.copy_dst[c])].copy_(o[int(lp.copy_src[c])])
    for w in works:
        w.wait()
    for dst, buf in landing:
        dst.copy_(buf)
    for c in mine[lp.copy_from_new[mine]].tolist():  # duplicates of a received expert
        for n in new:
            n[int(lp.copy_dst[c])].copy_(n[int(lp.copy_src[c])])
    del keep
    return received


def execute_resize(rs_plan: ResizePlan, old_weights: list | None, new_weights: list | None,
                   group=None) -> int:
    """Carry out `rs_plan` on this rank: `old_weights[layer]` are its old slot tensors
    `[S_old, ...]` (None if it was not in the old group; each layer's list is dropped
    once that layer is done), `new_weights[layer]` the freshly allocated `[S_new, ...]`
    ones (None if it is not in the new group). `group`: a process group containing every
    rank of the plan (ops name global ranks). Every such rank must call it. Returns the
    bytes this rank received."""
    rank = dist.get_rank()
    received = 0
    for layer, lp in enumerate(rs_plan.layers):
        old = old_weights[layer] if old_weights is not None else None
        new = new_weights[layer] if new_weights is not None else None
        if (old is None and (lp.src_rank == rank).any()) or (
                new is None and ((lp.dst_rank == rank).any() or (lp.copy_rank == rank).any())):
            raise ValueError(f"layer {layer}: rank {rank} has a part in the plan but no "
                             f"{'old' if old is None else 'new'} weights")
        received += _execute_layer(lp, rank, old, new, group)
        if old_weights is not None:
            old_weights[layer] = None  # the old slots of this layer may be freed now
    return received


# ==== the whole resize =================================================================


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


def _ranks_per_node(world_size: int) -> int | None:
    """Ranks per node from torchrun's LOCAL_WORLD_SIZE (None: one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and 0 < int(local) < world_size and world_size % int(local) == 0:
        return int(local)
    return None


def _nodes_of(ranks: Sequence[int], ranks_per_node: int | None) -> int:
    """Nodes the EP group spans when they hold equal contiguous blocks of it, else 1."""
    if ranks_per_node is None:
        return 1
    nodes = [r // ranks_per_node for r in ranks]
    distinct = sorted(set(nodes))
    per = len(ranks) // len(distinct)
    if all(nodes.count(n) == per for n in distinct) and nodes == sorted(nodes):
        return len(distinct)
    return 1


def _config_hash(config: EplbConfig | None) -> int:
    """63-bit digest of the fields every rank of the new group must share (the slot
    count, node count and initial placement are set by the resize itself)."""
    if config is None:
        return 0
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("num_redundant_experts", "num_nodes", "initial_placement")}
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1) or 1


def _device_of(model) -> torch.device:
    for ws in getattr(model, "expert_weights", None) or []:
        for t in ws:
            return t.device
    return torch.device("cpu")


def _group_ranks(group) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


_KINDS = {None: 0, "window": 1, "array": 2}


def resize_expert_parallel(model, old_ranks: Sequence[int], new_ranks: Sequence[int], *,
                           runtime=None, config: EplbConfig | None = None,
                           num_physical_experts: int | None = None, load: Any = None,
                           verify: bool = True, ranks_per_node: int | None = None,
                           ) -> ResizeResult:
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
        `plan(load, M_new, P_new, ...)` with the config's policy.
    verify: compare every new slot's checksum with its expert's old one (one all_gather);
        a mismatch raises ResizeVerificationError on every rank.
    ranks_per_node: for the same-node sender preference and the new group's node count;
        default from LOCAL_WORLD_SIZE.

    Requests that cannot work (ranks outside the world, sizes that do not divide, a
    model or runtime that does not match `old_ranks`, configs that differ) raise
    ValueError on every rank involved before any weight moves.
    """
    t0 = time.perf_counter()
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("resize_expert_parallel: torch.distributed is not initialized")
    world, me = dist.get_world_size(), dist.get_rank()
    old_ranks = _rank_list("old_ranks", old_ranks, world)
    new_ranks = _rank_list("new_ranks", new_ranks, world)
    if old_ranks == new_ranks:
        raise ValueError(f"new_ranks: same as old_ranks {list(old_ranks)}; nothing to resize "
                         "(runtime.rebalance() moves experts within a group)")
    if num_physical_experts is not None:
        if isinstance(num_physical_experts, bool) or not isinstance(num_physical_experts, int) \
                or num_physical_experts < 1:
            raise ValueError(f"num_physical_experts: must be an int >= 1, got {num_physical_experts!r}")
        if num_physical_experts % len(new_ranks):
            M = len(new_ranks)
            lo, hi = num_physical_experts // M * M, -(-num_physical_experts // M) * M
            raise ValueError(f"num_physical_experts: {num_physical_experts} slots do not divide "
                             f"over {M} new ranks; try {f'{lo} or {hi}' if lo else hi}")
    if isinstance(load, str) and load != "window":
        raise ValueError(f"load: must be None, 'window' or an [L, N] array, got {load!r}")
    kind = _KINDS[load if load is None or isinstance(load, str) else "array"]
    if ranks_per_node is None:
        ranks_per_node = _ranks_per_node(world)
    elif isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node: must be an int >= 1, got {ranks_per_node!r}")

    # process groups: a collective over the whole world, same order on every rank
    union = tuple(sorted(set(old_ranks) | set(new_ranks)))
    new_group = dist.group.WORLD if len(new_ranks) == world else dist.new_group(list(new_ranks))
    own_union = False
    if len(union) == world:
        union_group = dist.group.WORLD
    elif union == new_ranks:
        union_group = new_group
    else:
        union_group, own_union = dist.new_group(list(union)), True
    if me not in union:
        return ResizeResult(False, None, None, None, old_ranks, new_ranks,
                            num_physical_experts or 0, 0, 0, 0, time.perf_counter() - t0)
    try:
        return _resize_member(model, old_ranks, new_ranks, union_group, new_group, runtime, config,
                              num_physical_experts, load, kind, verify, ranks_per_node, t0)
    finally:
        if own_union:
            dist.destroy_process_group(union_group)


def _resize_member(model, old_ranks, new_ranks, union_group, new_group, runtime, config,
                   num_physical_experts, load, kind, verify, ranks_per_node, t0) -> ResizeResult:
    """The resize on a rank of the union of old and new ranks (see resize_expert_parallel)."""
    from eplb.runtime import EplbRuntime

    me = dist.get_rank()
    is_old, is_new = me in old_ranks, me in new_ranks
    device = _device_of(model)

    # 1. local checks, then one all_gather so that every rank reaches the same verdict
    error = None
    missing = [m for m in ("num_moe_layers", "num_logical_experts", "num_physical_experts",
                           "num_local_physical_experts", "expert_weights") + RESIZE_METHODS
               if not hasattr(model, m)]
    if missing:
        error = f"model: {type(model).__name__} lacks {', '.join(missing)} (needed to resize)"
    elif is_old:
        if runtime is None:
            error = f"runtime: rank {me} is in old_ranks, so it must pass its EplbRuntime"
        elif runtime.model is not model:
            error = "runtime: runs another model than `model`"
        elif _group_ranks(runtime.group) != list(old_ranks):
            error = (f"old_ranks: {list(old_ranks)} but rank {me}'s runtime runs on the group "
                     f"{_group_ranks(runtime.group)}")
        elif runtime.placement.num_slots != model.num_physical_experts or \
                model.num_local_physical_experts * len(old_ranks) != model.num_physical_experts:
            error = (f"model: {model.num_local_physical_experts} local slots x {len(old_ranks)} "
                     f"old ranks != num_physical_experts ({model.num_physical_experts})")
    if error is None and is_new and config is None and runtime is None:
        error = f"config: rank {me} joins the EP group without a runtime, so it must pass config"
    cfg = config if config is not None else (runtime.config if runtime is not None else None)
    L = getattr(model, "num_moe_layers", -1)
    N = getattr(model, "num_logical_experts", -1)
    P_old = model.num_physical_experts if (is_old and error is None) else -1
    mine = torch.tensor([int(error is not None), kind, _config_hash(cfg) if is_new else 0,
                         L, N, P_old, int(bool(verify)), ranks_per_node or 0,
                         num_physical_experts or 0], dtype=torch.int64, device=device)  # [9]
    parts = [torch.empty_like(mine) for _ in _group_ranks(union_group)]
    dist.all_gather(parts, mine, group=union_group)
    table = torch.stack(parts).cpu().numpy()  # [U, 9]
    ranks_u = _group_ranks(union_group)
    bad = [ranks_u[i] for i in np.flatnonzero(table[:, 0])]
    if error is not None:
        raise ValueError(error)
    if bad:
        raise ValueError(f"resize refused by rank(s) {bad} (see their error); nothing was moved")
    if len(set(table[:, 1].tolist())) > 1:
        raise ValueError("load: ranks passed different kinds of load (None / 'window' / array)")
    for col, name in ((6, "verify"), (7, "ranks_per_node"), (8, "num_physical_experts")):
        if len(set(table[:, col].tolist())) > 1:
            raise ValueError(f"{name}: ranks passed different values "
                             f"{dict(zip(ranks_u, table[:, col].tolist()))}")
    hashes = {int(h) for h, r in zip(table[:, 2], ranks_u) if r in new_ranks}
    if len(hashes) > 1:
        raise ValueError("config: the ranks of the new group have different EplbConfig settings")
    if len(set(table[:, 3].tolist())) > 1 or len(set(table[:, 4].tolist())) > 1:
        raise ValueError(f"model: ranks disagree on num_moe_layers / num_logical_experts: "
                         f"{dict(zip(ranks_u, table[:, 3:5].tolist()))}")
    olds = {int(p) for p, r in zip(table[:, 5], ranks_u) if r in old_ranks}
    if len(olds) != 1:
        raise ValueError(f"model: the old ranks disagree on num_physical_experts: {sorted(olds)}")
    P_old = olds.pop()
    M_new = len(new_ranks)
    P_new = P_old if num_physical_experts is None else num_physical_experts
    if P_new % M_new:
        lo, hi = P_new // M_new * M_new, -(-P_new // M_new) * M_new
        raise ValueError(f"num_physical_experts: the current {P_new} slots do not divide over "
                         f"{M_new} new ranks; pass num_physical_experts={max(lo, N) if lo >= N else hi} "
                         f"or {hi}")
    if P_new < N:
        raise ValueError(f"num_physical_experts: {P_new} < num_logical_experts ({N})")
    S_new = P_new // M_new
    num_nodes = _nodes_of(new_ranks, ranks_per_node)
    new_cfg = dataclasses.replace(cfg, num_redundant_experts=P_new - N, num_nodes=num_nodes,
                                  initial_placement=None) if cfg is not None else None

    # 2. the old placement and the planned one, from the first old rank (it plans)
    window = None
    if kind == 1 and is_old:  # collective over the old group
        window, _ = runtime.recorder.window_load(runtime.group, decay=runtime.config.load_decay)
    root = old_ranks[0]
    msg = torch.zeros(L * P_old + 2 * L * P_new + 2, dtype=torch.float64, device=device)
    plan_error = None
    if me == root:
        msg[:L * P_old].copy_(torch.from_numpy(
            runtime.placement.physical_to_logical.ravel().astype(np.float64)))
        try:
            planned = None
            if kind:
                source = as_load(window.cpu().numpy() if kind == 1 else load)  # [L, N]
                if source.shape != (L, N):
                    raise ValueError(f"load: shape {list(source.shape)} does not fit the model's "
                                     f"[L, N] = [{L}, {N}]")
                verified = new_cfg.verify(N, M_new, num_physical_experts=P_new)
                planned = plan(source, M_new, P_new, verified.num_nodes, model.num_expert_groups,
                               verified.policy, move_tolerance=verified.move_tolerance,
                               weighted=verified.weighted_replicas)
                off = L * P_old
                msg[off:off + L * P_new].copy_(torch.from_numpy(
                    planned.physical_to_logical.ravel().astype(np.float64)))
                if planned.shares is not None:
                    msg[off + L * P_new:off + 2 * L * P_new].copy_(
                        torch.from_numpy(planned.shares.ravel().copy()))
                    msg[-2] = 1
            msg[-1] = 1
        except Exception as e:  # any failure here must reach the other ranks, not hang them
            plan_error = e
    dist.broadcast(msg, src=root, group=union_group)
    msg = msg.cpu().numpy()
    if plan_error is not None:
        raise plan_error
    if msg[-1] != 1:
        raise ValueError(f"resize aborted: planning the new placement failed on rank {root} "
                         "(see its error); nothing was moved")
    old_p2l = msg[:L * P_old].astype(np.int64).reshape(L, P_old)  # [L, P_old]
    planned_p2l = planned_shares = None
    if kind:
        off = L * P_old
        planned_p2l = msg[off:off + L * P_new].astype(np.int64).reshape(L, P_new)  # [L, P_new]
        if msg[-2] == 1:
            planned_shares = msg[off + L * P_new:off + 2 * L * P_new].reshape(L, P_new)  # [L, P_new]
    target = Placement.initial(L, N, P_new, M_new, num_nodes)  # what a fresh runtime assumes
    rs_plan = plan_resize(old_p2l, target.physical_to_logical, old_ranks, new_ranks, ranks_per_node)

    # 3. re-allocate, move, verify
    old_weights = [list(ws) for ws in model.expert_weights] if is_old else None
    S_old = P_old // len(old_ranks)
    old_cs = None
    if verify and is_old:
        old_cs = torch.stack([slot_checksums(ws) for ws in old_weights])  # [L, S_old]
    if is_new:
        model.update_physical_experts_metadata(P_new, S_new, reallocate=True)
        new_weights = [list(ws) for ws in model.expert_weights]
    else:
        new_weights = None
    try:
        received = execute_resize(rs_plan, old_weights, new_weights, union_group)
    except Exception as e:
        raise ResizeError(f"resize transfer failed ({type(e).__name__}: {e}); the expert "
                          "weights are incomplete: reload them before serving") from e
    del old_weights
    if is_old and not is_new:
        model.release_expert_slots()
    if verify:
        _verify_resize(rs_plan, old_p2l, target.physical_to_logical, old_cs,
                       new_weights, S_old, S_new, union_group, device)

    # 4. the new group's runtime (on members), then the planned placement if any
    _align_group_names(union_group, new_ranks, device)
    if not is_new:
        return ResizeResult(False, None, None, None, old_ranks, new_ranks, P_new,
                            rs_plan.experts_moved, rs_plan.local_copies, received,
                            time.perf_counter() - t0)
    model.set_expert_parallel_group(new_group)
    new_runtime = EplbRuntime(model, new_cfg, group=new_group)
    event = None
    if planned_p2l is not None:
        new = new_runtime.placement.with_physical_to_logical(planned_p2l, new_runtime.config.policy,
                                                             planned_shares)
        event = new_runtime.apply_placement(new, trigger="resize")
    return ResizeResult(True, new_runtime, new_group, new_runtime.placement, old_ranks, new_ranks,
                        P_new, rs_plan.experts_moved, rs_plan.local_copies, received,
                        time.perf_counter() - t0, event)


def _align_group_names(group, members: Sequence[int], device) -> None:
    """Let the members of the new group register equally many process groups.

    EplbRuntime makes its own groups with `new_group(..., use_local_synchronization=True)`,
    which torch names by hashing the ranks with the number of groups THIS process has
    registered (`len(_world.pg_names)`). After a resize the members' histories differ (a
    rank that was outside a group never registered it), so their names would differ and
    the runtime's construction would hang in the rendezvous. Every rank of `group` shares
    its count (one all_gather); each member below the largest count registers one-rank
    gloo groups until it matches. Touches torch's private registry; the clean fix is a
    runtime that takes its groups from the caller (see docs/reliability.md)."""
    from torch.distributed import distributed_c10d as c10d

    registry = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if registry is None:  # another torch: nothing to align with
        return
    mine = torch.tensor([len(registry)], dtype=torch.int64, device=device)
    ranks = _group_ranks(group)
    parts = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(parts, mine, group=group)
    target = max(int(p.item()) for p, r in zip(parts, ranks) if r in members)
    me = dist.get_rank()
    while me in members and len(registry) < target:
        dist.new_group([me], backend="gloo", use_local_synchronization=True)


def _verify_resize(rs_plan: ResizePlan, old_p2l: np.ndarray, new_p2l: np.ndarray,
                   old_cs: torch.Tensor | None, new_weights: list | None, S_old: int, S_new: int,
                   group, device) -> None:
    """One all_gather of every rank's old [L, S_old] and new [L, S_new] slot checksums;
    every rank checks every new slot against the old checksum of the first old slot
    holding its expert, so all ranks raise together on a mismatch."""
    L = old_p2l.shape[0]
    mine = torch.zeros(L, S_old + S_new, dtype=torch.int64, device=device)  # [L, S_old + S_new]
    if old_cs is not None:
        mine[:, :S_old] = old_cs
    if new_weights is not None:
        mine[:, S_old:] = torch.stack([slot_checksums(ws) for ws in new_weights])
    ranks_u = _group_ranks(group)
    parts = [torch.empty_like(mine) for _ in ranks_u]
    dist.all_gather(parts, mine, group=group)
    table = dict(zip(ranks_u, (p.cpu().numpy() for p in parts)))  # rank -> [L, S_old + S_new]
    old_all = np.concatenate([table[r][:, :S_old] for r in rs_plan.old_ranks], axis=1)  # [L, P_old]
    new_all = np.concatenate([table[r][:, S_old:] for r in rs_plan.new_ranks], axis=1)  # [L, P_new]
    for layer in range(L):
        first = first_slot_of_expert(old_p2l[layer])
        want = old_all[layer, [first[e] for e in new_p2l[layer].tolist()]]  # [P_new]
        bad = np.flatnonzero(want != new_all[layer])
        if bad.size:
            raise ResizeVerificationError(
                layer, bad.tolist(),
                f"resize verification failed on layer {layer}: new slots {bad.tolist()} (experts "
                f"{new_p2l[layer][bad].tolist()}) differ from their expert's old checksum; the "
                "expert weights are inconsistent: reload them before serving")
