"""Hierarchical placement: whole expert groups onto nodes (DeepSeek's node locality),
then every (layer, node) pair is a row of the flat planner."""
from __future__ import annotations

import itertools
from math import comb
from typing import Optional

import numpy as np
import torch

from eplb.core.policy import deepseek
from eplb.core.policy.balanced.budgets import SMALL
from eplb.core.policy.balanced.moves import plan_rows
from eplb.core.policy.balanced.packing import pack
from eplb.core.policy.balanced.pairs import improve_pairs
from eplb.core.policy.balanced.rows import lexmin, max_load, take


def plan_hierarchical(w, P, M, k, G, prev, tol, heavy=None) -> np.ndarray:
    """Groups -> nodes, then every (layer, node) is a row of the flat planner. w [L, N],
    prev [L, P] or None, heavy [L] or None (`moves.plan_rows`) -> p2l [L, P].

    From scratch on small problems (L * P <= budgets.SMALL) a second candidate starts
    from DeepSeek's hierarchical placement (its group-to-node assignment and its
    placement inside every node, duplicates repaired, then improved); per layer the one
    with the lower max GPU load is kept. Both keep whole groups on nodes."""
    L, N = w.shape
    gs = N // G  # experts per group
    group_load = w.reshape(L, G, gs).sum(-1)  # [L, G]
    node = groups_to_nodes(group_load, k)  # [L, G]
    if prev is not None:
        prev_node, valid = _node_assignment_of(prev, N, G, k)
        onehot = (prev_node[:, :, None] == np.arange(k))
        prev_max = (group_load[:, :, None] * onehot).sum(1).max(1)  # sums over axis 1: fixed order
        new_max = (group_load[:, :, None] * (node[:, :, None] == np.arange(k))).sum(1).max(1)
        keep = valid & (prev_max <= (1 + tol) * new_max * (1 + 1e-12))
        node = np.where(keep[:, None], prev_node, node)
        node = _relabel_nodes(node, prev_node, valid & ~keep, k)
    p2l = _place_on_nodes(w, P, M, k, gs, node, prev, tol, heavy)
    if prev is None and L * P <= SMALL:
        seed = _deepseek_hierarchical(w, P, M, k, G)  # [L, P]
        seed_node, valid = _node_assignment_of(seed, N, G, k)
        if valid.all():
            alt = _place_on_nodes(w, P, M, k, gs, seed_node, seed, 0.0, heavy)
            better = max_load(w, alt, M) < max_load(w, p2l, M)  # [L]
            p2l = np.where(better[:, None], alt, p2l)
    return p2l


