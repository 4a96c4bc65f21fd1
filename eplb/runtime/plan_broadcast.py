"""One rank plans, every rank gets the very same arrays: the plan broadcast.

Used by the runtime (`Rank0Planner`: rank 0 of the EP group plans a placement; the other
ranks wait in the broadcast) and by the resize (the first old rank sends the placement in force and
the planned one to every rank of the union). Planning errors travel too: a status flag
in the message makes every rank fail instead of leaving the others waiting.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.core.planning import plan
from eplb.runtime.planner_process import PlannerProcess, PlannerProcessError

__all__ = ["PlanBroadcastError", "Rank0Planner", "broadcast_arrays"]

log = logging.getLogger("eplb.runtime")


class PlanBroadcastError(RuntimeError):
    """Planning failed on the root rank; raised on every other rank (the root re-raises
    its own error)."""


def broadcast_arrays(make: Callable[[], Sequence[np.ndarray | None]] | None,
                     shapes: Sequence[tuple[int, ...]], group, src: int = 0,
                     device: torch.device | None = None) -> list[np.ndarray | None]:
    """`make()` runs on the group rank `src` only and returns one array (or None) per
    entry of `shapes`; every rank of `group` returns the same arrays, as float64 (exact
    for slot and expert ids; the caller casts). One broadcast of float64
    `[sum of sizes + len(shapes) + 1]` (values, a present flag per array, a status flag),
    on `device` (default CPU: a gloo group). An exception in `make()` is re-raised on
    `src`; the other ranks raise PlanBroadcastError. With `group` None (no
    torch.distributed, or a one-rank group: pass the world as `dist.group.WORLD`) or a
    one-rank group it just calls `make()`.
    """
    sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes)
    msg = torch.zeros(total + len(shapes) + 1, dtype=torch.float64,
                      device=device or torch.device("cpu"))  # [sum + A + 1]
    distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    me = dist.get_rank(group) if distributed else src
    error = None
    if me == src:
        try:
            arrays = list(make())
            if len(arrays) != len(shapes):
                raise ValueError(f"make() returned {len(arrays)} arrays, expected {len(shapes)}")
            off = 0
            for i, (a, s, n) in enumerate(zip(arrays, shapes, sizes)):
                if a is not None:
                    a = np.asarray(a, dtype=np.float64)
                    if a.shape != tuple(s):
                        raise ValueError(f"array {i} has shape {a.shape}, expected {tuple(s)}")
                    msg[off:off + n].copy_(torch.from_numpy(a.ravel().copy()))
                    msg[total + i] = 1
                off += n
            msg[-1] = 1
        except Exception as e:  # noqa: BLE001 - the status flag tells every rank
            error = e
    if distributed:
        dist.broadcast(msg, src=dist.get_global_rank(group, src), group=group)
    if error is not None:
        raise error
    out = msg.cpu().numpy()
    if out[-1] != 1:
        raise PlanBroadcastError(f"planning failed on rank {src} of the group (see its log)")
    arrays, off = [], 0
    for i, (s, n) in enumerate(zip(shapes, sizes)):
        arrays.append(out[off:off + n].reshape(s).copy() if out[total + i] == 1 else None)
        off += n
    return arrays


class Rank0Planner:
    """The runtime's planner: rank 0 of the EP group plans, every rank gets the very same
    placement through one broadcast on the plan group.

    In asynchronous mode rank 0 plans in a child process (`PlannerProcess`, so planning
    never holds the serving process's GIL) when `use_process` and the policy is built in;
    otherwise in the calling thread. `plan` is collective over `group`."""

    def __init__(self, config: EplbConfig, num_gpus: int, num_expert_groups: int, rank: int,
                 use_process: bool = False) -> None:
        self.config, self.num_gpus, self.num_expert_groups = config, num_gpus, num_expert_groups
        self.rank = rank
        self.process: PlannerProcess | None = None
        if rank == 0 and use_process:
            self.process = self._start_process()

    def _start_process(self) -> PlannerProcess | None:
        """The child process rank 0 plans in, or None to plan in the calling thread: when
        the policy was registered at run time (unknown in the child) or the child cannot
        start."""
        try:
            planner = PlannerProcess()
            if planner.can_plan(self.config.policy):
                return planner
            planner.close()
            log.info("eplb: policy %r is not built in: planning in the rebalance thread",
                     self.config.policy)
        except (OSError, PlannerProcessError) as e:
            log.warning("eplb: the planner process did not start (%s): planning in the "
                        "rebalance thread", e)
        return None

    def plan_here(self, load: np.ndarray, previous: Placement,
                  move_tolerance: float | None = None, step_choices: float = 0.0) -> Placement:
        """Rank 0's planning call (in the planner process when there is one);
        `move_tolerance` None: the config's. `step_choices` > 0 (token-expert choices per
        step and layer of `load`) turns on the config's decode-aware packing
        (`read_tokens`, `dispatch_tokens`, `tile_rows`) and the planner's heavy-replica
        check (`balanced.moves.HEAVY_ROWS`, whatever `read_tokens`)."""
        fn = self.process.plan if self.process is not None else plan
        c = self.config
        tol = c.move_tolerance if move_tolerance is None else move_tolerance
        reads = c.read_tokens if step_choices > 0 else 0.0
        return fn(load, self.num_gpus, previous.num_slots, c.num_nodes, self.num_expert_groups,
                  c.policy, previous=previous, move_tolerance=tol,
                  weighted=c.weighted_replicas, read_tokens=reads,
                  step_choices=float(step_choices),
                  dispatch_tokens=c.dispatch_tokens, tile_rows=c.tile_rows)

    def warm_up(self, previous: Placement) -> None:
        """Plan once on a uniform load, now (rank 0): the first plan of a process pays for
        imports and first-call costs (tens of ms of Python holding the GIL), which would
        otherwise land in the first rebalance and delay the steps served beside it."""
        if self.rank == 0:
            self.plan_here(np.ones((previous.num_layers, previous.num_logical_experts)), previous)

    def plan(self, load: np.ndarray, previous: Placement, group,
             move_tolerance: float | None = None, step_choices: float = 0.0) -> Placement:
        """Rank 0 plans on `load [L, N]` (with `move_tolerance`, None: the config's;
        `step_choices`: see `plan_here`); every rank of `group` returns the same placement
        (a planning error on rank 0 is raised there, RuntimeError on the others)."""
        L, P = previous.num_layers, previous.num_slots

        def make():
            planned = self.plan_here(load, previous, move_tolerance, step_choices)
            return planned.physical_to_logical, planned.shares

        try:
            p2l, shares = broadcast_arrays(make, [(L, P), (L, P)], group)
        except PlanBroadcastError as e:
            raise RuntimeError(str(e)) from None
        return previous.with_physical_to_logical(p2l.astype(np.int64), self.config.policy, shares)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None
