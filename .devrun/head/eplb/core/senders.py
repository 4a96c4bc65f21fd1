"""Who sends each expert a rank needs, pure (numpy only): the one greedy, deterministic
sender choice of a placement change.

- assign_senders: one layer of a rebalance (old and new physical_to_logical rows): every
  (receiver, expert) pair a rank needs but did not hold, and the old holder that sends
  it; eplb.core.transfer_plan builds each rank's plan on it;
- choose_senders: the greedy rule itself, shared with eplb.core.resize_plan (a resize,
  where senders and receivers are ranks of two different EP groups).

Every rank runs the same computation on the same rows, so all agree on the senders
without a negotiation round.
"""
from __future__ import annotations

import numpy as np


def check_layer_rows(old, new, num_ranks: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One layer's old and new `[P]` physical_to_logical rows as int64, and S = P // num_ranks;
    a ValueError when they do not fit the ranks and nodes."""
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
    old, new, S = check_layer_rows(old, new, num_ranks, num_nodes)
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
    sender = choose_senders(recv_expert, recv_rank, holders, [0] * num_ranks, num_ranks,
                            node_of=lambda r: r // ranks_per_node)  # [T]
    by_expert = np.lexsort((recv_rank, recv_expert))  # [T]
    return (recv_expert[by_expert].astype(np.int64), recv_rank[by_expert].astype(np.int64),
            sender[by_expert])


def choose_senders(expert, receiver, holders: dict[int, list[int]], sends, ring: int,
                   node_of=None) -> np.ndarray:
    """The sender of each (expert[t], receiver[t]) pair: the greedy choice shared by
    `assign_senders` (a rebalance) and `eplb.core.resize_plan` (a resize). Returns
    sender `[T]` in the order of the pairs.

    Candidates are the `holders[expert]`, restricted to the receiver's node when one there
    holds it (`node_of(rank)`; None: one node). Pairs with fewer candidates are served
    first (then by expert, receiver), each by the candidate with the fewest sends so far
    (`sends[rank]`, updated in place so a caller can carry counts across layers), ties
    broken by ring distance `(candidate - receiver) % ring`, which spreads the sends of
    one hot expert over all its holders. Deterministic."""
    expert = np.asarray(expert, dtype=np.int64).reshape(-1)  # [T]
    receiver = np.asarray(receiver, dtype=np.int64).reshape(-1)  # [T]
    candidates = []
    for r, e in zip(receiver.tolist(), expert.tolist()):
        cands = holders[e]
        if node_of is not None:
            same = [h for h in cands if node_of(h) == node_of(r)]
            cands = same or cands
        candidates.append(cands)
    order = sorted(range(len(candidates)), key=lambda i: (len(candidates[i]), expert[i], receiver[i]))
    sender = np.empty(len(candidates), dtype=np.int64)  # [T]
    for i in order:
        r = int(receiver[i])
        h = min(candidates[i], key=lambda c: (sends[c], (c - r) % ring))
        sends[h] += 1
        sender[i] = h
    return sender
