"""The pure plan of a resize of the expert-parallel group (numpy only, no torch).

A resize (`eplb.runtime.resize`) moves the experts from a placement held by the old EP
ranks to one held by the new ranks, whose slot count per rank S may differ. This module
decides every move, for all ranks at once, so that every rank computes the same plan
from the same inputs and the runtime half only executes it:

* a new slot whose expert its rank already held takes it from that old slot (a local
  copy, no network);
* each (new rank, expert) pair still missing arrives once over the network, from an old
  holder chosen by `eplb.core.senders.choose_senders`, the same greedy rule a
  rebalance uses (a holder on the receiver's node first, scarce pairs first, then the
  holder with the fewest sends so far, carried across layers, ties by ring distance);
* further new slots of the same expert on that rank copy the just-received one.

The checks of a resize request are pure too: `check_request` (what one rank can check
alone) and `agree_sizes` (the verdict every rank reaches from the same gathered table of
every rank's request, `REQUEST_ROW`), so every rank refuses or proceeds together.

It lives in the core, apart from the distributed execution, so it can be tested and
reasoned about without processes, and so that the sender choice is shared with the
transfer plan of a rebalance rather than duplicated.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from eplb.core.placement import Placement
from eplb.core.senders import choose_senders
from eplb.core.transfer_plan import first_slot_of_expert

__all__ = ["LayerResizePlan", "ResizePlan", "ResizeSizes", "plan_resize", "nodes_of", "check_request",
           "agree_sizes", "config_digest", "REQUEST_ROW", "LOAD_KINDS"]


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


def nodes_of(ranks: Sequence[int], ranks_per_node: int | None) -> int:
    """Nodes the EP group `ranks` spans when they hold equal contiguous blocks of it, else 1."""
    if ranks_per_node is None:
        return 1
    nodes = [r // ranks_per_node for r in ranks]
    distinct = sorted(set(nodes))
    per = len(ranks) // len(distinct)
    if all(nodes.count(n) == per for n in distinct) and nodes == sorted(nodes):
        return len(distinct)
    return 1


def _p2l(name: str, placement) -> np.ndarray:
    a = np.asarray(placement.physical_to_logical if isinstance(placement, Placement) else placement)
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: physical_to_logical must be an integer [L, P] array, "
                         f"got {a.dtype} of shape {a.shape}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name}: expert ids must be >= 0")
    return a


def plan_resize(old, new, old_ranks: Sequence[int], new_ranks: Sequence[int],
                ranks_per_node: int | None = None) -> ResizePlan:
    """Plan moving experts from placement `old` ([L, P_old] or a Placement) held by the
    EP group `old_ranks` (global ranks; EP rank i = the i-th smallest) to `new`
    ([L, P_new]) held by `new_ranks`. Slot p of a placement lives on EP rank p // S.

    `ranks_per_node`: global ranks r and r' share a node when r // ranks_per_node ==
    r' // ranks_per_node (None: one node). Deterministic: same inputs, same plan.
    """
    old_p2l, new_p2l = _p2l("old", old), _p2l("new", new)
    old_ranks, new_ranks = _rank_list("old_ranks", old_ranks), _rank_list("new_ranks", new_ranks)
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
    node_of = None if ranks_per_node is None else (lambda r: r // ranks_per_node)
    sends = {r: 0 for r in old_ranks}  # network sends chosen so far, all layers
    layers = [_plan_layer(old_p2l[layer], new_p2l[layer], layer, old_ranks, new_ranks,
                          S_old, S_new, sends, ring, node_of) for layer in range(L)]
    return ResizePlan(old_ranks, new_ranks, S_old, S_new, layers)


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _plan_layer(old_row: np.ndarray, new_row: np.ndarray, layer: int, old_ranks, new_ranks,
                S_old: int, S_new: int, sends: dict[int, int], ring: int,
                node_of) -> LayerResizePlan:
    """One layer of `plan_resize`; `sends` is updated in place."""
    missing = sorted(set(new_row.tolist()) - set(old_row.tolist()))
    if missing:
        raise ValueError(f"layer {layer}: experts {missing} are in the new placement but "
                         "no rank holds them in the old one")
    # rank -> expert -> its first old local slot
    first_old = {r: first_slot_of_expert(old_row[i * S_old:(i + 1) * S_old])
                 for i, r in enumerate(old_ranks)}
    holders: dict[int, list[int]] = {}  # expert -> old ranks holding it, ascending
    for r in old_ranks:
        for e in first_old[r]:
            holders.setdefault(e, []).append(r)

    pairs: list[tuple[int, int, int]] = []  # (expert, receiver, first new local slot)
    first_new: dict[tuple[int, int], int] = {}
    copies: list[tuple[int, int, int, bool]] = []  # (rank, dst, src, from_new)
    for q, e in enumerate(new_row.tolist()):
        r, s = new_ranks[q // S_new], q % S_new
        if e in first_old.get(r, {}):
            copies.append((r, s, first_old[r][e], False))
        elif (r, e) in first_new:
            copies.append((r, s, first_new[(r, e)], True))
        else:
            first_new[(r, e)] = s
            pairs.append((e, r, s))
    pairs.sort()
    src_rank = choose_senders([e for e, _, _ in pairs], [r for _, r, _ in pairs],
                              holders, sends, ring, node_of)  # [T]
    return LayerResizePlan(
        recv_expert=_i64([e for e, _, _ in pairs]),
        src_rank=_i64(src_rank),
        src_slot=_i64([first_old[h][e] for (e, _, _), h in zip(pairs, src_rank.tolist())]),
        dst_rank=_i64([r for _, r, _ in pairs]),
        dst_slot=_i64([s for _, _, s in pairs]),
        copy_rank=_i64([c[0] for c in copies]), copy_dst=_i64([c[1] for c in copies]),
        copy_src=_i64([c[2] for c in copies]),
        copy_from_new=np.asarray([c[3] for c in copies], dtype=bool).reshape(-1),
    )


# ==== the request, checked before anything moves ========================================

LOAD_KINDS = {None: 0, "window": 1, "array": 2}


def check_request(old_ranks, new_ranks, world_size: int, num_physical_experts=None,
                  load=None, ranks_per_node=None,
                  load_steps=None) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The checks one rank can make alone (ValueError): returns the sorted old and new
    ranks and the kind of load (`LOAD_KINDS`)."""
    old_ranks = _rank_list("old_ranks", old_ranks, world_size)
    new_ranks = _rank_list("new_ranks", new_ranks, world_size)
    if old_ranks == new_ranks:
        raise ValueError(f"new_ranks: same as old_ranks {list(old_ranks)}; nothing to resize "
                         "(runtime.rebalance() moves experts within a group)")
    P, M = num_physical_experts, len(new_ranks)
    if P is not None:
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"num_physical_experts: must be an int >= 1, got {P!r}")
        if P % M:
            lo, hi = P // M * M, -(-P // M) * M
            raise ValueError(f"num_physical_experts: {P} slots do not divide "
                             f"over {M} new ranks; try {f'{lo} or {hi}' if lo else hi}")
    if isinstance(load, str) and load != "window":
        raise ValueError(f"load: must be None, 'window' or an [L, N] array, got {load!r}")
    if load_steps is not None:
        if load is None or isinstance(load, str):
            raise ValueError(f"load_steps: only with an [L, N] load (the window knows its steps), "
                             f"got load={load!r}")
        if isinstance(load_steps, bool) or not isinstance(load_steps, (int, float)) or not load_steps > 0:
            raise ValueError(f"load_steps: must be a number > 0, got {load_steps!r}")
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool)
                                       or not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node: must be an int >= 1, got {ranks_per_node!r}")
    return old_ranks, new_ranks, LOAD_KINDS[load if load is None or isinstance(load, str) else "array"]


