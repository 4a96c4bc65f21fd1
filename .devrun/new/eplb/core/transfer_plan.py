"""The transfer plan of one layer, pure (numpy only).

From the old and new `physical_to_logical` rows of one layer it works out, for one rank,
which local slots stay, which are filled from an expert the rank already holds, which
experts arrive from which peer (the sender choice: eplb.core.senders) and what the rank
sends to whom, plus what the in-place
move over CUDA IPC needs (`hold_slots`, where each send lands: `in_place_ops`). Every
rank runs the same deterministic computation on the same inputs, so sends and receives
match by construction, with no negotiation round. `eplb.runtime.transfer` carries plans out.

Ranks here are *group-relative* (0 .. group size - 1). Slot `p` of a layer lives on rank
`p // (P // num_ranks)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.core.placement import Placement
from eplb.core.senders import assign_senders, check_layer_rows

__all__ = [
    "LayerTransferPlan",
    "InPlaceOps",
    "TransferStats",
    "as_p2l",
    "first_slot_of_expert",
    "in_place_ops",
    "plan_layer_transfer",
    "plan_layer_transfers",
    "transfer_stats",
]



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
    send_hold_row = hold_rows(hold_slots, send_slot)
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
        send_dst_hold_row[mine_p] = hold_rows(_hold_slots(o, n, p_sends, first_p), send_dst_slot[mine_p])

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


def hold_rows(hold_slots: np.ndarray, slots) -> np.ndarray:
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
        hold_row[l_st] = hold_rows(plan.hold_slots, plan.stage_src_slot[l_src[l_st]])
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
    old, new, S = check_layer_rows(old, new, num_ranks, num_nodes)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} outside [0, {num_ranks})")
    return _rank_plan(old, new, S, num_ranks, rank, assign_senders(old, new, num_ranks, num_nodes))


def plan_layer_transfers(old, new, num_ranks: int, num_nodes: int = 1) -> list[LayerTransferPlan]:
    """The plans of all ranks for one layer (one sender assignment shared by all)."""
    old, new, S = check_layer_rows(old, new, num_ranks, num_nodes)
    assignment = assign_senders(old, new, num_ranks, num_nodes)
    return [_rank_plan(old, new, S, num_ranks, r, assignment) for r in range(num_ranks)]


@dataclass(frozen=True)
class TransferStats:
    """Whole-model totals over all ranks of a placement change."""

    experts_moved: int  # remote receives: distinct (layer, rank, expert) fetched over the network
    local_copies: int  # changed slots filled from an expert the rank already held
    slots_changed: int  # slots whose expert changes (each written once)
    bytes_moved: int | None = None  # experts_moved * bytes_per_expert, when given


def as_p2l(x) -> np.ndarray:  # [L, P]
    p2l = x.physical_to_logical if isinstance(x, Placement) else np.asarray(x, dtype=np.int64)
    if p2l.ndim == 1:
        p2l = p2l[None]
    if p2l.ndim != 2:
        raise ValueError(f"physical_to_logical must be [L, P], got shape {p2l.shape}")
    return p2l


def transfer_stats(old, new, num_ranks: int, bytes_per_expert: int | None = None) -> TransferStats:
    """Count what moving `old [L, P]` to `new [L, P]` costs (Placements are accepted).
    Matches the sums of `plan_layer_transfers` over ranks and layers; vectorized."""
    old, new = as_p2l(old), as_p2l(new)  # [L, P], [L, P]
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


def first_slot_of_expert(row) -> dict[int, int]:
    """expert -> the first slot of `row` (`[P]` physical_to_logical) holding it: the slot
    whose pre-transfer checksum stands for the expert when transfers are verified."""
    first: dict[int, int] = {}
    for p, e in enumerate(np.asarray(row).tolist()):
        first.setdefault(e, p)
    return first
