"""Hierarchical placement: whole expert groups onto nodes (DeepSeek's node locality),
then every (layer, node) pair is a row of the flat planner."""
from __future__ import annotations

import itertools
from math import comb
from typing import Optional

import numpy as np
import torch

from eplb.core.policy import deepseek
from eplb.core.policy.budgets import SMALL
from eplb.core.policy.moves import plan_rows
from eplb.core.policy.packing import pack
from eplb.core.policy.refinement import improve_pairs
from eplb.core.policy.rows import lexmin, max_load, take


def plan_hierarchical(w, P, M, k, G, prev, tol) -> np.ndarray:
    """Groups -> nodes, then every (layer, node) is a row of the flat planner. w [L, N],
    prev [L, P] or None -> p2l [L, P].

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
    p2l = _place_on_nodes(w, P, M, k, gs, node, prev, tol)
    if prev is None and L * P <= SMALL:
        seed = _deepseek_hierarchical(w, P, M, k, G)  # [L, P]
        seed_node, valid = _node_assignment_of(seed, N, G, k)
        if valid.all():
            alt = _place_on_nodes(w, P, M, k, gs, seed_node, seed, 0.0)
            better = max_load(w, alt, M) < max_load(w, p2l, M)  # [L]
            p2l = np.where(better[:, None], alt, p2l)
    return p2l


def _place_on_nodes(w, P, M, k, gs, node, prev, tol) -> np.ndarray:
    """Placement with the group-to-node assignment `node` [L, G]: every (layer, node) is
    a row of `plan_rows` over that node's experts, with the node's part of `prev`
    [L, P] as its previous placement where it holds exactly those experts."""
    L, N = w.shape
    G = N // gs
    # experts of every node, ascending: [L, k, N/k]; a group's experts are consecutive ids,
    # so this is the order of the groups by (node, group id), each expanded to its experts
    expert_node = np.repeat(node, gs, axis=1)  # [L, N]
    group_order = np.argsort(node, axis=1, kind="stable")  # [L, G]
    order = (group_order[:, :, None] * gs + np.arange(gs)).reshape(L, N)  # [L, N] experts grouped by node
    node_experts = order.reshape(L, k, N // k)
    sub_w = take(w, order).reshape(L * k, N // k)  # [L*k, N/k]
    Pk, Mk = P // k, M // k
    sub_prev = None
    if prev is not None:
        # local id of every expert in its node: its group's rank in the node (G/k groups
        # per node), then its rank in the group
        group_pos = np.empty((L, G), dtype=np.int64)
        group_pos[np.arange(L)[:, None], group_order] = np.arange(G) % (G // k)
        local = (group_pos[:, :, None] * gs + np.arange(gs)).reshape(L, N)  # [L, N]
        lid = take(local, prev).reshape(L, k, Pk)
        same_node = (take(expert_node, prev).reshape(L, k, Pk) == np.arange(k)[None, :, None]).all(-1)  # [L, k]
        sub_prev = np.where(same_node[..., None], lid, -1).reshape(L * k, Pk)
        # every local expert must appear in its node's previous slots
        seen = np.zeros((L * k, N // k), dtype=bool)
        sp = np.maximum(sub_prev, 0)
        sp += (np.arange(L * k) * (N // k))[:, None]
        seen.ravel()[sp] = True
        sub_prev[~seen.all(1)] = -1
    sub = plan_rows(sub_w, Pk, Mk, sub_prev, tol)  # [L*k, P/k] local ids
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
    mapping = np.full((L, k), -1, dtype=np.int64)
    used = np.zeros((L, k), dtype=bool)
    lr = np.arange(L)
    for _ in range(k):
        o = np.where((mapping[:, :, None] < 0) & ~used[:, None, :], ov, -1).reshape(L, -1)
        flat = o.argmax(1)  # first best (new, old) pair
        i, j = flat // k, flat % k
        mapping[lr, i] = j
        used[lr, j] = True
    relabelled = np.take_along_axis(mapping, node, 1)
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


def groups_to_nodes(group_load: np.ndarray, k: int) -> np.ndarray:
    """Node of every group [L, G] (G/k groups per node) with the lowest max node load
    (then the lowest sum of squares): exhaustive when there are few splits, otherwise
    packing plus pair exchanges (groups as items, nodes as GPUs)."""
    L, G = group_load.shape
    if k == G:
        return np.broadcast_to(np.arange(G), (L, G)).copy()
    parts = _partitions(G, k)
    if parts is not None:
        members = np.argsort(parts * G + np.arange(G), axis=1, kind="stable").reshape(len(parts), k, G // k)
        gl = group_load[:, members]  # [L, X, k, G/k] loads of the groups of every node
        node = gl[..., 0].copy()
        for j in range(1, G // k):  # fixed summation order
            node += gl[..., j]
        # max and sum of squares over the k nodes, node by node (a reduction over a short
        # last axis is slow in numpy); the same values, summed in the same order
        top, sq = node[..., 0].copy(), node[..., 0] * node[..., 0]  # [L, X]
        for j in range(1, k):
            np.maximum(top, node[..., j], out=top)
            sq += node[..., j] * node[..., j]
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
    grp = prev // gs  # [L, P]
    flat_grp = grp + (np.arange(L) * G)[:, None]  # [L, P] flat (layer, group)
    node = np.full((L, G), -1, dtype=np.int64)
    node.ravel()[flat_grp] = slot_node  # the group's last slot wins
    # valid: every group seen on exactly one node, G/k groups per node
    seen = np.zeros((L, G, k), dtype=bool)
    flat_grp *= k
    flat_grp += slot_node
    seen.ravel()[flat_grp] = True
    valid = (np.add.reduce(seen, axis=-1, dtype=np.int64) == 1).all(1)
    per_node = np.bincount((node + (np.arange(L) * (k + 1) + 1)[:, None]).ravel(),
                           minlength=L * (k + 1)).reshape(L, k + 1)[:, 1:]  # [L, k] groups per node
    valid &= (per_node == G // k).all(1)
    return node, valid