def _place_on_nodes(w, P, M, k, gs, node, prev, tol, heavy=None) -> np.ndarray:
    """Placement with the group-to-node assignment `node` [L, G]: every (layer, node) is
    a row of `plan_rows` over that node's experts, with the node's part of `prev`
    [L, P] as its previous placement where it holds exactly those experts (and its
    layer's `heavy` [L], when given)."""
    L, N = w.shape
    G = N // gs
    Nk = N // k
    lr = np.arange(L)[:, None]
    # experts of every node, ascending: [L, k, N/k]; a group's experts are consecutive ids,
    # so this is the order of the groups by (node, group id), each expanded to its experts
    group_order = np.argsort(node, axis=1, kind="stable")  # [L, G]
    order = np.arange(N).reshape(G, gs)[group_order].reshape(L, N)  # [L, N] experts grouped by node
    node_experts = order.reshape(L, k, Nk)
    sub_w = w.reshape(L, G, gs)[lr, group_order].reshape(L * k, Nk)  # [L*k, N/k] = take(w, order)
    Pk, Mk = P // k, M // k
    sub_prev = None
    if prev is not None:
        # local id of every expert in its node: its group's rank in the node (G/k groups
        # per node), then its rank in the group; gathered together with the expert's node
        # as node * N/k + local id (local ids are below N/k)
        group_pos = np.empty((L, G), dtype=np.int64)
        group_pos[lr, group_order] = np.arange(G) % (G // k)
        gcode = node * Nk + group_pos * gs  # [L, G]
        code = (gcode[:, :, None] + np.arange(gs)).reshape(L, N)  # [L, N]
        q = take(code, prev).reshape(L, k, Pk)  # [L, k, P/k]
        lo = np.arange(k) * Nk  # [k] code of local id 0 of every node
        same_node = (q.min(-1) >= lo) & (q.max(-1) < lo + Nk)  # [L, k] every expert of the node's slots on it
        q -= lo[:, None]  # local ids
        q[~same_node] = -1
        sub_prev = q.reshape(L * k, Pk)
        # every local expert must appear in its node's previous slots: a bincount of
        # (row, local id + 1), -1 in bin 0
        key = sub_prev + (np.arange(L * k) * (Nk + 1) + 1)[:, None]
        cnt = np.bincount(key.ravel(), minlength=L * k * (Nk + 1)).reshape(L * k, Nk + 1)
        sub_prev[cnt[:, 1:].min(1) == 0] = -1
    sub = plan_rows(sub_w, Pk, Mk, sub_prev, tol, None if heavy is None else np.repeat(heavy, k))  # [L*k, P/k] local ids
    glob = take(node_experts.reshape(L * k, -1), sub)  # [L*k, P/k]
    return glob.reshape(L, P)


def _deepseek_hierarchical(w: np.ndarray, P: int, M: int, k: int, G: int) -> np.ndarray:
    """DeepSeek EPLB's hierarchical placement of w [L, N] (eplb.core.policy.deepseek): p2l [L, P]."""
    p2l, _, _ = deepseek.rebalance_experts(torch.tensor(w, dtype=torch.float64), P, G, k, M)
    return p2l.numpy().astype(np.int64)


def _relabel_nodes(node: np.ndarray, prev_node: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """For the layers in `rows` (new group-to-node assignment), renumber the new nodes so
    that each takes the previous node sharing most groups with it (greedy over k steps,
    all layers at once). node, prev_node [L, G] -> [L, G]."""
    if not rows.any():
        return node
    L = node.shape[0]
    # ov [L, k new, k old]: shared groups (a bincount; previous node -1 = not seen, dropped)
    key = (np.arange(L)[:, None] * k + node) * (k + 1) + (prev_node + 1)  # [L, G]
    ov = np.bincount(key.ravel(), minlength=L * k * (k + 1)).reshape(L, k, k + 1)[..., 1:]
    o = ov.reshape(L, k * k).copy()  # [L, k new * k old] pairs still free (-1: taken)
    o3 = o.reshape(L, k, k)
    mapping = np.empty((L, k), dtype=np.int64)
    lr = np.arange(L)
    for _ in range(k):
        flat = o.argmax(1)  # first best (new, old) pair
        i, j = flat // k, flat % k
        mapping[lr, i] = j
        o3[lr, i, :] = -1  # new node i is mapped
        o3[lr, :, j] = -1  # old node j is used
    relabelled = mapping[lr[:, None], node]
    return np.where(rows[:, None], relabelled, node)


_PARTITIONS: dict[tuple[int, int], np.ndarray] = {}


def _partitions(G: int, k: int) -> Optional[np.ndarray]:
    """All ways to split G groups into k unlabelled blocks of G/k, as block index arrays
    [X, G] (block of each group, blocks numbered by their smallest group), or None when
    there are more than 20000."""
    key = (G, k)
    if key not in _PARTITIONS:
        size = G // k
        count = 1
        rest = G
        for _ in range(k):
            count *= comb(rest - 1, size - 1)
            rest -= size
        if count > 20000:
            _PARTITIONS[key] = None
        else:
            out = []

            def rec(assign, remaining, block):
                if not remaining:
                    out.append(list(assign))
                    return
                head, others = remaining[0], remaining[1:]
                for mates in itertools.combinations(others, size - 1):
                    for g in (head, *mates):
                        assign[g] = block
                    rec(assign, [g for g in others if g not in mates], block + 1)

            rec([0] * G, list(range(G)), 0)
            _PARTITIONS[key] = np.array(out, dtype=np.int64)
    return _PARTITIONS[key]


_MEMBERS: dict[tuple[int, int], np.ndarray] = {}


def _members(G: int, k: int) -> np.ndarray:
    """Groups of every block of every split of `_partitions(G, k)`: [k, G/k, X], block b's
    groups ascending (X splits last, for node loads laid out [L, X])."""
    key = (G, k)
    if key not in _MEMBERS:
        parts = _partitions(G, k)
        members = np.argsort(parts * G + np.arange(G), axis=1, kind="stable").reshape(len(parts), k, G // k)
        _MEMBERS[key] = np.ascontiguousarray(members.transpose(1, 2, 0))
    return _MEMBERS[key]


def groups_to_nodes(group_load: np.ndarray, k: int) -> np.ndarray:
    """Node of every group [L, G] (G/k groups per node) with the lowest max node load
    (then the lowest sum of squares): exhaustive when there are few splits, otherwise
    packing plus pair exchanges (groups as items, nodes as GPUs)."""
    L, G = group_load.shape
    if k == G:
        return np.broadcast_to(np.arange(G), (L, G)).copy()
    parts = _partitions(G, k)
    if parts is not None:
        members = _members(G, k)  # [k, G/k, X]
        # max and sum of squares of the k node loads, node by node (a reduction over a
        # short axis is slow in numpy); every node's groups summed in a fixed order
        for b in range(k):
            node = np.take(group_load, members[b, 0], axis=1)  # [L, X] load of node b
            for j in range(1, G // k):
                node += np.take(group_load, members[b, j], axis=1)
            if b == 0:
                top, sq = node, node * node
            else:
                np.maximum(top, node, out=top)
                sq += node * node
        best = lexmin(top, sq)
        return parts[best]
    ones = np.ones((L, G), dtype=np.int64)
    p2l = pack(group_load, ones, k)  # [L, G] group of each "slot"
    p2l = improve_pairs(group_load, p2l, k, 40)
    node = np.empty((L, G), dtype=np.int64)
    node[np.arange(L)[:, None], p2l] = np.arange(G) // (G // k)
    return node


def _node_assignment_of(prev: np.ndarray, N: int, G: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Node of every group [L, G] in a previous placement [L, P], and [L] bool: whether
    that placement keeps whole groups on nodes with G/k groups each."""
    L, P = prev.shape
    gs = N // G
    slot_node = np.arange(P) // (P // k)  # [P]
    # slots of every (layer, node, group): a bincount of the flat index
    flat = prev // gs  # [L, P] group
    flat += (np.arange(L) * (k * G))[:, None]
    flat += slot_node * G
    seen = np.bincount(flat.ravel(), minlength=L * k * G).reshape(L, k, G) > 0  # [L, k, G]
    # the group's last slot wins: slots go node by node, so its highest node (-1: not seen)
    node = (seen * np.arange(1, k + 1)[:, None]).max(1) - 1  # [L, G]
    # valid: every group seen on exactly one node (then its node), G/k groups per node
    valid = (np.add.reduce(seen, axis=1) == 1).all(1) & (np.add.reduce(seen, axis=2) == G // k).all(1)
    return node, valid
