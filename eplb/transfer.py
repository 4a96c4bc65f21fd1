"""Moving expert weights from one placement to the next.

Two halves:

* a **pure planner** (numpy only): from the old and new `physical_to_logical` rows of one
  layer it works out, for one rank, which local slots stay, which are filled from an
  expert the rank already holds, which experts arrive from which peer, and what the rank
  sends to whom. Every rank runs the same deterministic computation on the same inputs,
  so sends and receives match by construction, with no negotiation round;
* an **executor** that carries a plan out *into the model's own tensors*: weights are
  written with `copy_` into slot views, so storage and `data_ptr` never change and CUDA
  graphs and registered views stay valid.

Per layer and rank the execution is (after vLLM's `move_to_buffer`/`move_from_buffer`
and SGLang's `update_expert_weights_single_layer`), in two public halves that an
asynchronous caller can run apart (`exchange_layer` in a background thread on a side
stream, `write_layer` at a step boundary):

1. (`exchange_layer`) copy experts needed locally whose only local source slot is about
   to be overwritten into a staging buffer (an in-place write could clobber the source);
2. (`exchange_layer`) move the remote experts into staging, reading the peers' untouched
   weights, through a *transport*: `P2PTransport` (torch.distributed point-to-point, NCCL
   or gloo; per peer and tensor one stream of experts cut into `chunk_bytes` messages,
   sent straight from contiguous slot runs or packed into a bounded, double-buffered pack
   buffer) or `IpcTransport` (same host, CUDA: the receiver copies from the peer's slots
   through CUDA IPC mappings made once); `make_transport("auto")` picks;
3. (`write_layer`) write every changed slot from staging, or straight from an unchanged
   local slot that holds the same expert (unchanged slots are never written, so they are
   safe sources).

A synchronous move over CUDA IPC skips the staging of received experts
(`IpcTransport.move`, used by `execute_layer_transfer`): every rank first copies the old
experts of its changed slots that someone still reads into a *hold buffer* shared with its
peers, and then every received expert is pulled straight into its slot, from the sender's
hold buffer or unchanged slot, while later hold chunks are still being copied. Each byte
crosses NVLink once and is written once (`in_place_ops`, pure, says which copies).

Extra memory: the staging buffer (`staging_rows(plan)` <= S rows, one layer of local
experts; for the IPC transport its hold buffer, allocated once, serves as both) plus, for the point-to-point transport only, pack buffers of at most
2 x `chunk_bytes` per receiving peer when sends need packing, taken from the staging rows
a layer leaves unused when they have room.

Ranks here are *group-relative* (0 .. group size - 1); the executor maps them to global
ranks for torch.distributed. Slot `p` of a layer lives on rank `p // (P // num_ranks)`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from eplb.placement import Placement

__all__ = [
    "LayerTransferPlan",
    "InPlaceOps",
    "in_place_ops",
    "TransferStats",
    "TransferResult",
    "TransferExecutor",
    "assign_senders",
    "plan_layer_transfer",
    "plan_layer_transfers",
    "transfer_stats",
    "execute_layer_transfer",
    "exchange_layer",
    "write_layer",
    "staging_rows",
    "allocate_staging",
    "P2PTransport",
    "IpcTransport",
    "make_transport",
    "DEFAULT_CHUNK_BYTES",
    "TransferVerificationError",
    "slot_checksums",
]


# ==== planning (pure) ==================================================================


@dataclass(frozen=True, eq=False)
class LayerTransferPlan:
    """What one rank does for one layer. Slots are local indices `0 .. S-1`; ranks are
    group-relative. Staging row `k` holds expert `stage_expert[k]`: locally staged rows
    come first (ascending expert), then received rows ordered by (sending rank, expert), so
    the rows from one peer are one contiguous block (received as one stream)."""

    rank: int
    num_ranks: int
    slots_per_rank: int  # S
    unchanged: np.ndarray  # [U] local slots whose expert stays; never written
    stage_expert: np.ndarray  # [K] expert held by each staging row, K <= S
    stage_src_slot: np.ndarray  # [K] local slot copied into the row, -1 for received rows
    stage_src_rank: np.ndarray  # [K] rank the row is received from, -1 for staged rows
    stage_src_peer_slot: np.ndarray  # [K] the sender's local slot the row is read from, -1 for staged rows
    send_expert: np.ndarray  # [T] expert of each send, sorted by (expert, peer)
    send_peer: np.ndarray  # [T] receiving rank
    send_slot: np.ndarray  # [T] local slot the send reads (an old holder of the expert)
    write_dst: np.ndarray  # [W] local slot written (every changed slot exactly once)
    write_src: np.ndarray  # [W] staging row if write_from_stage, else an unchanged local slot
    write_from_stage: np.ndarray  # [W] bool
    write_local: np.ndarray  # [W] bool: the data came from this rank's old slots (no network)
    # the in-place move (`IpcTransport.move`): every rank copies the old experts of
    # `hold_slots` into its hold buffer, then writes each send straight into the
    # receiver's slot, once the receiver has held that slot's old expert
    hold_slots: np.ndarray  # [H] ascending changed local slots whose old expert is read later
    send_hold_row: np.ndarray  # [T] hold row each send reads, -1: send_slot is unchanged (read it)
    send_dst_slot: np.ndarray  # [T] the receiver's slot each send is written to
    send_dst_hold_row: np.ndarray  # [T] the receiver's hold row of that slot, -1: not held

    # ---- sizes and counts ----------------------------------------------------------
    @property
    def num_staged(self) -> int:
        """Staging rows needed (<= S)."""
        return len(self.stage_expert)

    @property
    def recv_rows(self) -> np.ndarray:  # [R]
        return np.flatnonzero(self.stage_src_rank >= 0)

    @property
    def num_held(self) -> int:
        """Hold rows the in-place move needs (<= S)."""
        return len(self.hold_slots)

    @property
    def num_received(self) -> int:
        """Experts received over the network (each once per rank)."""
        return int((self.stage_src_rank >= 0).sum())

    @property
    def num_sent(self) -> int:
        return len(self.send_expert)

    @property
    def num_local_copies(self) -> int:
        """Changed slots filled from an expert this rank already held."""
        return int(self.write_local.sum())

    @property
    def num_slots_written(self) -> int:
        return len(self.write_dst)

    @property
    def is_noop(self) -> bool:
        return len(self.write_dst) == 0 and len(self.send_expert) == 0

    def p2p_ops(self) -> list[tuple[str, int, int, int]]:
        """`(kind, peer, expert, index)` with kind "send" (index: local slot) or "recv"
        (index: staging row), sorted by (expert, kind, peer). Between any two ranks this
        puts the messages of each direction in ascending expert order on both sides."""
        ops = [("send", int(p), int(e), int(s))
               for e, p, s in zip(self.send_expert, self.send_peer, self.send_slot)]
        ops += [("recv", int(self.stage_src_rank[k]), int(self.stage_expert[k]), int(k))
                for k in self.recv_rows]
        ops.sort(key=lambda op: (op[2], op[0], op[1]))
        return ops


def _check_layer(old, new, num_ranks: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray, int]:
    old = np.asarray(old, dtype=np.int64)  # [P]
    new = np.asarray(new, dtype=np.int64)  # [P]
    if old.ndim != 1 or old.shape != new.shape:
        raise ValueError(f"old and new must be 1-D of equal length, got {old.shape} and {new.shape}")
    P = old.shape[0]
    if num_ranks < 1 or P % num_ranks:
        raise ValueError(f"num_slots ({P}) must be divisible by num_ranks ({num_ranks})")
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) must be divisible by num_nodes ({num_nodes})")
    if P and (old.min() < 0 or new.min() < 0):
        raise ValueError("expert ids must be >= 0")
    return old, new, P // num_ranks


def assign_senders(old, new, num_ranks: int, num_nodes: int = 1
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every (receiver rank, expert) that a rank needs but did not hold in `old`,
    choose the one rank that sends it. Returns `(expert [T], receiver [T], sender [T])`
    sorted by (expert, receiver).

    Candidates are the old holders of the expert, restricted to the receiver's node when
    one there holds it (nodes are contiguous blocks of `num_ranks // num_nodes` ranks).
    Greedy and deterministic: pairs with fewer candidates are served first, each by the
    candidate with the fewest sends so far, ties broken by ring distance from the
    receiver, which spreads the sends of one hot expert over all its holders.
    """
    old, new, S = _check_layer(old, new, num_ranks, num_nodes)
    if old.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e.copy(), e.copy()
    num_experts = int(max(old.max(), new.max())) + 1
    rank_of = np.arange(old.shape[0]) // S  # [P]
    held = np.zeros((num_ranks, num_experts), dtype=bool)  # [M, N]
    held[rank_of, old] = True
    wanted = np.zeros((num_ranks, num_experts), dtype=bool)  # [M, N]
    wanted[rank_of, new] = True
    recv_rank, recv_expert = np.nonzero(wanted & ~held)  # [T], [T]
    orphans = np.setdiff1d(recv_expert, np.flatnonzero(held.any(0)))
    if orphans.size:
        raise ValueError(f"experts {orphans.tolist()} are in the new placement but no rank "
                         "holds them in the old one")

    ranks_per_node = num_ranks // num_nodes
    holders = {int(e): np.flatnonzero(held[:, e]).tolist() for e in np.unique(recv_expert)}
    candidates = []
    for r, e in zip(recv_rank.tolist(), recv_expert.tolist()):
        cands = holders[e]
        if num_nodes > 1:
            same = [h for h in cands if h // ranks_per_node == r // ranks_per_node]
            cands = same or cands
        candidates.append(cands)
    order = sorted(range(len(candidates)),
                   key=lambda i: (len(candidates[i]), recv_expert[i], recv_rank[i]))
    load = [0] * num_ranks  # sends chosen so far per rank
    sender = np.empty(len(candidates), dtype=np.int64)  # [T]
    for i in order:
        r = int(recv_rank[i])
        h = min(candidates[i], key=lambda c: (load[c], (c - r) % num_ranks))
        load[h] += 1
        sender[i] = h
    by_expert = np.lexsort((recv_rank, recv_expert))  # [T]
    return (recv_expert[by_expert].astype(np.int64), recv_rank[by_expert].astype(np.int64),
            sender[by_expert])


def _rank_plan(old, new, S: int, num_ranks: int, rank: int,
               assignment: tuple[np.ndarray, np.ndarray, np.ndarray]) -> LayerTransferPlan:
    """Extract `rank`'s plan from the layer rows and the global sender assignment."""
    lo = rank * S
    old_l, new_l = old[lo:lo + S], new[lo:lo + S]  # [S], [S]
    changed = old_l != new_l  # [S]
    a_expert, a_recv, a_send = assignment  # [T] each

    # sends: everything assigned to this rank, read from its first old slot holding the expert
    mine = a_send == rank  # [T]
    send_expert, send_peer = a_expert[mine], a_recv[mine]  # [T'], [T'] already (expert, peer) sorted
    first_slot = first_slot_of_expert(old_l)
    send_slot = np.array([first_slot[e] for e in send_expert.tolist()], dtype=np.int64)  # [T']

    # sources for each expert needed in a changed slot
    keep_slot = _keep_slots(old_l, changed)  # expert -> an unchanged slot holding it
    # received rows ordered by (sender, expert): all rows from one peer form one contiguous
    # block of staging, in the order that peer sends them (ascending expert)
    r_expert, r_from = a_expert[a_recv == rank], a_send[a_recv == rank]  # [R], [R]
    by_peer = np.lexsort((r_expert, r_from))  # [R]
    received = r_expert[by_peer]  # [R]
    recv_from = dict(zip(received.tolist(), r_from[by_peer].tolist()))
    staged_local = _staged_local(new_l, changed, keep_slot, first_slot)
    stage_expert = staged_local + received.tolist()  # [K]
    row_of = {e: k for k, e in enumerate(stage_expert)}
    stage_src_slot = [first_slot[e] for e in staged_local] + [-1] * len(received)
    stage_src_rank = [-1] * len(staged_local) + [recv_from[e] for e in received.tolist()]
    # the sender reads its first old slot holding the expert (as `send_slot` above, on its side)
    peer_first = {q: first_slot_of_expert(old[q * S:(q + 1) * S]) for q in set(recv_from.values())}
    stage_src_peer_slot = [-1] * len(staged_local) + [peer_first[recv_from[e]][e]
                                                      for e in received.tolist()]
    hold_slots = _hold_slots(old_l, new_l, send_slot, first_slot)
    send_hold_row = _hold_rows(hold_slots, send_slot)
    # where each send lands: the receiver's first changed slot wanting the expert (it copies
    # the expert on into further such slots itself), and the receiver's hold row of it
    send_dst_slot = np.zeros(len(send_expert), dtype=np.int64)  # [T']
    send_dst_hold_row = np.zeros(len(send_expert), dtype=np.int64)  # [T']
    for p in np.unique(send_peer).tolist():
        o, n = old[p * S:(p + 1) * S], new[p * S:(p + 1) * S]  # [S], [S]
        first_p = first_slot_of_expert(o)
        dst_of: dict[int, int] = {}
        for d in np.flatnonzero(o != n).tolist():
            dst_of.setdefault(int(n[d]), d)
        p_sends = [first_p[e] for e in a_expert[a_send == p].tolist()]
        mine_p = np.flatnonzero(send_peer == p)
        send_dst_slot[mine_p] = [dst_of[e] for e in send_expert[mine_p].tolist()]
        send_dst_hold_row[mine_p] = _hold_rows(_hold_slots(o, n, p_sends, first_p), send_dst_slot[mine_p])

    write_dst = np.flatnonzero(changed)  # [W]
    write_src, write_from_stage, write_local = [], [], []
    for s in write_dst.tolist():
        e = int(new_l[s])
        direct = e in keep_slot
        write_src.append(keep_slot[e] if direct else row_of[e])
        write_from_stage.append(not direct)
        write_local.append(e in first_slot)  # held locally before: no network involved

    def i64(x) -> np.ndarray:
        return np.asarray(x, dtype=np.int64).reshape(-1)

    return LayerTransferPlan(
        rank=rank, num_ranks=num_ranks, slots_per_rank=S,
        unchanged=np.flatnonzero(~changed),
        stage_expert=i64(stage_expert), stage_src_slot=i64(stage_src_slot),
        stage_src_rank=i64(stage_src_rank), stage_src_peer_slot=i64(stage_src_peer_slot),
        send_expert=i64(send_expert), send_peer=i64(send_peer), send_slot=send_slot,
        write_dst=write_dst.astype(np.int64), write_src=i64(write_src),
        write_from_stage=np.asarray(write_from_stage, dtype=bool).reshape(-1),
        write_local=np.asarray(write_local, dtype=bool).reshape(-1),
        hold_slots=hold_slots, send_hold_row=send_hold_row, send_dst_slot=send_dst_slot,
        send_dst_hold_row=send_dst_hold_row,
    )


def _keep_slots(old_l: np.ndarray, changed: np.ndarray) -> dict[int, int]:
    """expert -> the first unchanged local slot holding it (never written: safe to read)."""
    keep: dict[int, int] = {}
    for s in np.flatnonzero(~changed).tolist():
        keep.setdefault(int(old_l[s]), s)
    return keep


def _staged_local(new_l, changed, keep_slot, first_slot) -> list[int]:
    """Experts a changed slot needs that the rank holds only in changed slots (ascending):
    their first old slot must be copied aside before it is overwritten."""
    return [e for e in np.unique(new_l[changed]).tolist() if e not in keep_slot and e in first_slot]


def _hold_slots(old_l, new_l, send_slots, first_slot: dict[int, int]) -> np.ndarray:
    """`[H]` ascending local slots that change but whose old expert is read afterwards: the
    source of a local copy into another changed slot, or of a send. What one rank holds
    for the in-place move; receivers compute a sender's from the same layer rows."""
    changed = old_l != new_l  # [S]
    local = [first_slot[e] for e in _staged_local(new_l, changed, _keep_slots(old_l, changed), first_slot)]
    sent = [int(s) for s in send_slots if changed[int(s)]]
    return np.array(sorted(set(local) | set(sent)), dtype=np.int64)


def _hold_rows(hold_slots: np.ndarray, slots) -> np.ndarray:
    """`[n]` the hold row of each slot in `slots`, -1 where the slot is not held."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)  # [n]
    pos = np.searchsorted(hold_slots, slots)  # [n]
    pos_c = np.minimum(pos, max(len(hold_slots) - 1, 0))
    hit = (pos < len(hold_slots)) & (hold_slots[pos_c] == slots) if len(hold_slots) else np.zeros(len(slots), bool)
    return np.where(hit, pos, -1).astype(np.int64)


@dataclass(frozen=True)
class InPlaceOps:
    """The receiving side of `IpcTransport.move` for one plan, derived from it (pure).
    Every rank first holds: `hold[i] = w[plan.hold_slots[i]]`. Then, in any order:

    * sends (from the plan): `peer w[send_dst_slot] = hold[send_hold_row]`, or the
      unchanged slot `w[send_slot]` when the row is -1, written by the sender;
    * local writes: `w[local_dst] = hold[local_hold_row]`, or the unchanged slot
      `w[local_src_slot]` when the row is -1;

    and last, once every sender is done, `w[dup_dst] = w[dup_src]` for a received expert
    wanted in more than one slot (`recv_dst` is where its sender writes it).

    Every write goes to a changed slot whose old expert, if anyone still needs it, is held
    already, and every read is of a hold row or an unchanged slot, so no write races a
    read on any rank."""

    recv_peer: np.ndarray  # [R] sending rank of each received expert
    recv_dst: np.ndarray  # [R] the slot its sender writes (its first changed slot wanting it)
    dup_dst: np.ndarray  # [D] further slots for a received expert
    dup_src: np.ndarray  # [D] its recv_dst
    local_dst: np.ndarray  # [W'] changed slots filled from this rank's own old experts
    local_hold_row: np.ndarray  # [W'] hold row read, -1: read local_src_slot
    local_src_slot: np.ndarray  # [W'] the unchanged slot read when local_hold_row is -1


def in_place_ops(plan: LayerTransferPlan) -> InPlaceOps:
    """The receiving side of the in-place move of `plan` (see `InPlaceOps`)."""
    rows = plan.recv_rows  # [R] staging rows of received experts, by (peer, expert)
    st, src, dst = plan.write_from_stage, plan.write_src, plan.write_dst  # [W] each
    recv_dst, dup_dst, dup_src = [], [], []
    for k in rows.tolist():
        slots = dst[st & (src == k)]  # [>= 1] ascending slots wanting the expert of row k
        recv_dst.append(int(slots[0]))
        dup_dst += slots[1:].tolist()
        dup_src += [int(slots[0])] * (len(slots) - 1)
    local = ~(st & np.isin(src, rows))  # [W] not a received expert
    l_dst, l_src, l_st = dst[local], src[local], st[local]
    hold_row = np.full(len(l_dst), -1, dtype=np.int64)  # [W']
    if l_st.any():  # a locally staged row's source slot (stage_src_slot) is held instead
        hold_row[l_st] = _hold_rows(plan.hold_slots, plan.stage_src_slot[l_src[l_st]])
    if (l_st & (hold_row < 0)).any():
        raise RuntimeError("a locally copied expert's source slot is not held")
    i64 = lambda x: np.asarray(x, dtype=np.int64).reshape(-1)  # noqa: E731
    return InPlaceOps(
        recv_peer=plan.stage_src_rank[rows], recv_dst=i64(recv_dst), dup_dst=i64(dup_dst),
        dup_src=i64(dup_src), local_dst=i64(l_dst), local_hold_row=hold_row,
        local_src_slot=i64(np.where(l_st, -1, l_src)))


def plan_layer_transfer(old, new, num_ranks: int, rank: int, num_nodes: int = 1
                        ) -> LayerTransferPlan:
    """The plan of one `rank` for one layer. `old`, `new`: `[P]` physical_to_logical rows.
    O(P) numpy plus a loop over the needed transfers; every rank computes the same sender
    assignment, so the plans of all ranks match without communication."""
    old, new, S = _check_layer(old, new, num_ranks, num_nodes)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} outside [0, {num_ranks})")
    return _rank_plan(old, new, S, num_ranks, rank, assign_senders(old, new, num_ranks, num_nodes))


def plan_layer_transfers(old, new, num_ranks: int, num_nodes: int = 1) -> list[LayerTransferPlan]:
    """The plans of all ranks for one layer (one sender assignment shared by all)."""
    old, new, S = _check_layer(old, new, num_ranks, num_nodes)
    assignment = assign_senders(old, new, num_ranks, num_nodes)
    return [_rank_plan(old, new, S, num_ranks, r, assignment) for r in range(num_ranks)]


@dataclass(frozen=True)
class TransferStats:
    """Whole-model totals over all ranks of a placement change."""

    experts_moved: int  # remote receives: distinct (layer, rank, expert) fetched over the network
    local_copies: int  # changed slots filled from an expert the rank already held
    slots_changed: int  # slots whose expert changes (each written once)
    bytes_moved: int | None = None  # experts_moved * bytes_per_expert, when given


def _as_p2l(x) -> np.ndarray:  # [L, P]
    p2l = x.physical_to_logical if isinstance(x, Placement) else np.asarray(x, dtype=np.int64)
    if p2l.ndim == 1:
        p2l = p2l[None]
    if p2l.ndim != 2:
        raise ValueError(f"physical_to_logical must be [L, P], got shape {p2l.shape}")
    return p2l


def transfer_stats(old, new, num_ranks: int, bytes_per_expert: int | None = None) -> TransferStats:
    """Count what moving `old [L, P]` to `new [L, P]` costs (Placements are accepted).
    Matches the sums of `plan_layer_transfers` over ranks and layers; vectorized."""
    old, new = _as_p2l(old), _as_p2l(new)  # [L, P], [L, P]
    if old.shape != new.shape:
        raise ValueError(f"old {old.shape} and new {new.shape} differ in shape")
    L, P = old.shape
    if num_ranks < 1 or P % num_ranks:
        raise ValueError(f"num_slots ({P}) must be divisible by num_ranks ({num_ranks})")
    if old.size == 0:
        return TransferStats(0, 0, 0, 0 if bytes_per_expert is not None else None)
    N = int(max(old.max(), new.max())) + 1
    rank_of = np.arange(P) // (P // num_ranks)  # [P]
    key_base = (np.arange(L)[:, None] * num_ranks + rank_of[None, :]) * N  # [L, P]
    held = np.unique(key_base + old)  # [H] (layer, rank, expert) keys held before
    changed = old != new  # [L, P]
    need = (key_base + new)[changed]  # [C] keys written
    local = np.isin(need, held)  # [C]
    moved = int(np.unique(need[~local]).size)
    return TransferStats(
        experts_moved=moved, local_copies=int(local.sum()), slots_changed=int(changed.sum()),
        bytes_moved=None if bytes_per_expert is None else moved * int(bytes_per_expert),
    )


# ==== execution (torch.distributed) ====================================================

DEFAULT_CHUNK_BYTES = 1 << 30
"""Largest message of the point-to-point transport, in bytes (`P2PTransport.chunk_bytes`).
Chosen by measurement on 2 x H200 (benchmarks/results/transfer-2026-11-30.md): one layer
of DeepSeek-V3 experts swapped between 2 GPUs reached 0.44 / 0.64 / 0.75 / 0.90 of the raw
peer copy with 16 MiB / 64 MiB / 256 MiB / 1 GiB messages."""

DEFAULT_HOLD_CHUNK_BYTES = 2 << 30
"""Granularity of `IpcTransport.move`'s pipeline: a receiver tells its senders when each
`hold_chunk_bytes` of its hold buffer is filled, and they write into those slots while it
holds the next chunk. Chosen by measurement on 2 x H200 (benchmarks/README.md, one layer
of DeepSeek-V3 experts swapped): 0.66 / 0.85 / 0.91 / 0.78 of the raw peer copy with
128 MiB / 512 MiB / 2 GiB / 16 GiB (one chunk: no overlap) chunks."""

AUTO_PREFERS_IPC = True
"""`make_transport("auto")` picks CUDA IPC when every rank is on one host with CUDA weights
and an NCCL group (measured faster there on 2 x H200, one DeepSeek-V3 layer: exchange 0.93
vs 0.89 of the raw peer copy for a whole-layer swap, 0.86 vs 0.79 for a 25% change; a
synchronous move in place 0.90 against 0.75 for NCCL's exchange and write); otherwise
NCCL (or gloo) point-to-point."""


def staging_rows(plan: LayerTransferPlan) -> int:
    """Staging rows `exchange_layer` needs for `plan` (`plan.num_staged`, at most S)."""
    return plan.num_staged


def allocate_staging(weights: Sequence[torch.Tensor], rows: int | None = None) -> list[torch.Tensor]:
    """A contiguous staging buffer for one layer: per weight tensor `[rows, ...]`
    (default `rows = S`, one layer of local experts), same dtype and device."""
    return [torch.empty((w.shape[0] if rows is None else rows, *w.shape[1:]),
                        dtype=w.dtype, device=w.device) for w in weights]


def _check_staging(staging: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], rows: int) -> None:
    if len(staging) != len(weights):
        raise ValueError(f"staging has {len(staging)} tensors, the layer has {len(weights)}")
    for i, (b, w) in enumerate(zip(staging, weights)):
        if (b.shape[1:] != w.shape[1:] or b.shape[0] < rows or b.dtype != w.dtype
                or b.device != w.device or not b.is_contiguous()):
            raise ValueError(
                f"staging[{i}] must be contiguous [>= {rows}, {', '.join(map(str, w.shape[1:]))}] "
                f"{w.dtype} on {w.device}; got {tuple(b.shape)} {b.dtype} on {b.device}")


def _check_weights(plan: LayerTransferPlan, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    weights = list(weights)
    for i, w in enumerate(weights):
        if w.shape[0] != plan.slots_per_rank:
            raise ValueError(f"weights[{i}] has {w.shape[0]} slots, the plan expects {plan.slots_per_rank}")
    return weights


def _global_rank(group, rank: int) -> int:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _runs(a, b) -> list[tuple[int, int, int]]:
    """Split paired index arrays into maximal runs where both step by +1: `(a0, b0, n)`,
    so one `copy_` of `n` consecutive slots/rows replaces `n` single-slot copies."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)  # [n], [n]
    if a.size == 0:
        return []
    cut = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [a.size]])
    return [(int(a[s]), int(b[s]), int(e - s)) for s, e in zip(starts, ends)]


