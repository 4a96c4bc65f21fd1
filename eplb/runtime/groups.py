"""The process groups a runtime uses, owned by whoever builds them.

A runtime needs five groups over the same ranks (the EP group's):

* `ep`: the model's expert-parallel group (the load window's all-reduce);
* `control`: gloo, the step loop's per-step agreements (no GPU synchronisation);
* `plan`: gloo, the rebalance thread's small CPU collectives (plan broadcast, checksum
  gathers), apart from the step loop's so the two threads never share a group;
* `transfer`: the EP group's backend, the weight transfers, apart from the model's
  collectives so a transfer never queues behind them;
* `tokens`: gloo, the IPC transport's CPU tokens (a peer's "slots ready" before an
  `exchange` pulls, and those of the in-place `move`; its `settle` uses `transfer`).

`EplbGroups.create(ep, timeout)` builds them from the EP group (collective over its
members); a caller that must control how groups are made (e.g. `eplb.runtime.resize`,
which creates them on every rank of the world so that torch names them alike whatever
each rank's history) builds them itself with `world_collective=True` and passes them to
`EplbRuntime(..., groups=...)`. Only public torch.distributed calls are used.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["EplbGroups", "NoSpareGroups", "group_ranks"]


class NoSpareGroups(RuntimeError):
    """`renew()` on groups made on every rank of the world, with no spare left: groups the
    members made alone could get different names on different members and hang."""


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of `group` (None or the world: every rank)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def new_group(ranks: list[int], backend: str, timeout: float | None,
              world_collective: bool = False) -> dist.ProcessGroup:
    """A process group over `ranks` on `backend`. `world_collective=False`: only the
    members take part (torch names it from the rank list and the number of groups each
    member has registered, so members must have registered equally many);
    `world_collective=True`: every rank of the world must call it, in the same order
    (non-members get a non-member handle)."""
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    return dist.new_group(ranks=ranks, backend=backend,
                          use_local_synchronization=not world_collective, **kwargs)


@dataclass(frozen=True)
class EplbGroups:
    """The groups one runtime uses (see the module docstring); all but `ep` None without
    torch.distributed or with one rank. `timeout`: seconds a transfer or a thread's
    collective may take; the control group waits twice as long, so a rank that failed
    early still hears from peers that first sat out their transfer timeout."""

    ep: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    plan: dist.ProcessGroup | None
    transfer: dist.ProcessGroup | None
    tokens: dist.ProcessGroup | None = None
    timeout: float = 300.0
    world_collective: bool = False
    # spare (plan, transfer) pairs made with the others, taken by renew() first
    spares: tuple = ()

    @property
    def size(self) -> int:
        return dist.get_world_size(self.ep) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.ep) if dist.is_initialized() else 0

    @classmethod
    def create(cls, ep: dist.ProcessGroup | None = None, timeout: float = 300.0, *,
               world_collective: bool = False, device: torch.device | None = None,
               ranks: list[int] | None = None, spares: int = 0) -> "EplbGroups":
        """Build the control, plan, transfer and tokens groups (and `spares` pairs) over the
        ranks of `ep` (None: the world). Collective over the members of `ep` (over the whole
        world with `world_collective`; non-members then get a value whose groups they must
        not use). Every transfer group is warmed up (`warm_up_transfer`, whatever its
        backend; on `device` when it uses NCCL). `ranks`: the global ranks of `ep`,
        required on a non-member (it cannot ask `ep`). `spares`: extra (plan, transfer)
        pairs made now for `renew()` (see there; resize asks for some, as its groups are
        made world-collectively)."""
        if not dist.is_initialized():
            return cls(ep, None, None, None, None, timeout, world_collective)
        ranks = group_ranks(ep) if ranks is None else sorted(ranks)
        if len(ranks) == 1:
            return cls(ep, None, None, None, None, timeout, world_collective)
        backend = dist.get_backend(ep) if dist.get_rank() in ranks else dist.get_backend()
        control = new_group(ranks, "gloo", 2 * timeout, world_collective)
        plan = new_group(ranks, "gloo", timeout, world_collective)
        transfer = new_group(ranks, backend, timeout, world_collective)
        tokens = new_group(ranks, "gloo", timeout, world_collective)
        pairs = tuple((new_group(ranks, "gloo", timeout, world_collective),
                       new_group(ranks, backend, timeout, world_collective)) for _ in range(spares))
        if dist.get_rank() in ranks:
            for t in (transfer, *(t for _, t in pairs)):
                warm_up_transfer(t, device)
        return cls(ep, control, plan, transfer, tokens, timeout, world_collective, pairs)

    def renew(self, device: torch.device | None = None) -> "EplbGroups":
        """Fresh plan and transfer groups (after an aborted rebalance whose operations may
        still be pending on the old ones). `control` and `tokens` are kept: with the IPC
        transport a still-running aborted change uses the same tokens group (and the
        transport's hold buffer) as the next change (a known limit, docs/reliability.md).
        Collective over the members: a spare pair when there is one, else new groups made
        by the members alone (torch names those from the rank list and each member's count
        of registered groups, so members whose histories of group creation differ, e.g.
        after a resize, need spares). Groups made `world_collective` with no spare left
        raise NoSpareGroups instead of risking that."""
        if self.transfer is None:
            return self
        if self.spares:
            (plan, transfer), rest = self.spares[0], self.spares[1:]
            return replace(self, plan=plan, transfer=transfer, spares=rest)
        if self.world_collective:
            raise NoSpareGroups(
                "no spare process groups left (these were made on every rank of the world, "
                "e.g. by a resize, and groups the members made alone could hang): resize "
                "again or restart the job to get fresh ones")
        ranks = group_ranks(self.ep)
        plan = new_group(ranks, "gloo", self.timeout)
        transfer = new_group(ranks, dist.get_backend(self.ep), self.timeout)
        warm_up_transfer(transfer, device)
        return replace(self, plan=plan, transfer=transfer)


def warm_up_transfer(group: dist.ProcessGroup, device: torch.device | None) -> None:
    """Run on the transfer group, on this thread, the kernels a transfer thread will
    launch (an all-reduce, then one ring of point-to-point messages): NCCL needs a
    collective before its first partial point-to-point batch, and a kernel loaded lazily
    for the first time in the background while the model's NCCL kernels spin can stall
    both. Collective over the group."""
    nccl = dist.get_backend(group) == "nccl"
    dev = device if nccl and device is not None else torch.device("cuda" if nccl else "cpu")
    dist.all_reduce(torch.zeros(1, device=dev), group=group)
    M, r = dist.get_world_size(group), dist.get_rank(group)
    out, into = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    ops = [dist.P2POp(dist.isend, out, dist.get_global_rank(group, (r + 1) % M), group),
           dist.P2POp(dist.irecv, into, dist.get_global_rank(group, (r - 1) % M), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
