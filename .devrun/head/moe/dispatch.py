"""Dispatch: logical top-k ids -> physical slots (recording the load) -> owning ranks and back.

Steps, all tensor ops on the tokens' device:

1. `map_to_physical`: pick one replica slot per (token, k) by a multiplicative hash of
   the flat position t*K + k, so a token's K choices and consecutive tokens spread over
   an expert's replicas deterministically (no RNG state, same answer on every call).
   Evenly by default; with a registered `logical_replica_cdf` row (weighted replicas)
   the hash, scaled to u in [0, 1), picks the first replica whose cdf exceeds u.
   `SlotTable` gives the even split's answer in one gather from a per-layer table, kept
   while the maps stand (the layers use it in eager mode).
2. `count_slots`: the per-slot histogram `[P]` of the (token, k) choices, one
   `scatter_add_`. Dispatch needs it anyway (split sizes, expert group offsets); load
   recording is one `add_` of it into the layer's `expert_load_view [P]` row, so counting
   costs a [P]-sized add per layer and no host sync. (`record_load` is the same count as
   a separate pass, kept for callers that have only the slot ids.)
3. `dispatch`: sort the (token, k) copies by slot, exchange them with
   `all_to_all_single` so each lands on the rank owning its slot (rank = slot // S), and
   sort what arrives by local slot for the experts. Two modes (`MoEArgs.dispatch_mode`):
   * "exact": send exactly the rows each rank needs; one host sync reads the split sizes.
   * "fixed": every (source, destination) pair exchanges a fixed block of C = T*K rows
     (the most one rank can send another, so nothing is ever dropped), padded; shapes
     never depend on the routing, so there is no host sync and the EP forward can be
     captured in a CUDA graph. It moves W times the rows of "exact" over the wire, and
     every rank must pass the same T: `dispatch` does not check it (`MoELayer` does, with
     one all-reduce, whenever T changes).
4. `combine`: the inverse exchange, back into (token, k) order; `weighted_sum` applies
   the gate weights and sums over k.

`dispatch` and `combine` are collectives over the group (`all_to_all_single`): every
rank calls them, in the same order. With no process group (or a group of one) steps 3-4
are local permutations only, with no host sync in either mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ep_guard import collective_error

KNUTH = 2654435769  # 2^32 / golden ratio, the multiplier vLLM's replica hash uses


def _mul_low32(index: torch.Tensor, multiplier: int) -> torch.Tensor:
    """(index * multiplier) mod 2^32 for int64 `index`, without int64 overflow."""
    index = index & 0xFFFFFFFF
    lo, hi = index & 0xFFFF, index >> 16  # 16-bit halves
    # lo * m < 2^48; only the low 16 bits of hi * m survive the shift by 16 mod 2^32
    return (lo * multiplier + (((hi * multiplier) & 0xFFFF) << 16)) & 0xFFFFFFFF


def hash_replica(index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Replica number in [0, count) for each flat position `index` (same shapes, int64).

    h = (index * 2654435769) mod 2^32 as in vLLM, then reduced to [0, count) by its high
    bits, (h * count) >> 32, rather than vLLM's `h % count`: the low bits of a
    multiplicative hash repeat the low bits of the index, so with `% count` and an even
    count every k = 0 choice of K = 2 would take the same replica.
    """
    h = _mul_low32(index, KNUTH)  # [*] in [0, 2^32)
    return (h * count) >> 32


EVEN_CDF_ATOL = 1e-6  # a cdf row this close to (r + 1) / count is decoded as an even split