def _stage_local(plan: LayerTransferPlan, weights, staging) -> None:
    """Phase 1: local sources that will be overwritten go to their staging rows."""
    rows = np.flatnonzero(plan.stage_src_slot >= 0)  # [K_local]
    for src, row, n in _runs(plan.stage_src_slot[rows], rows):
        for w, b in zip(weights, staging):
            b[row:row + n].copy_(w[src:src + n])


def _peer_blocks(plan: LayerTransferPlan) -> list[tuple[int, int, int]]:
    """`(peer, first staging row, rows)` per sending peer: the plan orders received rows by
    (peer, expert), so each peer's rows are one block, in the order the peer sends them."""
    rows = plan.recv_rows  # [R]
    peers = plan.stage_src_rank[rows]  # [R]
    out = []
    for q in np.unique(peers).tolist():
        mine = rows[peers == q]
        if mine[-1] - mine[0] + 1 != mine.size:
            raise RuntimeError(f"staging rows received from rank {q} are not contiguous")
        out.append((q, int(mine[0]), int(mine.size)))
    return out


def _send_lists(plan: LayerTransferPlan) -> list[tuple[int, np.ndarray]]:
    """`(peer, slots [n])` per receiving peer, slots in ascending expert order (the order in
    which that peer's staging block holds them)."""
    return [(q, plan.send_slot[plan.send_peer == q]) for q in np.unique(plan.send_peer).tolist()]