@dataclass(frozen=True)
class ResizeSizes:
    """What every rank of the union agreed on (`agree_sizes`)."""

    L: int
    N: int
    P_old: int
    P_new: int
    S_old: int
    S_new: int
    num_nodes: int  # nodes the new group spans


# the columns of the row each rank of the union contributes to the agreement
REQUEST_ROW = ("refused", "load_kind", "config_digest", "num_moe_layers", "num_logical_experts",
               "num_physical_experts_old", "verify", "ranks_per_node", "num_physical_experts")


def agree_sizes(table: np.ndarray, ranks: Sequence[int], old_ranks: Sequence[int],
                new_ranks: Sequence[int], ranks_per_node: int | None) -> ResizeSizes:
    """The verdict every rank of the union reaches from the same gathered `table`
    `[U, len(REQUEST_ROW)]` (row i from global rank `ranks[i]`): the agreed sizes, or
    ValueError when a rank refused or the ranks disagree. `ranks_per_node` as agreed."""
    col = {name: table[:, i].tolist() for i, name in enumerate(REQUEST_ROW)}
    bad = [r for r, b in zip(ranks, col["refused"]) if b]
    if bad:
        raise ValueError(f"resize refused by rank(s) {bad} (see their error); nothing was moved")
    if len(set(col["load_kind"])) > 1:
        raise ValueError("load: ranks passed different kinds of load (None / 'window' / array)")
    for name in ("verify", "ranks_per_node", "num_physical_experts"):
        if len(set(col[name])) > 1:
            raise ValueError(f"{name}: ranks passed different values {dict(zip(ranks, col[name]))}")
    if len({h for h, r in zip(col["config_digest"], ranks) if r in new_ranks}) > 1:
        raise ValueError("config: the ranks of the new group have different EplbConfig settings")
    if len(set(col["num_moe_layers"])) > 1 or len(set(col["num_logical_experts"])) > 1:
        raise ValueError(f"model: ranks disagree on num_moe_layers / num_logical_experts: "
                         f"{dict(zip(ranks, table[:, 3:5].tolist()))}")
    olds = {p for p, r in zip(col["num_physical_experts_old"], ranks) if r in old_ranks}
    if len(olds) != 1:
        raise ValueError(f"model: the old ranks disagree on num_physical_experts: {sorted(olds)}")
    L, N, P_old, M_new = col["num_moe_layers"][0], col["num_logical_experts"][0], olds.pop(), len(new_ranks)
    P_new = col["num_physical_experts"][0] or P_old
    if P_new % M_new:
        lo, hi = P_new // M_new * M_new, -(-P_new // M_new) * M_new
        raise ValueError(f"num_physical_experts: the current {P_new} slots do not divide over "
                         f"{M_new} new ranks; pass num_physical_experts={max(lo, N) if lo >= N else hi} "
                         f"or {hi}")
    if P_new < N:
        raise ValueError(f"num_physical_experts: {P_new} < num_logical_experts ({N})")
    return ResizeSizes(L, N, P_old, P_new, P_old // len(old_ranks), P_new // M_new,
                       nodes_of(new_ranks, ranks_per_node))


def config_digest(config) -> int:
    """62-bit digest of the EplbConfig fields every rank of the new group must share (the
    slot count, node count and initial placement are set by the resize itself); 0: None."""
    if config is None:
        return 0
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("num_redundant_experts", "num_nodes", "initial_placement")}
    digest = hashlib.sha256(repr(sorted(fields.items())).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1) or 1
