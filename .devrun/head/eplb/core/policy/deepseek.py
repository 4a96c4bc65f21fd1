"""DeepSeek EPLB, reimplemented faithfully (deepseek-ai/EPLB after commit e1100fe).

The baseline every other planner is measured against. Same rules, same arithmetic:

- loads are cast to float32 on the CPU, as DeepSeek does;
- items are ordered by `torch.sort(descending=True)` (not stable), so ties fall the way
  the reference code lets them fall with the installed torch;
- a pack / an extra replica goes to the *first* minimum / maximum on ties.

Known weakness kept on purpose (deepseek-ai/EPLB issue #22): two replicas of one expert
can land on the same GPU. Better planners live in other modules; this one stays faithful.

Only the Python loop of `balanced_packing` is restructured: it runs over items with all
rows (layers) at once, which makes the same choices as the row-by-row loop, only faster.
"""
from __future__ import annotations

import numpy as np
import torch

Tensor = torch.Tensor


def balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    """Pack the n items of every row into `num_packs` packs of exactly n / num_packs items.

    Heaviest item first, each into the lightest pack that still has room.

    weight: [X, n] float. Returns pack_index [X, n] (pack of each item) and
    rank_in_pack [X, n] (position of the item inside its pack), both int64.
    """
    num_rows, num_items = weight.shape
    if num_items % num_packs:
        raise ValueError(f"cannot split {num_items} items evenly into {num_packs} packs")
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:  # one item per pack: the identity
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(num_rows, -1).clone()  # [X, n]
        rank_in_pack = torch.zeros(num_rows, num_items, dtype=torch.int64)  # [X, n]
        return pack_index, rank_in_pack

    order = weight.sort(dim=-1, descending=True).indices  # [X, n] heaviest first
    pack_index = torch.full((num_rows, num_items), -1, dtype=torch.int64)  # [X, n]
    rank_in_pack = torch.full((num_rows, num_items), -1, dtype=torch.int64)  # [X, n]
    pack_weight = torch.zeros(num_rows, num_packs, dtype=weight.dtype)  # [X, num_packs]
    pack_items = torch.zeros(num_rows, num_packs, dtype=torch.int64)  # [X, num_packs]
    rows = torch.arange(num_rows)  # [X]
    full = torch.tensor(float("inf"), dtype=weight.dtype)
    for k in range(num_items):
        item = order[:, k]  # [X]
        # lightest pack with room; argmin returns the first index on ties, like min()
        pack = torch.where(pack_items < items_per_pack, pack_weight, full).argmin(dim=-1)  # [X]
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_items[rows, pack]
        pack_weight[rows, pack] += weight[rows, item]
        pack_items[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: Tensor, num_phy: int) -> tuple[Tensor, Tensor, Tensor]:
    """Give `num_phy - num_log` extra replicas, one at a time, to the expert with the
    highest load per replica (greedy min-max of the per-replica load).

    weight: [X, num_log] float. Returns phy2log [X, num_phy] (expert of each replica:
    replica i < num_log is expert i, replica i >= num_log is the i-th added one),
    rank [X, num_phy] (replica rank of each replica within its expert) and
    logcnt [X, num_log] (replica count of each expert), all int64.
    """
    num_rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"num_phy ({num_phy}) < number of experts ({num_log})")
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(num_rows, 1)  # [X, num_phy]
    rank = torch.zeros(num_rows, num_phy, dtype=torch.int64)  # [X, num_phy]
    logcnt = torch.ones(num_rows, num_log, dtype=torch.int64)  # [X, num_log]
    rows = torch.arange(num_rows)  # [X]
    for i in range(num_log, num_phy):
        hottest = (weight / logcnt).max(dim=-1).indices  # [X]
        phy2log[:, i] = hottest
        rank[:, i] = logcnt[rows, hottest]
        logcnt[rows, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: Tensor) -> Tensor:
    """Inverse of every row permutation: perm [X, n] -> inv [X, n] with inv[perm] = arange."""
    inv = torch.empty_like(perm)  # [X, n]
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand_as(perm))
    return inv


