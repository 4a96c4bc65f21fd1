"""Moving expert weights from one placement to the next.

Two halves:

* a **pure planner** (numpy only): from the old and new `physical_to_logical` rows of one
  layer it works out, for one rank, which local slots stay, which are filled from an
  expert the rank already holds, which experts arrive from which peer, and what the rank
  sends to whom. Every rank runs the same deterministic computation on the same inputs,
  so sends and receives match by construction, with no negotiation round;
* an **executor** that carries a plan out with torch.distributed point-to-point ops
  (`batch_isend_irecv`, works on gloo and NCCL) *into the model's own tensors*: weights
  are written with `copy_` into slot views, so storage and `data_ptr` never change and
  CUDA graphs and registered views stay valid.

Per layer and rank the execution is (after vLLM's `move_to_buffer`/`move_from_buffer`
and SGLang's `update_expert_weights_single_layer`):

1. copy experts needed locally whose only local source slot is about to be overwritten
   into a staging buffer (an in-place write could clobber the source otherwise);
2. post all sends (read straight from the untouched weights) and receives (into staging;
   each remote expert is received once per rank); wait for all of them;
3. write every changed slot from staging, or straight from an unchanged local slot that
   holds the same expert (unchanged slots are never written, so they are safe sources).

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
    "TransferStats",
    "TransferResult",
    "TransferExecutor",
    "assign_senders",
    "plan_layer_transfer",
    "plan_layer_transfers",
    "transfer_stats",
    "execute_layer_transfer",
    "allocate_staging",
    "TransferVerificationError",
    "slot_checksums",
]


# ==== planning (pure) ==================================================================


@dataclass(frozen=True, eq=False)
class LayerTransferPlan:
    """What one rank does for one layer. Slots are local indices `0 .. S-1`; ranks are
    group-relative. Staging row `k` holds expert `stage_expert[k]`: locally staged rows
    come first (ascending expert), then received rows (ascending expert)."""

    rank: int
    num_ranks: int
    slots_per_rank: int  # S
    unchanged: np.ndarray  # [U] local slots whose expert stays; never written
    stage_expert: np.ndarray  # [K] expert held by each staging row, K <= S
    stage_src_slot: np.ndarray  # [K] local slot copied into the row, -1 for received rows
    stage_src_rank: np.ndarray  # [K] rank the row is received from, -1 for staged rows
    send_expert: np.ndarray  # [T] expert of each send, sorted by (expert, peer)
    send_peer: np.ndarray  # [T] receiving rank
    send_slot: np.ndarray  # [T] local slot the send reads (an old holder of the expert)
    write_dst: np.ndarray  # [W] local slot written (every changed slot exactly once)
    write_src: np.ndarray  # [W] staging row if write_from_stage, else an unchanged local slot
    write_from_stage: np.ndarray  # [W] bool
    write_local: np.ndarray  # [W] bool: the data came from this rank's old slots (no network)

    # ---- sizes and counts ----------------------------------------------------------
    @property
    def num_staged(self) -> int:
        """Staging rows needed (<= S)."""
        return len(self.stage_expert)

    @property
    def recv_rows(self) -> np.ndarray:  # [R]
        return np.flatnonzero(self.stage_src_rank >= 0)

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
    first_slot = {}
    for s, e in enumerate(old_l.tolist()):
        first_slot.setdefault(e, s)
    send_slot = np.array([first_slot[e] for e in send_expert.tolist()], dtype=np.int64)  # [T']

    # sources for each expert needed in a changed slot
    keep_slot = {}  # expert -> an unchanged slot holding it (safe to read at any time)
    for s in np.flatnonzero(~changed).tolist():
        keep_slot.setdefault(int(old_l[s]), s)
    received = a_expert[a_recv == rank]  # [R] ascending
    recv_from = dict(zip(received.tolist(), a_send[a_recv == rank].tolist()))
    needed = np.unique(new_l[changed]).tolist()
    staged_local = [e for e in needed if e not in keep_slot and e in first_slot]
    stage_expert = staged_local + received.tolist()  # [K]
    row_of = {e: k for k, e in enumerate(stage_expert)}
    stage_src_slot = [first_slot[e] for e in staged_local] + [-1] * len(received)
    stage_src_rank = [-1] * len(staged_local) + [recv_from[e] for e in received.tolist()]

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
        stage_src_rank=i64(stage_src_rank),
        send_expert=i64(send_expert), send_peer=i64(send_peer), send_slot=send_slot,
        write_dst=write_dst.astype(np.int64), write_src=i64(write_src),
        write_from_stage=np.asarray(write_from_stage, dtype=bool).reshape(-1),
        write_local=np.asarray(write_local, dtype=bool).reshape(-1),
    )


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


def _global_rank(group, rank: int) -> int:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def execute_layer_transfer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                           group=None, staging: Sequence[torch.Tensor] | None = None) -> int:
    """Carry out `plan` on one layer's local expert tensors, in place; return bytes received.

    `weights`: tensors `[S, ...]` (stacked local slots, views allowed, non-contiguous too),
    written only through `copy_` into slot views, so storage and `data_ptr` are unchanged.
    `staging`: optional reusable buffer as from `allocate_staging` (at least
    `plan.num_staged` rows); else exactly the rows needed are allocated.
    `group`: the process group whose (group-relative) ranks the plan uses.
    Every rank of the group must call this for the layer (ranks with nothing to do return
    at once). Under NCCL the group must already have run a collective, since a first
    `batch_isend_irecv` that leaves some ranks out is undefined behaviour.
    """
    weights = list(weights)
    S = plan.slots_per_rank
    for i, w in enumerate(weights):
        if w.shape[0] != S:
            raise ValueError(f"weights[{i}] has {w.shape[0]} slots, the plan expects {S}")
    if plan.is_noop:
        return 0
    K = plan.num_staged
    if staging is None:
        staging = allocate_staging(weights, K)
    else:
        staging = list(staging)
        _check_staging(staging, weights, K)

    # 1. stage local sources that will be overwritten, before anything is written
    for k in np.flatnonzero(plan.stage_src_slot >= 0).tolist():
        src = int(plan.stage_src_slot[k])
        for w, b in zip(weights, staging):
            b[k].copy_(w[src])

    # 2. sends from the untouched weights, receives into staging
    ops = plan.p2p_ops()
    received = 0
    if ops:
        import torch.distributed as dist

        p2p, keep = [], {}  # keep: contiguous copies of send slots, alive until the wait
        for kind, peer, _expert, idx in ops:
            gpeer = _global_rank(group, peer)
            for i, (w, b) in enumerate(zip(weights, staging)):
                if kind == "send":
                    t = keep.get((i, idx))
                    if t is None:
                        t = w[idx]
                        t = keep[(i, idx)] = t if t.is_contiguous() else t.contiguous()
                    p2p.append(dist.P2POp(dist.isend, t, gpeer, group))
                else:
                    p2p.append(dist.P2POp(dist.irecv, b[idx], gpeer, group))
                    received += b[idx].nbytes
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
        del keep

    # 3. write changed slots from staging or from an unchanged local slot
    for dst, src, from_stage in zip(plan.write_dst.tolist(), plan.write_src.tolist(),
                                    plan.write_from_stage.tolist()):
        for w, b in zip(weights, staging):
            w[dst].copy_(b[src] if from_stage else w[src])
    return received


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
    first = {}
    for p, e in enumerate(old_row.tolist()):
        first.setdefault(e, p)
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
    """

    def __init__(self, num_nodes: int | None = None, verify: bool = False) -> None:
        self.num_nodes = num_nodes
        self.verify = verify
        self._staging: list[torch.Tensor] | None = None

    def release_staging(self) -> None:
        """Drop the cached staging buffer (it is reused across calls otherwise)."""
        self._staging = None

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
        for layer in range(L):
            if not np.array_equal(old_p2l[layer], new_p2l[layer]):
                # every rank sees the same rows, so every rank takes the same branch
                changed_layers += 1
                weights = list(expert_weights[layer])
                device = weights[0].device if weights else device
                plan = plan_layer_transfer(old_p2l[layer], new_p2l[layer], num_ranks, rank, num_nodes)
                old_cs = slot_checksums(weights) if self.verify and weights else None
                if not plan.is_noop:
                    nbytes += execute_layer_transfer(plan, weights, group, self._staging_for(weights))
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