def weighted_replica(
    index: torch.Tensor,  # [T, K] flat position t*K + k, int64
    topk_ids: torch.Tensor,  # [T, K] logical expert ids
    logical_replica_count: torch.Tensor,  # [N] replicas of each expert
    logical_replica_cdf: torch.Tensor,  # [N, R] cumulative replica shares, rows end at 1.0
) -> torch.Tensor:  # [T, K] replica number in [0, count)
    """The first replica whose cdf exceeds u, clamped to count - 1, where u is the
    `hash_replica` hash h of the flat position scaled to [0, 1).

    u keeps the hash's top 24 bits, u = (h >> 8) * 2^-24, which float32 holds exactly, so
    the comparison with the float32 cdf is exact and the same on every device. Rows that
    are the even split (every entry within EVEN_CDF_ATOL of min(r + 1, count) / count)
    take `(h * count) >> 32` instead, bitwise the replica `hash_replica` picks without a
    cdf: float cdf entries cannot reproduce that integer formula at the replica
    boundaries. All tensor ops with fixed shapes: no host sync, CUDA-graph safe.
    """
    h = _mul_low32(index, KNUTH)  # [T, K] in [0, 2^32)
    cdf = logical_replica_cdf.float()  # [N, R]
    n_count = logical_replica_count.long()  # [N]
    count = n_count[topk_ids]  # [T, K]
    u = (h >> 8).to(torch.float32) * 2.0 ** -24  # [T, K] in [0, 1), exact
    below = (cdf[topk_ids] <= u.unsqueeze(-1)).sum(-1)  # [T, K] replicas whose cdf <= u
    weighted = torch.minimum(below, count - 1)  # [T, K]
    ranks = torch.arange(1, cdf.shape[-1] + 1, device=cdf.device)  # [R]
    even_cdf = (torch.minimum(ranks, n_count.unsqueeze(-1)).float()
                / n_count.unsqueeze(-1).float())  # [N, R]
    is_even = ((cdf - even_cdf).abs() <= EVEN_CDF_ATOL).all(-1)  # [N]
    return torch.where(is_even[topk_ids], (h * count) >> 32, weighted)


_CONSTANTS: dict[tuple, torch.Tensor] = {}  # small per-shape tensors, made once per device


def _constant(kind: str, n: int, device: torch.device, rows: int = 1) -> torch.Tensor:
    """Tensors that depend only on sizes, cached per (kind, n, rows, device) in eager mode
    so that a decode step launches no kernel to rebuild them (made inline under
    torch.compile, where they fuse and no cached tensor becomes a graph constant, and
    not cached when first made inside a CUDA-graph capture, whose kernels run only at
    replay):
    "replica" [rows, n]: row c is `hash_replica` of positions 0..n-1 with count c
    ((h * c) >> 32, the hash h of the position); "one" [n]: int64 ones (a stride-0 view).
    """
    key = (kind, n, rows, device)
    found = _CONSTANTS.get(key)
    if found is not None and not torch.compiler.is_compiling():
        return found
    # made inside a CUDA-graph capture, its kernels run only at replay: never cache that
    cache = not (torch.compiler.is_compiling()
                 or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()))
    if kind == "replica":
        h = _mul_low32(torch.arange(n, device=device), KNUTH)  # [n]
        t = (h * torch.arange(rows, device=device).unsqueeze(1)) >> 32  # [rows, n]
    else:
        t = torch.ones(1, dtype=torch.int64, device=device).expand(n)
    if cache:
        if len(_CONSTANTS) > 256:  # many distinct batch sizes: start over
            _CONSTANTS.clear()
        _CONSTANTS[key] = t
    return t


def map_to_physical(
    topk_ids: torch.Tensor,  # [T, K] logical expert ids
    logical_to_physical_map: torch.Tensor,  # [N, R] slots of each expert, -1 padded
    logical_replica_count: torch.Tensor,  # [N] replicas of each expert
    logical_replica_cdf: torch.Tensor | None = None,  # [N, R] cumulative shares, or None
) -> torch.Tensor:  # [T, K] physical slot ids
    """Pick a replica slot for every (token, k), spreading tokens over replicas: evenly
    without a cdf (`hash_replica`), by the replica shares with one (`weighted_replica`).
    Fixed shapes, no host sync. The even split is three kernels (a decode step's host
    time is mostly kernel launches): count gather, replica lookup in the table of
    `hash_replica` per (count, flat position), made once per (T*K, R), and slot gather."""
    T, K = topk_ids.shape
    if logical_replica_cdf is None:
        table = _constant("replica", T * K, topk_ids.device,
                          logical_to_physical_map.shape[-1] + 1)  # [R + 1, T*K]
        count = logical_replica_count[topk_ids].view(1, T * K).long()  # [1, T*K]
        replica = table.gather(0, count).view(T, K)  # [T, K] hash_replica(position, count)
    else:
        index = torch.arange(T * K, device=topk_ids.device).view(T, K)  # [T, K] flat position
        replica = weighted_replica(index, topk_ids, logical_replica_count,
                                   logical_replica_cdf)  # [T, K]
    return logical_to_physical_map[topk_ids, replica]  # [T, K]