def rebalance_experts_hierarchical(
    weight: Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Three steps: pack expert groups onto nodes, replicate experts inside each node,
    pack the replicas onto the node's GPUs.

    weight: [L, N] float. Returns phy2log [L, P], phyrank [L, P] (replica rank of each
    slot) and logcnt [L, N], all int64.
    """
    num_layers, num_logical = weight.shape
    if num_logical % num_groups:
        raise ValueError(f"num experts ({num_logical}) must be divisible by num_groups ({num_groups})")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must be divisible by num_nodes ({num_nodes})")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")
    if num_physical_experts % num_gpus:
        raise ValueError(f"num slots ({num_physical_experts}) must be divisible by num_gpus ({num_gpus})")
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    slots_per_gpu = num_physical_experts // num_gpus

    # Step 1: groups -> nodes. "mlog" numbers experts node-major: node 0's groups first.
    tokens_per_group = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, G]
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)  # [L, G], [L, G]
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)  # [L, G, 1]
        + torch.arange(group_size, dtype=torch.int64)  # [group_size]
    ).flatten(-2)  # [L, N]
    mlog2log = _inverse(log2mlog)  # [L, N]

    # Step 2: replicate inside every node: one row per (layer, node).
    tokens_per_mlog = weight.gather(-1, mlog2log).view(-1, experts_per_node)  # [L * nodes, N / nodes]
    phy2mlog, phyrank, mlogcnt = replicate_experts(
        tokens_per_mlog, num_physical_experts // num_nodes
    )  # [L * nodes, P / nodes] x2, [L * nodes, N / nodes]

    # Step 3: replicas -> GPUs of their node, by load per replica.
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)  # [L * nodes, P / nodes]
    gpu_pack, gpu_rank = balanced_packing(tokens_per_phy, num_gpus // num_nodes)  # [L * nodes, P / nodes] x2
    phy2pphy = gpu_pack * slots_per_gpu + gpu_rank  # [L * nodes, P / nodes] replica -> slot in node
    pphy2phy = _inverse(phy2pphy)  # [L * nodes, P / nodes] slot in node -> replica

    pphy2mlog = phy2mlog.gather(-1, pphy2phy)  # [L * nodes, P / nodes] (node-local mlog ids)
    node_offset = torch.arange(0, num_logical, experts_per_node, dtype=torch.int64).view(1, -1, 1)  # [1, nodes, 1]
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1) + node_offset).flatten(-2)  # [L, P]
    pphy2log = mlog2log.gather(-1, pphy2mlog)  # [L, P]
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)  # [L, P]
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)  # [L, N]
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek's entry point: hierarchical when the groups divide over the nodes, else
    global (the hierarchical algorithm with one group on one node).

    weight: [L, N] load per logical expert. Returns phy2log [L, P], log2phy [L, N, maxcnt]
    (slots of each expert by replica rank, -1 padded) and logcnt [L, N], all int64.
    """
    weight = torch.as_tensor(weight).float().cpu()  # [L, N]
    num_layers, num_logical = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )  # [L, P], [L, P], [L, N]
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_count = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical, max_count), -1, dtype=torch.int64)  # [L, N, maxcnt]
    log2phy.view(num_layers, -1).scatter_(
        -1,
        phy2log * max_count + phyrank,  # [L, P] flat position of every slot
        torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1),  # [L, P]
    )
    return phy2log, log2phy, logcnt


def deepseek_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    """DeepSeek EPLB as a policy (registered as `deepseek`): `rebalance_experts` on `load
    [L, N]`; ignores `previous` and the options, as the published algorithm does."""
    phy2log, _, _ = rebalance_experts(
        torch.tensor(load, dtype=torch.float64), num_slots, num_groups, num_nodes, num_gpus
    )  # [L, P]
    return phy2log.numpy().astype(np.int64)
