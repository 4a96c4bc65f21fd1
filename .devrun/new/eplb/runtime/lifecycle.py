"""What outlives an `EplbRuntime` in its process: runtimes still alive at exit are closed
then (`track`), and the process groups of closed runtimes are destroyed at exit rather
than at `close()` (`retire`).

Why at exit: torch names a group made with use_local_synchronization by hashing its
ranks, skipping the names of live groups, so destroying one frees its name and the next
runtime's group would reuse it, with the old group's addresses still in the store under
that name (its ranks then connect to closed ports and the creation times out)."""
from __future__ import annotations

import atexit
import logging
import weakref

import torch.distributed as dist

from eplb.runtime.groups import EplbGroups

log = logging.getLogger("eplb.runtime")

__all__ = ["retire", "track"]

_LIVE = weakref.WeakSet()  # runtimes to close at exit if still alive (weak references)
_RETIRED: list[dist.ProcessGroup] = []  # groups of closed runtimes, destroyed at exit


def track(runtime) -> None:
    """Close `runtime` (its `close()`) at exit if it is still alive then."""
    _LIVE.add(runtime)


def retire(groups: EplbGroups) -> None:
    """Destroy the groups a runtime made (all but `ep`, the caller's) at exit, not now."""
    _RETIRED.extend(x for x in (groups.transfer, groups.plan, groups.control, groups.tokens,
                                *sum(groups.spares, ())) if x is not None)


@atexit.register
def _at_exit() -> None:
    """Stop the background work of runtimes still alive (see `EplbRuntime.close`), then
    destroy the retired groups (unless the default group is gone already)."""
    for runtime in list(_LIVE):
        try:
            runtime.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("eplb: closing a runtime at exit failed")
    while _RETIRED:
        group = _RETIRED.pop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - destroyed with the default group, or exiting
                pass