def _copy_flat_range(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """`dst[:] = src.flatten()[lo:hi]` (row-major) without materialising `src`; `dst` is 1-D
    contiguous of length `hi - lo`, `src` may have any strides (a non-contiguous view)."""
    if hi <= lo:
        return
    if src.is_contiguous():
        dst.copy_(src.view(-1)[lo:hi])
        return
    if src.dim() <= 1:
        dst.copy_(src.reshape(-1)[lo:hi] if src.dim() == 0 else src[lo:hi])
        return
    inner = src[0].numel()
    first, last = -(-lo // inner), hi // inner  # whole rows [first, last)
    if first > last:  # lo and hi inside one row
        r = lo // inner
        _copy_flat_range(dst, src[r], lo - r * inner, hi - r * inner)
        return
    pos = 0
    if lo < first * inner:  # partial head row
        pos = first * inner - lo
        _copy_flat_range(dst[:pos], src[first - 1], inner - pos, inner)
    if last > first:
        n = (last - first) * inner
        dst[pos:pos + n].view(last - first, *src.shape[1:]).copy_(src[first:last])
        pos += n
    if hi > last * inner:  # partial tail row
        _copy_flat_range(dst[pos:], src[last], 0, hi - last * inner)


def _direct_view(w: torch.Tensor, slots: np.ndarray, E: int, lo: int, hi: int) -> torch.Tensor | None:
    """Elements `[lo, hi)` of the stream `concat(w[slots[j]].flatten())` as a view of `w`,
    when they lie in consecutive slots of a contiguous region; else None (pack them)."""
    j0, j1 = lo // E, (hi - 1) // E
    s0 = int(slots[j0])
    if j1 > j0 and not np.array_equal(slots[j0:j1 + 1], np.arange(s0, s0 + j1 - j0 + 1)):
        return None
    block = w[s0:s0 + j1 - j0 + 1]
    if not block.is_contiguous():
        return None
    return block.view(-1)[lo - j0 * E:hi - j0 * E]


def _gather(dst: torch.Tensor, w: torch.Tensor, slots: np.ndarray, E: int, lo: int, hi: int) -> None:
    """Pack elements `[lo, hi)` of the stream `concat(w[slots[j]].flatten())` into the 1-D
    contiguous `dst`, one copy per run of consecutive slots."""
    j0, j1 = lo // E, (hi - 1) // E
    pos, j = 0, j0
    while j <= j1:
        k = j
        while k < j1 and slots[k + 1] == slots[k] + 1:
            k += 1
        start = lo - j * E if j == j0 else 0  # within expert j
        end = (k - j) * E + (hi - k * E if k == j1 else E)  # within the run j..k
        s = int(slots[j])
        _copy_flat_range(dst[pos:pos + end - start], w[s:s + k - j + 1], start, end)
        pos += end - start
        j = k + 1


class _Arena:
    """Pack buffers carved first from the staging rows this layer does not use (rows
    `K ..` of a staging buffer allocated for S rows), then freshly allocated."""

    def __init__(self, staging: list[torch.Tensor], rows_used: int) -> None:
        self.free = []  # [uint8 region, bytes taken]
        for b in staging:
            if b.shape[0] > rows_used:
                self.free.append([b.view(-1)[rows_used * b[0].numel():].view(torch.uint8), 0])

    def take(self, nbytes: int, device) -> tuple[torch.Tensor, bool]:
        """A uint8 buffer of `nbytes` at a 16-byte aligned address (viewable as any dtype);
        True if freshly allocated."""
        for region in self.free:
            start = region[1] + (-(region[0].data_ptr() + region[1])) % 16
            if start + nbytes <= region[0].numel():
                region[1] = start + nbytes
                return region[0][start:start + nbytes], False
        return torch.empty(nbytes, dtype=torch.uint8, device=device), True


class P2PTransport:
    """Point-to-point exchange over the group's backend (NCCL on GPUs, gloo on CPU),
    coalesced per peer and chunked.

    Between two ranks and for each weight tensor, the experts one sends the other form ONE
    stream (ascending expert; on the receiver one contiguous block of staging rows, see
    `LayerTransferPlan`), cut into messages of at most `chunk_bytes`. Both sides derive the
    same cuts from counts they share, so no sizes are exchanged. Message `r` of every
    stream of a rank goes into round `r` (one `batch_isend_irecv`); rounds run back to back,
    stream-ordered on CUDA (no host wait). Receives land straight in staging. A send whose
    experts sit in consecutive slots of a contiguous tensor is a view of the weights;
    anything else (scattered slots, non-contiguous views) is packed into a pack buffer,
    double-buffered per peer, taken from the staging rows the layer leaves unused (staging
    allocated for S rows, fewer needed) or else allocated: extra memory beyond staging is
    at most `2 * chunk_bytes` per receiving peer, and none when every send is direct or
    the unused staging rows hold the pack buffers.

    `last_messages`, `last_pack_bytes`: messages posted and pack memory allocated beyond
    staging by the last `exchange` (for benchmarks and tests).
    """

    name = "nccl"
    exchange_launches_no_kernels = False  # NCCL kernels on the group (none on gloo)

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        self.chunk_bytes = int(chunk_bytes)
        self.last_messages = 0
        self.last_pack_bytes = 0

    def __repr__(self) -> str:
        return f"P2PTransport(chunk_bytes={self.chunk_bytes})"

    def _messages(self, n: int, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """`(tensor, lo, hi)` element ranges of the stream of `n` experts, per tensor in
        order, each at most `chunk_bytes` (at least one element)."""
        out = []
        for i, (E, itemsize) in enumerate(sizes):
            total, step = n * E, max(1, self.chunk_bytes // itemsize)
            out += [(i, a, min(a + step, total)) for a in range(0, total, step)]
        return out

    @torch.no_grad()
    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        _stage_local(plan, weights, staging)
        sizes = [(w[0].numel(), w.element_size()) for w in weights]  # per tensor (E, itemsize)
        sends = []  # (global peer, slots, [(tensor, lo, hi, view or None)])
        pack_need: dict[int, int] = {}  # peer -> largest packed message (bytes)
        for q, slots in _send_lists(plan):
            msgs = []
            for i, lo, hi in self._messages(len(slots), sizes):
                view = _direct_view(weights[i], slots, sizes[i][0], lo, hi)
                if view is None:
                    pack_need[q] = max(pack_need.get(q, 0), (hi - lo) * sizes[i][1])
                msgs.append((i, lo, hi, view))
            sends.append((q, _global_rank(group, q), slots, msgs))
        recvs = [(_global_rank(group, q), row0, n, self._messages(n, sizes))
                 for q, row0, n in _peer_blocks(plan)]
        rounds = max([len(m) for *_, m in sends] + [len(m) for *_, m in recvs] + [0])
        self.last_messages, self.last_pack_bytes = 0, 0
        if rounds == 0:
            return 0

        import torch.distributed as dist

        arena = _Arena(staging, plan.num_staged)
        banks: list[dict[int, torch.Tensor]] = [{}, {}]  # per round parity: peer -> uint8 buffer
        pending: list[tuple[list, list]] = []  # per round: (works, tensors kept alive)
        received = 0
        for r in range(rounds):
            if r >= 2:  # its pack buffers are reused now: round r - 2 must be done with them
                for work in pending[r - 2][0]:
                    work.wait()
                pending[r - 2] = ([], [])
            ops, keep = [], []
            for q, gq, slots, msgs in sends:
                if r >= len(msgs):
                    continue
                i, lo, hi, t = msgs[r]
                if t is None:
                    w = weights[i]
                    buf = banks[r % 2].get(q)
                    if buf is None:
                        buf, fresh = arena.take(pack_need[q], w.device)
                        banks[r % 2][q] = buf
                        self.last_pack_bytes += buf.numel() if fresh else 0
                    t = buf[:(hi - lo) * sizes[i][1]].view(w.dtype)
                    _gather(t, w, slots, sizes[i][0], lo, hi)
                ops.append(dist.P2POp(dist.isend, t, gq, group))
                keep.append(t)
            for gq, row0, n, msgs in recvs:
                if r >= len(msgs):
                    continue
                i, lo, hi = msgs[r]
                t = staging[i][row0:row0 + n].view(-1)[lo:hi]
                ops.append(dist.P2POp(dist.irecv, t, gq, group))
                keep.append(t)
                received += t.nbytes
            self.last_messages += len(ops)
            pending.append((dist.batch_isend_irecv(ops) if ops else [], keep))
        for works, _keep in pending[-2:]:
            for work in works:
                work.wait()
        return received

    def settle(self, plan: LayerTransferPlan, group) -> None:
        """Nothing to do: a rank's own sends completed (stream-ordered) inside `exchange`."""


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _weights_key(weights: Sequence[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype) for w in weights)


class IpcTransport:
    """CUDA IPC (same host): every rank maps the expert tensors of every peer once
    (`reduce_tensor` handles, one `all_gather_object`; mapped on the rank's own GPU, see
    `_open`), and a receiver copies the experts it needs straight from the peer's old slots
    into its staging rows (`copy_` over NVLink, one copy per run of consecutive slots, on
    its own GPU), with no NCCL kernels and no pack buffer.

    Per layer, in `exchange`: the receiver knows from its plan which slot of which peer
    holds each expert (`stage_src_peer_slot`), so no NCCL message is needed. It waits
    for a token from every peer it pulls from (gloo, on the transport's own CPU group),
    which that peer sends once everything already queued on its current stream (e.g. an
    earlier write of those slots) has completed; then it pulls and synchronizes its
    current stream, so on return its reads are done. No NCCL kernel is launched, so an
    exchange in a background thread never interleaves with the model's NCCL collectives
    (with the tiny NCCL slot messages this transport used before, an asynchronous
    rebalance over IPC could hang beside the model's all-to-all on 2 x H200).
    A rank must not overwrite slots a peer reads before that peer's `exchange` returned:
    `settle` (used by `execute_layer_transfer`) waits for a token from every puller; a
    caller with its own barrier between exchange and write on all ranks may skip it.

    `move` does a whole synchronous layer transfer in place, each sender writing straight
    into its receivers' slots, through a hold buffer of each rank's own (`hold=True`, when
    all layers have the same tensor shapes): one layer of local experts, allocated at
    construction and kept; `hold` exposes it so a caller can use it as its staging buffer
    too (the runtime does). `hold_chunk_bytes`: the pipeline's granularity (equal on all
    ranks).

    Construction is collective over `group` (every rank, same layers); it raises on every
    rank when IPC cannot work (ranks on different hosts, a peer GPU not visible, non-CUDA
    weights, shapes differing between ranks). Costs: the hold buffer, and the peers'
    mappings (address space, no memory).
    """

    name = "ipc"
    exchange_launches_no_kernels = True  # `exchange` may run beside the model's collectives

    def __init__(self, expert_weights: Sequence[Sequence[torch.Tensor]], group=None,
                 timeout: float | None = None, *, hold: bool = True,
                 hold_chunk_bytes: int = DEFAULT_HOLD_CHUNK_BYTES) -> None:
        import socket

        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        layers = [list(ws) for ws in expert_weights]
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        problem = None
        if not layers or not layers[0]:
            problem = "no expert weights given"
        elif any(w.device.type != "cuda" for ws in layers for w in ws):
            problem = "expert weights are not all CUDA tensors"
        elif dist.get_backend(group) != "nccl":
            problem = f"the group's backend is {dist.get_backend(group)}, not nccl"
        info = {"problem": problem, "host": socket.gethostname()}
        self.hold: list[torch.Tensor] | None = None  # [S, ...] per tensor, for `move`
        if problem is None:
            self.device = layers[0][0].device
            info["uuid"] = _uuid(self.device)
            info["layout"] = [[(tuple(w.shape), w.dtype) for w in ws] for ws in layers]
            # one set of handles per consumer: each share counts one reference that the
            # consumer gives back when it drops its mapping (torch's CUDA IPC ref counting)
            info["handles"] = {q: [[reduce_tensor(w.detach()) for w in ws] for ws in layers]
                               for q in range(self.num_ranks) if q != self.rank}
            # the hold buffer of `move` (one layer of local experts), when every layer has
            # the same tensor shapes (the layouts are equal on all ranks, checked below)
            if hold and all(ws_l == info["layout"][0] for ws_l in info["layout"]):
                try:
                    self.hold = allocate_staging(layers[0])
                except RuntimeError as e:  # e.g. out of memory: reported on every rank
                    info["problem"] = f"hold buffer: {type(e).__name__}: {e}"
        infos: list = [None] * self.num_ranks
        dist.all_gather_object(infos, info, group=group)
        bad = [f"rank {q}: {x['problem']}" for q, x in enumerate(infos) if x["problem"]]
        if not bad and len({x["host"] for x in infos}) > 1:
            bad = [f"ranks on several hosts {sorted({x['host'] for x in infos})}"]
        if not bad and any(x["layout"] != info["layout"] for x in infos):
            bad = ["expert tensor shapes or dtypes differ between ranks"]
        self._peers: dict[int, list[list[torch.Tensor]]] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}  # per peer, on this GPU
        if not bad:
            try:
                local = {_uuid(torch.device("cuda", d)): d for d in range(torch.cuda.device_count())}
                for q, x in enumerate(infos):
                    if q == self.rank:
                        continue
                    dev = local.get(x["uuid"])
                    if dev is None:
                        raise RuntimeError(f"rank {q}'s GPU {x['uuid']} is not visible in this "
                                           "process (CUDA_VISIBLE_DEVICES)")
                    self._peers[q] = [[self._open(h, self.device.index) for h in hs]
                                      for hs in x["handles"][self.rank]]
                    self._streams[q] = torch.cuda.Stream(self.device)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                bad = [f"rank {self.rank}: {type(e).__name__}: {e}"]
        verdicts: list = [None] * self.num_ranks
        dist.all_gather_object(verdicts, bad, group=group)
        bad = [b for v in verdicts for b in v]
        if bad:
            self._peers.clear()
            raise RuntimeError("CUDA IPC transport unavailable: " + "; ".join(dict.fromkeys(bad)))
        self._layer_of = {_weights_key(ws): l for l, ws in enumerate(layers)}
        self.last_messages = 0
        if isinstance(hold_chunk_bytes, bool) or not isinstance(hold_chunk_bytes, int) or hold_chunk_bytes < 1:
            raise ValueError(f"hold_chunk_bytes must be a positive integer, got {hold_chunk_bytes!r}")
        self.hold_chunk_bytes = hold_chunk_bytes
        self._can_move = self.hold is not None  # the same verdict on every rank
        self.moves = 0  # layers moved in place so far (`move` calls with work)
        from eplb.control import new_group_like

        # the "slots settled" tokens: CPU messages, so a background exchange launches no
        # NCCL kernel (`timeout`: how long a token may take before the exchange fails)
        self._cpu_group = new_group_like(group, "gloo", timeout)

    @staticmethod
    def _open(handle, device_index: int) -> torch.Tensor:
        """Map a peer's tensor into this GPU's context (`cudaIpcOpenMemHandle` with lazy
        peer access, from `device_index`): the tensor lives in the peer's memory but torch
        sees it on this GPU, so a `copy_` to or from it is a plain copy on this GPU's
        current stream, reading or writing the peer's memory over NVLink. No work of this
        process ever runs on the peer's GPU, where it would be time-sliced against the
        peer process's own kernels and copies (a GPU runs one process's context at a
        time): on 2 x H200 a move whose copies ran on the peer's GPU lost the overlap of
        the two GPUs' copies."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        fn, args = handle
        if fn is not rebuild_cuda_tensor:
            raise RuntimeError(f"unexpected IPC handle rebuilt by {fn!r}")
        args = list(args)
        args[0], args[6], args[10] = torch.Tensor, device_index, False  # plain tensor, local index, no grad
        return fn(*args)

    def __repr__(self) -> str:
        return f"IpcTransport(rank={self.rank}, peers={sorted(self._peers)})"

    def close(self) -> None:
        """Drop this process's mappings of the peers' tensors (this rank's hold buffer stays
        until the transport is deleted). Shutdown order: every rank calls `close()`, then
        a barrier, then the weights and the transport may be freed (follow with
        `torch.cuda.ipc_collect()`); a producer that frees or exits while a peer still maps
        its memory keeps it in torch's IPC limbo, and freeing that at interpreter exit can
        abort the process ("driver shutting down"). Not collective; the transport's CPU
        group goes with the process group (or `torch.distributed.destroy_process_group`)."""
        self._peers.clear()
        self._streams.clear()
        self._layer_of = {}
        self._can_move = False

    def _layer(self, weights: Sequence[torch.Tensor]) -> int:
        layer = self._layer_of.get(_weights_key(weights))
        if layer is None:
            raise ValueError("these expert weights were not registered with the IPC transport "
                             "(make_transport got other tensors, or it was closed)")
        return layer

    @torch.no_grad()
    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        import torch.distributed as dist

        layer = self._layer(weights)
        _stage_local(plan, weights, staging)
        sends, blocks = _send_lists(plan), _peer_blocks(plan)
        self.last_messages = len(sends) + len(blocks)
        if not sends and not blocks:
            return 0
        if sends:  # the slots my receivers read hold what was queued before: tell them
            torch.cuda.current_stream(self.device).synchronize()
        cpu = self._cpu_group
        works = [dist.isend(torch.ones(1), _global_rank(cpu, q), group=cpu) for q, _s in sends]
        works += [dist.irecv(torch.empty(1), _global_rank(cpu, q), group=cpu) for q, _r, _n in blocks]
        for work in works:
            work.wait()
        received = 0
        for q, row0, n in blocks:
            slots = plan.stage_src_peer_slot[row0:row0 + n]  # [n] the peer's local slots
            peer = self._peers[q][layer]
            stream = self._streams[q]  # one stream per peer: pulls from several peers overlap
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for s0, r0, m in _runs(slots, np.arange(row0, row0 + n)):
                    for b, pw in zip(staging, peer):
                        b[r0:r0 + m].copy_(pw[s0:s0 + m])
                        received += b[r0:r0 + m].nbytes
        for q, _r, _n in blocks:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[q])
        torch.cuda.current_stream(self.device).synchronize()  # every read of peer memory done
        return received

    @property
    def hold_bytes(self) -> int:
        """GPU memory of the hold buffer (allocated at construction; 0 without one)."""
        return 0 if self.hold is None else sum(b.nbytes for b in self.hold)

    def can_move(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether `move` can carry out a layer of these (registered) weights."""
        return self._can_move and _weights_key(weights) in self._layer_of

    @torch.no_grad()
    def move(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group) -> int:
        """Carry out `plan` in place in one pass, with no staging of received experts:
        the whole layer transfer of a synchronous rebalance (`execute_layer_transfer`).
        Returns bytes received. Every rank with a non-noop plan calls it.

        1. hold: copy the old experts of `plan.hold_slots` (changed slots whose expert is
           still sent or copied locally) into this rank's hold buffer, in chunks of about
           `hold_chunk_bytes`, on the current stream; then the local writes;
        2. as each hold chunk completes, tell the ranks that write into those slots (a CPU
           token on the gloo group); on each token from a receiver, write the experts that
           go into that chunk of its slots straight there (`send_dst_slot`), from this
           rank's hold rows or unchanged slots, on a per-peer stream of this GPU. Writing
           into a peer's chunk k overlaps holding chunk k+1 on both GPUs. The copies are
           pushes, run by this process on its own GPU, so they never share a GPU with
           another process's work (a pull issued on the peer's GPU would be time-sliced
           against that peer's hold copies);
        3. wait for the pushes and tell the receivers; wait for every sender's word, then
           copy a received expert into any further slot that wants it. On return no peer
           writes this rank's slots any more and nothing reads this rank's hold buffer.
        """
        import torch.distributed as dist

        layer = self._layer(weights)
        if not self._can_move:
            raise RuntimeError("this IPC transport has no hold buffer (hold=False, layers of "
                               "different shapes, or closed): use exchange/settle/write_layer")
        ops = in_place_ops(plan)
        cur = torch.cuda.current_stream(self.device)
        expert_bytes = sum(w[0].nbytes for w in weights)
        rows = max(1, self.hold_chunk_bytes // expert_bytes)  # hold rows per chunk
        H = plan.num_held
        events = []  # [chunks] hold chunk c done (and, with it, everything queued before)
        for c in range(max(1, -(-H // rows))):
            lo, hi = c * rows, min(H, (c + 1) * rows)
            for s0, r0, n in _runs(plan.hold_slots[lo:hi], np.arange(lo, hi)):
                for w, b in zip(weights, self.hold):
                    b[r0:r0 + n].copy_(w[s0:s0 + n])
            events.append(torch.cuda.Event())
            events[-1].record(cur)
        from_hold = ops.local_hold_row >= 0  # [W']
        for d0, r0, n in _runs(ops.local_dst[from_hold], ops.local_hold_row[from_hold]):
            for w, b in zip(weights, self.hold):
                w[d0:d0 + n].copy_(b[r0:r0 + n])
        for d0, s0, n in _runs(ops.local_dst[~from_hold], ops.local_src_slot[~from_hold]):
            for w in weights:
                w[d0:d0 + n].copy_(w[s0:s0 + n])

        # token c from a receiver: its hold chunk c is done, so the slots held there (and,
        # for c = 0, the slots it does not hold) may be written
        send_chunk = np.maximum(plan.send_dst_hold_row, 0) // rows  # [T] token each send waits for
        out_last = {p: int(send_chunk[plan.send_peer == p].max()) for p in np.unique(plan.send_peer).tolist()}
        recv_rows = _hold_rows(plan.hold_slots, ops.recv_dst)  # [R]
        recv_chunk = np.maximum(recv_rows, 0) // rows  # [R]
        in_last = {q: int(recv_chunk[ops.recv_peer == q].max()) for q in np.unique(ops.recv_peer).tolist()}

        cpu = self._cpu_group
        works, tokens = [], 0
        for c in range(max([-1, *out_last.values(), *in_last.values()]) + 1):
            senders = [q for q, last in sorted(in_last.items()) if last >= c]
            if senders:
                events[c].synchronize()  # my hold chunk c (for c = 0: all earlier work) done
                for q in senders:
                    works.append(dist.isend(torch.tensor([c]), _global_rank(cpu, q), group=cpu, tag=1))
            for p in [p for p, last in sorted(out_last.items()) if last >= c]:
                got = torch.empty(1, dtype=torch.int64)
                dist.recv(got, _global_rank(cpu, p), group=cpu, tag=1)
                tokens += 1
                if int(got) != c:
                    raise RuntimeError(f"in-place move of layer {layer}: rank {p} sent token "
                                       f"{int(got)}, expected {c} (plans differ between ranks)")
                self._push(p, layer, plan, np.flatnonzero((plan.send_peer == p) & (send_chunk == c)),
                           rows, events, weights)
        for p in out_last:  # my writes into p are done: tell p
            self._streams[p].synchronize()
            works.append(dist.isend(torch.ones(1), _global_rank(cpu, p), group=cpu, tag=2))
        works += [dist.irecv(torch.empty(1), _global_rank(cpu, q), group=cpu, tag=2) for q in in_last]
        for work in works:
            work.wait()
        for d, src in zip(ops.dup_dst.tolist(), ops.dup_src.tolist()):  # every sender is done
            for w in weights:
                w[d].copy_(w[src])
        self.last_messages = tokens + len(in_last) + len(out_last)
        self.moves += 1
        return len(ops.recv_peer) * expert_bytes

    def _push(self, p: int, layer: int, plan: LayerTransferPlan, idx: np.ndarray, rows: int,
              events: list, weights: list[torch.Tensor]) -> None:
        """Queue the sends `idx` (indices into `plan.send_*`) to rank `p` on the per-peer
        stream: each expert from its hold row (after that hold chunk) or unchanged slot into
        the receiver's slot."""
        if idx.size == 0:
            return
        stream = self._streams[p]
        src_rows = plan.send_hold_row[idx]  # [n]
        if (src_rows >= 0).any():
            stream.wait_event(events[int(src_rows.max()) // rows])
        dst, slots = plan.send_dst_slot[idx], plan.send_slot[idx]  # [n], [n]
        held = src_rows >= 0
        peer = self._peers[p][layer]
        with torch.cuda.stream(stream):  # the peer's tensors are mapped on this GPU (`_open`)
            for d0, r0, n in _runs(dst[held], src_rows[held]):
                for pw, b in zip(peer, self.hold):
                    pw[d0:d0 + n].copy_(b[r0:r0 + n])
            for d0, s0, n in _runs(dst[~held], slots[~held]):
                for pw, w in zip(peer, weights):
                    pw[d0:d0 + n].copy_(w[s0:s0 + n])

    def settle(self, plan: LayerTransferPlan, group) -> None:
        """Pairwise, stream-ordered: send a token to every rank this rank pulled from and make
        the current stream wait for a token from every rank that pulls from this rank; writes
        queued after it cannot overwrite slots a peer still reads."""
        import torch.distributed as dist

        pulled = [q for q, _r, _n in _peer_blocks(plan)]
        pullers = [q for q, _s in _send_lists(plan)]
        if not pulled and not pullers:
            return
        ops = [dist.P2POp(dist.isend, torch.ones(1, dtype=torch.int64, device=self.device),
                          _global_rank(group, q), group) for q in pulled]
        ops += [dist.P2POp(dist.irecv, torch.empty(1, dtype=torch.int64, device=self.device),
                           _global_rank(group, q), group) for q in pullers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


TRANSPORTS = ("nccl", "ipc", "auto")


def make_transport(kind: str = "auto", expert_weights: Sequence[Sequence[torch.Tensor]] | None = None,
                   group=None, *, chunk_bytes: int | None = None, timeout: float | None = None):
    """A transport for `exchange_layer(..., transport=...)`.

    `kind`: "nccl" (point-to-point over the group's backend: NCCL on GPUs, gloo on CPU,
    `P2PTransport(chunk_bytes)`), "ipc" (`IpcTransport`, raises where it cannot work) or
    "auto" (IPC when every rank is on one host with CUDA weights and an NCCL group and
    `AUTO_PREFERS_IPC`, else "nccl"). "ipc" and "auto" are collective over `group`
    (call on every rank, once, with every layer's weights: the weights are registered).
    `timeout`: seconds the IPC transport's CPU tokens may wait for a peer (None: the default
    of torch.distributed).
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
    p2p = P2PTransport(DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    if kind == "nccl":
        return p2p
    if expert_weights is None:
        raise ValueError(f"expert_weights is required for transport {kind!r}")
    import torch.distributed as dist

    if kind == "auto":
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return p2p
        mine = AUTO_PREFERS_IPC and dist.get_backend(group) == "nccl" and all(
            w.device.type == "cuda" for ws in expert_weights for w in ws)
        votes: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, bool(mine), group=group)
        if not all(votes):
            return p2p
        try:
            return IpcTransport(expert_weights, group, timeout)
        except RuntimeError as e:  # raised on every rank alike
            import logging

            logging.getLogger("eplb.transfer").info("auto transport: NCCL (%s)", e)
            return p2p
    return IpcTransport(expert_weights, group, timeout)


def _resolve(transport):
    if transport is None or transport == "nccl":
        return P2PTransport()
    if isinstance(transport, str):
        raise ValueError(f"transport {transport!r} needs set-up: pass the object from "
                         f"make_transport({transport!r}, expert_weights, group) (collective)")
    if not (hasattr(transport, "exchange") and hasattr(transport, "settle")):
        raise ValueError(f"transport must be None, 'nccl' or a transport object, got {transport!r}")
    return transport


def exchange_layer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor], group,
                   staging: Sequence[torch.Tensor], *, transport=None) -> int:
    """Phases 1 and 2 of one layer: fill staging rows `0 .. plan.num_staged - 1` (local
    copies of sources that will be overwritten, and the experts received from peers).
    Reads `weights` and never writes them. Returns bytes received.

    On CUDA the work may be left queued on the current stream (like NCCL's `work.wait()`):
    staging is ready once an event recorded on the current stream afterwards completes. It
    never touches the default stream explicitly nor synchronizes the device, so it may run
    in a background thread with a side stream current.
    `transport`: None or "nccl" (`P2PTransport` with `DEFAULT_CHUNK_BYTES`), or an object
    from `make_transport`. Every rank of `group` with a non-noop plan for the layer must
    call it (plans of all ranks come from the same rows); noop ranks may skip it.
    """
    weights = _check_weights(plan, weights)
    if plan.is_noop:
        return 0
    if staging is None:
        raise ValueError("staging is required: allocate_staging(weights, staging_rows(plan))")
    staging = list(staging)
    _check_staging(staging, weights, plan.num_staged)
    return _resolve(transport).exchange(plan, weights, group, staging)


@torch.no_grad()
def write_layer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                staging: Sequence[torch.Tensor]) -> None:
    """Phase 3 of one layer, on the current stream: write every changed slot from its staging
    row or from an unchanged local slot holding the same expert (one `copy_` per run of
    consecutive slots); unchanged slots are never written, storage and `data_ptr` stay."""
    weights = _check_weights(plan, weights)
    st = plan.write_from_stage  # [W]
    if st.any():  # staging is only read when some slot comes from it
        staging = list(staging)
        _check_staging(staging, weights, plan.num_staged)
    for dst, src, n in _runs(plan.write_dst[st], plan.write_src[st]):
        for w, b in zip(weights, staging):
            w[dst:dst + n].copy_(b[src:src + n])
    for dst, src, n in _runs(plan.write_dst[~st], plan.write_src[~st]):
        for w in weights:
            w[dst:dst + n].copy_(w[src:src + n])


def execute_layer_transfer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                           group=None, staging: Sequence[torch.Tensor] | None = None, *,
                           transport=None) -> int:
    """Carry out `plan` on one layer's local expert tensors, in place; return bytes received:
    with an IPC transport that has a hold buffer, `IpcTransport.move` (received experts
    go straight into their slots, no staging); otherwise `exchange_layer`, the transport's
    `settle` (IPC: wait until peers finished reading), then `write_layer`.

    `weights`: tensors `[S, ...]` (stacked local slots, views allowed, non-contiguous too),
    written only through `copy_` into slot views, so storage and `data_ptr` are unchanged.
    `staging`: optional reusable buffer as from `allocate_staging` (at least
    `plan.num_staged` rows); else exactly the rows needed are allocated.
    `group`: the process group whose (group-relative) ranks the plan uses.
    Every rank of the group must call this for the layer (ranks with nothing to do return
    at once). Under NCCL the group must already have run a collective, since a first
    `batch_isend_irecv` that leaves some ranks out is undefined behaviour.
    """
    weights = _check_weights(plan, weights)
    if plan.is_noop:
        return 0
    transport = _resolve(transport)
    if moves_in_place(transport, weights):
        return transport.move(plan, weights, group)
    staging = allocate_staging(weights, plan.num_staged) if staging is None else list(staging)
    received = exchange_layer(plan, weights, group, staging, transport=transport)
    transport.settle(plan, group)
    write_layer(plan, weights, staging)
    return received


def moves_in_place(transport, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `execute_layer_transfer` moves this layer with `transport.move` (the IPC
    transport with its hold buffer) rather than exchange, settle and write."""
    can = getattr(transport, "can_move", None)
    return bool(can is not None and can(list(weights)))


def first_slot_of_expert(row) -> dict[int, int]:
    """expert -> the first slot of `row` (`[P]` physical_to_logical) holding it: the slot
    whose pre-transfer checksum stands for the expert when transfers are verified."""
    first: dict[int, int] = {}
    for p, e in enumerate(np.asarray(row).tolist()):
        first.setdefault(e, p)
    return first


class TransferVerificationError(RuntimeError):
    """After a layer's transfer, a slot's checksum differs from its expert's pre-transfer
    checksum. Raised on every rank of the group at once (all ranks compare the same
    gathered checksums), before `on_layer_done` of that layer."""

    def __init__(self, layer: int, bad_slots: list[int], message: str):
        super().__init__(message)
        self.layer = layer
        self.bad_slots = bad_slots  # global physical slot ids


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constant, as a signed int64


def slot_checksums(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """`[S]` int64 checksum of each local slot over all of a layer's tensors, on their device.

    Each slot's bytes are read as int32 words (bytes when the size is not a multiple of 4),
    widened to int64 and summed with position-dependent odd multipliers; int64 wraps, so
    the sum is exact modular arithmetic and independent of reduction order (bitwise equal
    on every rank and device for equal bytes). Slot by slot, so the temporary memory is
    about 3x one slot's bytes of one tensor."""
    weights = list(weights)
    S = weights[0].shape[0]
    out = torch.zeros(S, dtype=torch.int64, device=weights[0].device)  # [S]
    coeffs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    for i, w in enumerate(weights):
        for s in range(S):
            raw = w[s].contiguous().reshape(-1).view(torch.uint8)  # [B]
            words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw  # [B/4] or [B]
            key = (i, words.numel(), words.dtype)
            c = coeffs.get(key)
            if c is None:  # odd multipliers depending on position and tensor index
                c = coeffs[key] = (torch.arange(words.numel(), dtype=torch.int64, device=w.device)
                                   * _MIX + (2 * i + 1))
            out[s] = out[s] * 1000003 + (words.to(torch.int64) * c).sum()
    return out


def _verify_layer(layer: int, old_row: np.ndarray, new_row: np.ndarray, rank: int,
                  num_ranks: int, old_cs: torch.Tensor, new_cs: torch.Tensor, group) -> None:
    """Gather `[S]` old and new checksums of every rank (one all_gather of `[2S]` int64)
    and compare, on every rank, each new slot to the old checksum of its expert (the first
    old slot holding it). Every rank reaches the same verdict, so all raise together."""
    S = old_cs.shape[0]
    mine = torch.cat([old_cs, new_cs])  # [2S]
    if num_ranks > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(mine) for _ in range(num_ranks)]
        dist.all_gather(parts, mine, group=group)
        both = torch.stack(parts).cpu().numpy()  # [M, 2S]
    else:
        both = mine.cpu().numpy()[None]
    old_all, new_all = both[:, :S].reshape(-1), both[:, S:].reshape(-1)  # [P], [P]
    first = first_slot_of_expert(old_row)
    want = old_all[[first[e] for e in new_row.tolist()]]  # [P]
    bad = np.flatnonzero(want != new_all)
    if bad.size:
        raise TransferVerificationError(
            layer, bad.tolist(),
            f"transfer verification failed on layer {layer}: slots {bad.tolist()} (experts "
            f"{new_row[bad].tolist()}, ranks {(bad // S).tolist()}) differ from their expert's "
            f"pre-transfer checksum")


@dataclass(frozen=True)
class TransferResult:
    """What one rank did in one `TransferExecutor.execute` call."""

    experts_received: int  # experts received over the network
    local_copies: int  # changed slots filled from an expert this rank already held
    slots_written: int  # changed local slots (each written once)
    bytes_received: int
    seconds: float
    bytes_sent: int = 0
    layers_changed: int = 0  # layers whose placement differs (on any rank)


class TransferExecutor:
    """Moves expert weights from one placement to another, layer by layer, synchronously,
    reusing one staging buffer. Later executors (asynchronous, other transports) keep the
    signature of `execute`.

    `num_nodes`: node count for same-node sender preference; defaults to the Placement's
    `num_nodes`, else 1.
    `verify`: after each changed layer, checksum every local slot (`slot_checksums`), gather
    the checksums of all ranks (one all_gather of `[2S]` int64 per changed layer) and raise
    `TransferVerificationError` on every rank, before `on_layer_done(layer)`, when a slot
    differs from its expert's pre-transfer checksum.
    `transport`: "nccl" (default; point-to-point over the group's backend, gloo on CPU),
    "ipc", "auto" (see `make_transport`; set up collectively on the first `execute` and
    again whenever the weights or group change) or a transport object.
    `chunk_bytes`: message size of the point-to-point transport (default
    `DEFAULT_CHUNK_BYTES`).
    """

    def __init__(self, num_nodes: int | None = None, verify: bool = False, transport="nccl",
                 chunk_bytes: int | None = None) -> None:
        if isinstance(transport, str) and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or a transport object, got {transport!r}")
        if chunk_bytes is not None:
            P2PTransport(chunk_bytes)  # validates
        self.num_nodes = num_nodes
        self.verify = verify
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self._staging: list[torch.Tensor] | None = None
        self._made: tuple[tuple, object] | None = None  # (key, transport) made for ipc/auto

    def _transport_for(self, expert_weights, group):
        """None for the default path (plain `execute_layer_transfer(plan, w, group, staging)`),
        else the transport object to pass."""
        t = self.transport
        if not isinstance(t, str):
            return t
        if t == "nccl":
            return None if self.chunk_bytes is None else P2PTransport(self.chunk_bytes)
        key = (id(group), tuple(_weights_key(ws) for ws in expert_weights))
        if self._made is None or self._made[0] != key:
            self._made = (key, make_transport(t, expert_weights, group, chunk_bytes=self.chunk_bytes))
        return self._made[1]

    def release_staging(self) -> None:
        """Drop the cached staging buffer (it is reused across calls otherwise)."""
        self._staging = None

    def close(self) -> None:
        """Drop staging and close a transport this executor made ('ipc'/'auto'); see
        `IpcTransport.close` for the shutdown order."""
        self._staging = None
        if self._made is not None and hasattr(self._made[1], "close"):
            self._made[1].close()
        self._made = None

    def _staging_for(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        b = self._staging
        if b is None or len(b) != len(weights) or any(
                x.shape != w.shape or x.dtype != w.dtype or x.device != w.device
                for x, w in zip(b, weights)):
            b = self._staging = allocate_staging(weights)
        return b

    def execute(self, old, new, expert_weights: Sequence[Sequence[torch.Tensor]],
                group=None, on_layer_done=None) -> TransferResult:
        """Rewrite `expert_weights[layer][i]` (`[S, ...]` local slots) from placement `old`
        to `new` (Placement or `[L, P]` array) over `group` (default: the world, or no
        communication at all when torch.distributed is not initialized).

        `on_layer_done(layer)` is called for every layer, in order, as soon as that
        layer's weights are final (on the current stream), so the caller can switch the
        layer's maps with its weights; if a later layer fails, earlier ones stay switched.
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        old_p2l, new_p2l = _as_p2l(old), _as_p2l(new)  # [L, P], [L, P]
        if old_p2l.shape != new_p2l.shape:
            raise ValueError(f"old {old_p2l.shape} and new {new_p2l.shape} differ in shape")
        L, P = old_p2l.shape
        if len(expert_weights) != L:
            raise ValueError(f"expert_weights has {len(expert_weights)} layers, placement {L}")
        if dist.is_available() and dist.is_initialized():
            num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
            if rank < 0:
                raise ValueError("this process is not a member of the given group")
        else:
            num_ranks, rank = 1, 0
        for p in (old, new):
            if isinstance(p, Placement) and p.num_gpus != num_ranks:
                raise ValueError(f"placement is for {p.num_gpus} GPUs, the group has {num_ranks} ranks")
        num_nodes = self.num_nodes
        if num_nodes is None:
            num_nodes = new.num_nodes if isinstance(new, Placement) else 1

        received = local = written = nbytes = sent = changed_layers = 0
        device = None
        transport = None
        if num_ranks > 1 and any(not np.array_equal(o, n) for o, n in zip(old_p2l, new_p2l)):
            transport = self._transport_for(expert_weights, group)  # collective for ipc/auto
        for layer in range(L):
            if not np.array_equal(old_p2l[layer], new_p2l[layer]):
                # every rank sees the same rows, so every rank takes the same branch
                changed_layers += 1
                weights = list(expert_weights[layer])
                device = weights[0].device if weights else device
                plan = plan_layer_transfer(old_p2l[layer], new_p2l[layer], num_ranks, rank, num_nodes)
                old_cs = slot_checksums(weights) if self.verify and weights else None
                if not plan.is_noop:
                    staging = None if moves_in_place(transport, weights) else self._staging_for(weights)
                    if transport is None:
                        nbytes += execute_layer_transfer(plan, weights, group, staging)
                    else:
                        nbytes += execute_layer_transfer(plan, weights, group, staging,
                                                         transport=transport)
                    received += plan.num_received
                    local += plan.num_local_copies
                    written += plan.num_slots_written
                    sent += plan.num_sent * sum(w[0].nbytes for w in weights)
                if old_cs is not None:  # every rank of the group, noop plan or not
                    _verify_layer(layer, old_p2l[layer], new_p2l[layer], rank, num_ranks,
                                  old_cs, slot_checksums(weights), group)
            if on_layer_done is not None:
                on_layer_done(layer)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return TransferResult(
            experts_received=received, local_copies=local, slots_written=written,
            bytes_received=nbytes, seconds=time.perf_counter() - t0, bytes_sent=sent,
            layers_changed=changed_layers,
        )
