"""One rank plans, every rank gets the very same arrays: the plan broadcast.

Used by the runtime (rank 0 of the EP group plans a placement; the other ranks wait in
the broadcast) and by the resize (the first old rank sends the placement in force and
the planned one to every rank of the union). Planning errors travel too: a status flag
in the message makes every rank fail instead of leaving the others waiting.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["PlanBroadcastError", "broadcast_arrays"]


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
