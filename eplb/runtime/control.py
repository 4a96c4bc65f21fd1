"""Rebalance requests from outside the step loop (HTTP, another thread) and how all
ranks agree to act on them at the same step boundary.

Any thread may call `RebalanceRequests.request()`; the step loop of every rank calls
`agree_requested()` every `control_interval` steps while no change is in flight (one
three-integer MAX all-reduce on a CPU/gloo group, so no GPU synchronisation, that also
compares the ranks' forward counts), and when any rank holds a pending request all ranks
rebalance at that same step.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class RequestStatus:
    id: int
    trigger: str
    state: str = "pending"  # pending -> running -> done | failed
    requested_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    step: int | None = None
    result: dict | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class RebalanceRequests:
    """Thread-safe record of requested rebalances and their outcomes (newest `keep` kept)."""

    def __init__(self, keep: int = 256):
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._all: dict[int, RequestStatus] = {}
        self._keep = keep

    def request(self, trigger: str = "api") -> int:
        with self._lock:
            rid = next(self._ids)
            self._all[rid] = RequestStatus(rid, trigger)
            for old in sorted(self._all)[:-self._keep]:
                if self._all[old].state in ("done", "failed"):
                    del self._all[old]
            return rid

    def has_pending(self) -> bool:
        with self._lock:
            return any(s.state == "pending" for s in self._all.values())

    def start(self, step: int) -> list[int]:
        """Mark every pending request as running at `step`; return their ids."""
        with self._lock:
            ids = [i for i, s in self._all.items() if s.state == "pending"]
            for i in ids:
                self._all[i].state, self._all[i].step = "running", step
            return ids

    def finish(self, ids: list[int], result: dict | None = None, error: str | None = None) -> None:
        with self._lock:
            for i in ids:
                s = self._all[i]
                s.state = "failed" if error else "done"
                s.result, s.error, s.finished_at = result, error, time.time()

    def status(self, rid: int) -> dict | None:
        with self._lock:
            s = self._all.get(rid)
            return None if s is None else s.to_dict()


def control_group(group: dist.ProcessGroup | None, timeout: float | None = None
                  ) -> dist.ProcessGroup | None:
    """A new gloo group over the same ranks as `group`, so the per-step agreements never
    touch the GPU stream and fail after `timeout` seconds (None: the default) instead of
    hanging on a dead peer. Collective over the members of `group`."""
    if not dist.is_initialized():
        return None
    return new_group_like(group, "gloo", timeout)


def new_group_like(group: dist.ProcessGroup | None, backend: str,
                   timeout: float | None = None) -> dist.ProcessGroup:
    """A new process group with the ranks of `group` (None: the world) on `backend`; only
    its members take part in the creation. Collective over the members of `group`."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    return dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=True, **kwargs)


def agree(local: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every rank when `local` is True on any rank (one-int MAX all-reduce)."""
    return bool(agree_max([int(local)], group)[0])


def _all_reduce_ints(values: list[int], op, group: dist.ProcessGroup | None) -> list[int]:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def agree_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The element-wise maximum of `values` over all ranks (one int64 MAX all-reduce)."""
    return _all_reduce_ints(values, dist.ReduceOp.MAX, group)


def agree_min(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The element-wise minimum of `values` over all ranks (one int64 MIN all-reduce)."""
    return _all_reduce_ints(values, dist.ReduceOp.MIN, group)


def agree_requested(requests: RebalanceRequests, forwards: int, group: dist.ProcessGroup | None,
                    world_size: int, step: int) -> bool:
    """Whether any rank of the group holds a request (a one-rank group asks no one). The
    same all-reduce compares the ranks' forward counts (`forwards`, from the model's
    `ForwardCounter`): raises RuntimeError on every rank when they differ."""
    pending = requests.has_pending()
    if world_size == 1:
        return pending
    pending, high, low = agree_max([int(pending), forwards, -forwards], group)
    if high != -low:
        raise RuntimeError(
            f"EP ranks ran different numbers of forwards by step {step}: this rank "
            f"{forwards}, the ranks between {-low} and {high}; every rank of the EP group "
            "must run the same number of forwards (the same number of generate() steps, "
            "the same batches) and call runtime.step() after each")
    return bool(pending)


class PendingMin:
    """An element-wise MIN all-reduce of `values` started now (`async_op`: gloo runs it in
    its own thread); `result()` waits for it. Lets the step loop start an agreement at one
    step boundary and read it at the next, so it never waits for a network round trip."""

    def __init__(self, values: list[int], group: dist.ProcessGroup | None) -> None:
        self.tensor = torch.tensor(values, dtype=torch.int64)  # [len(values)]
        self.work = None
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MIN, group=group,
                                        async_op=True)

    def result(self) -> list[int]:
        if self.work is not None:
            self.work.wait()
        return self.tensor.tolist()


class StepAgreement:
    """A placement change's agreement at each step boundary: the element-wise MIN of every
    rank's values on the control group. Synchronous: all-reduced right away. Pipelined
    (asynchronous changes): the all-reduce started at one boundary (`PendingMin`) is read
    at the next, so the step loop never waits for a round trip, and every rank acts on
    the same values one step later; the first boundary only starts one. A one-rank group
    asks no one. A failing group raises (the caller's verdict: fatal)."""

    def __init__(self, group: dist.ProcessGroup | None, num_ranks: int) -> None:
        self.group, self.num_ranks = group, num_ranks
        self.pipelined = False
        self._pending: PendingMin | None = None

    def agree(self, values: Callable[[], list[int]]) -> list[int] | None:
        """The agreed values; None at the first pipelined boundary (started only)."""
        if self.num_ranks == 1:  # group None would be the world
            return values()
        if not self.pipelined:
            return agree_min(values(), self.group)
        if self._pending is None:
            self._pending = PendingMin(values(), self.group)
            return None
        agreed, self._pending = self._pending.result(), None
        return agreed

    def start_next(self, values: list[int]) -> None:
        """Pipelined: start the agreement the next boundary reads (every rank alike)."""
        if self.pipelined and self.num_ranks > 1:
            self._pending = PendingMin(values, self.group)