SLOT_TABLE_MAX = 1 << 18  # entries of one layer's slot table (int64: 2 MiB)


class SlotTable:
    """`map_to_physical` of the even split as one `gather` per forward, for a layer whose
    maps change rarely (eager decode: a step's host time is mostly kernel launches).

    For the flat size n = T*K last seen it keeps `table [N, n]`, table[e, i] = the slot
    that (token, k) position i of logical expert e goes to, i.e.
    `logical_to_physical_map[e, hash_replica(i, logical_replica_count[e])]`; then the
    slot of position i is `table[topk_ids[i], i]`, bitwise `map_to_physical`'s. The
    table is rebuilt whenever the maps are rewritten: the key holds both maps' version
    counters (every in-place write, `copy_` or index assignment, bumps them, also under
    `torch.inference_mode`) and storage. Not used (plain `map_to_physical`, which reads
    the maps inside the forward) with a replica cdf, under torch.compile or a CUDA-graph
    capture (a captured table would not follow a rebalance), for maps without version
    counters (inference tensors), or when N*n exceeds `SLOT_TABLE_MAX`.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._table: torch.Tensor | None = None  # [N, n]

    def __call__(self, topk_ids: torch.Tensor,  # [T, K] logical expert ids
                 logical_to_physical_map: torch.Tensor,  # [N, R]
                 logical_replica_count: torch.Tensor,  # [N]
                 logical_replica_cdf: torch.Tensor | None = None,  # [N, R] or None
                 ) -> torch.Tensor:  # [T, K] physical slot ids
        T, K = topk_ids.shape
        l2p, count = logical_to_physical_map, logical_replica_count
        n = T * K
        if (logical_replica_cdf is not None or l2p.shape[0] * n > SLOT_TABLE_MAX
                or topk_ids.dtype != torch.int64 or torch.compiler.is_compiling()
                or (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing())):
            return map_to_physical(topk_ids, l2p, count, logical_replica_cdf)
        try:
            key = (n, l2p.data_ptr(), l2p._version, count.data_ptr(), count._version)
        except RuntimeError:  # inference tensors keep no version counter
            return map_to_physical(topk_ids, l2p, count)
        if key != self._key:
            rows = _constant("replica", n, l2p.device, l2p.shape[-1] + 1)  # [R + 1, n]
            self._table = l2p.gather(1, rows[count.long()])  # [N, n]
            self._key = key
        return self._table.gather(0, topk_ids.reshape(1, n)).view(T, K)  # [T, K]


def count_slots(physical_ids: torch.Tensor, num_slots: int) -> torch.Tensor:  # [P] int64
    """Tokens per physical slot: histogram of `physical_ids [T, K]` over `num_slots` (P)
    slots, one `scatter_add_` on the device (no host sync, unlike `torch.bincount`)."""
    flat = physical_ids.reshape(-1)  # [T*K]
    counts = torch.zeros(num_slots, dtype=torch.int64, device=flat.device)  # [P]
    return counts.scatter_add_(0, flat, _constant("one", flat.numel(), flat.device))


def record_load(expert_load_view: torch.Tensor, physical_ids: torch.Tensor) -> None:
    """Count each (token, k) choice into `expert_load_view [P]` in place: one
    `scatter_add_`, no host sync. For callers that need no histogram themselves (one
    process, where the experts' own forward counts rows); `MoELayer` instead adds the
    `count_slots` histogram that dispatch computes anyway."""
    flat = physical_ids.reshape(-1)  # [T*K]
    one = _constant("one", flat.numel(), flat.device)  # [T*K] int64
    expert_load_view.scatter_add_(0, flat, one if expert_load_view.dtype == torch.int64
                                  else one.to(expert_load_view.dtype))


def weighted_sum(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [T, K, H], gate weights [T, K] -> [T, H] (accumulated in float32)."""
    return (expert_out.float() * weights.float().unsqueeze(-1)).sum(1).to(expert_out.dtype)


def _all_to_all(*args, **kwargs) -> None:
    """`dist.all_to_all_single`; a failure (a peer that ran fewer forwards closed its
    connection or timed out) re-raises as one RuntimeError naming the layer, the forward
    and the rule (`moe.ep_guard.collective_error`), the original error chained."""
    try:
        dist.all_to_all_single(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise several kinds
        raise collective_error(e) from e


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`."""

    order: torch.Tensor  # [T*K] flat (token, k) positions sorted by slot
    num_tokens: int  # T
    top_k: int  # K
    local_order: torch.Tensor | None = None  # [T_r] received rows sorted by local slot
    send_splits: list[int] | None = None  # [W] rows sent to each rank
    recv_splits: list[int] | None = None  # [W] rows received from each rank
    send_index: torch.Tensor | None = None  # [T*K] "fixed" mode: row of each sorted copy in
    #                                          the [W*C] send buffer (destination block + offset)


def dispatch(
    x: torch.Tensor,  # [T, H]
    physical_ids: torch.Tensor,  # [T, K] slots in [0, W*S)
    num_local_slots: int,  # S
    group: dist.ProcessGroup | None = None,
    slot_counts: torch.Tensor | None = None,  # [W*S] `count_slots(physical_ids, W*S)`, if known
    mode: str = "exact",  # "exact" | "fixed" (see the module docstring)
) -> tuple[torch.Tensor, torch.Tensor, list[int] | None, DispatchState]:
    """Send each (token, k) copy of x to the rank owning its slot (rank = slot // S).
    A collective over `group`; `slot_counts`, when given, must be the `count_slots` of
    `physical_ids` (it is not recomputed).

    Returns (x_local [T_r, H] rows for this rank's slots sorted by local slot (in "fixed"
             mode [W*C, H]: the real rows first, then padding rows no expert reads),
             counts [S] int64 rows per local slot (device),
             counts_host [S] the same as ints, or None when nothing forced a host sync,
             state for `combine`).
    With one rank (`group` None or of size 1) `mode` does not matter: x_local is the
    [T*K, H] copies sorted by slot, counts is `slot_counts` [S], counts_host None.
    """
    T, K = physical_ids.shape
    S = num_local_slots
    W, _ = _world(group)
    flat = physical_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K] grouped by slot, hence by rank
    x_sorted = x[order // K]  # [T*K, H]
    if slot_counts is None:
        slot_counts = count_slots(physical_ids, W * S)  # [W*S]
    state = DispatchState(order, T, K)
    if W == 1:
        return x_sorted, slot_counts, None, state
    if mode == "fixed":
        return _dispatch_fixed(x_sorted, flat[order], slot_counts, S, W, state, group)
    if mode != "exact":
        raise ValueError(f"mode: {mode!r} is not 'exact' or 'fixed'")

    # rows per (source rank, my local slot): [W*S], equal splits of S per rank
    recv_slot_counts = torch.empty_like(slot_counts)
    _all_to_all(recv_slot_counts, slot_counts, group=group)
    host = torch.cat([slot_counts.view(W, S).sum(1), recv_slot_counts]).tolist()  # one sync
    send_splits, recv_grid = host[:W], host[W:]
    recv_splits = [sum(recv_grid[r * S:(r + 1) * S]) for r in range(W)]
    counts_host = [sum(recv_grid[r * S + s] for r in range(W)) for s in range(S)]
    total = sum(recv_splits)

    x_recv = x.new_empty(total, x.shape[1])  # [T_r, H] ordered by (source rank, slot)
    _all_to_all(x_recv, x_sorted.contiguous(), recv_splits, send_splits, group=group)
    local_slot = torch.arange(S, device=flat.device).repeat(W).repeat_interleave(
        recv_slot_counts, output_size=total)  # [T_r]
    local_order = torch.argsort(local_slot, stable=True)  # [T_r]
    counts = recv_slot_counts.view(W, S).sum(0)  # [S]
    state.local_order, state.send_splits, state.recv_splits = local_order, send_splits, recv_splits
    return x_recv[local_order], counts, counts_host, state


def check_same_tokens(num_tokens: int, device: torch.device, group: dist.ProcessGroup | None,
                      checked: tuple | None = None) -> tuple:
    """"fixed" dispatch exchanges equal T*K-row blocks, so every rank must pass the same
    T: one all-reduce (and host sync) of [T, -T]; every rank raises alike if not.
    `checked` is the (T, group) of the last check: when it is this one, nothing is done
    (so never inside a captured graph, whose T is the warm-up's). Returns (T, group)."""
    T = num_tokens
    if checked == (T, group):
        return checked
    both = torch.tensor([T, -T], dtype=torch.int64, device=device)  # [max T, -min T]
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both.tolist()
    if high != T or -low != T:
        raise ValueError(f"dispatch_mode: 'fixed' needs the same number of tokens on every "
                         f"EP rank (this rank {T}, min {-low}, max {high}); pad the batch "
                         f"or use 'exact'")
    return T, group


def _dispatch_fixed(
    x_sorted: torch.Tensor,  # [T*K, H] copies sorted by slot
    slot_sorted: torch.Tensor,  # [T*K] their slots, non-decreasing
    slot_counts: torch.Tensor,  # [W*S]
    S: int, W: int, state: DispatchState, group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, None, DispatchState]:
    """"fixed" mode: equal [C, H] blocks per rank pair, C = T*K; fixed shapes, no host sync."""
    TK, H = x_sorted.shape
    C = TK  # one rank never sends another more than all its copies: nothing is dropped
    dest = slot_sorted // S  # [T*K] destination rank, non-decreasing
    rank_counts = slot_counts.view(W, S).sum(1)  # [W] copies for each destination
    rank_start = torch.cumsum(rank_counts, 0) - rank_counts  # [W] first sorted copy per rank
    position = torch.arange(TK, device=x_sorted.device) - rank_start[dest]  # [T*K] in its block
    send_index = dest * C + position  # [T*K] row in the send buffer
    send_x = x_sorted.new_empty(W * C, H)  # [W*C, H] padding rows are never read
    send_x[send_index] = x_sorted
    send_slot = torch.full((W * C,), S, dtype=torch.int64, device=x_sorted.device)  # [W*C], S = pad
    send_slot[send_index] = slot_sorted % S
    recv_x = torch.empty_like(send_x)  # [W*C, H] block r came from rank r
    recv_slot = torch.empty_like(send_slot)  # [W*C] local slot, S on padding rows
    _all_to_all(recv_x, send_x, group=group)
    _all_to_all(recv_slot, send_slot, group=group)
    local_order = torch.argsort(recv_slot, stable=True)  # [W*C] by local slot, padding last
    counts = torch.zeros(S + 1, dtype=torch.int64, device=x_sorted.device)  # [S + 1]
    counts = counts.scatter_add_(0, recv_slot, torch.ones_like(recv_slot))[:S]  # [S]
    state.local_order, state.send_index = local_order, send_index
    return recv_x[local_order], counts, None, state


def combine(
    y_local: torch.Tensor,  # [T_r, H] expert outputs in `dispatch`'s x_local order
    state: DispatchState,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:  # [T, K, H]
    """Return every expert output to the rank and (token, k) position it came from.
    `y_local` has one row per row of `dispatch`'s x_local, in the same order (in "fixed"
    mode [W*C, H]; what the padding rows hold is ignored). A collective over `group`
    (one `all_to_all_single`), no host sync."""
    if state.local_order is None:
        y_sorted = y_local  # [T*K, H]
    elif state.send_index is not None:  # "fixed": the same [W*C] blocks back
        y_recv = torch.empty_like(y_local)  # [W*C, H] back in (source rank, block row) order
        y_recv[state.local_order] = y_local
        y_back = torch.empty_like(y_recv)  # [W*C, H] my copies, where I put them in send_x
        _all_to_all(y_back, y_recv, group=group)
        y_sorted = y_back[state.send_index]  # [T*K, H]
    else:
        y_recv = torch.empty_like(y_local)  # [T_r, H] back in (source rank, slot) order
        y_recv[state.local_order] = y_local
        y_sorted = y_local.new_empty(state.num_tokens * state.top_k, y_local.shape[1])
        _all_to_all(y_sorted, y_recv, state.send_splits, state.recv_splits,
                               group=group)
    inverse = torch.empty_like(state.order)  # [T*K] position of each copy in sorted order
    inverse[state.order] = torch.arange(state.order.numel(), device=state.order.device)
    return y_sorted[inverse].view(state.num_tokens, state.top_k, -1)  # a gather, not a scatter
