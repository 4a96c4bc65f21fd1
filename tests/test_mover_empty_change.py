"""An asynchronous change that changes no layer must finish at the same step on every rank.

`PlacementChange.finished` used to be `layers is not None and committed == len(layers)`:
for a change with no changed layer that turned true as soon as *this rank's* background
thread had planned, which is not agreed (fixed: it now also needs an agreement that every
rank has planned). A rank whose thread planned before the second step
boundary stops, while a rank whose thread had not starts another pipelined agreement
that nobody joins: it waits for the control group's timeout and fails fatally (found by
the asynchronous fuzz in `tests/test_transfer_fuzz.py -m slow`, "failed after 0 of 0
changed layers ... Timed out").

Here one rank's planning is made slow on purpose through the placement object the
runtime is given (its `balancedness`, which the rebalance thread calls to predict the
gain), so the race happens every time. The ranks then step in lockstep, comparing their
maps after every step, and must all end with no change in flight.
"""
from __future__ import annotations

import time

import numpy as np
import torch.distributed as dist

from _dist import assert_same_on_every_rank, run_distributed
from eplb.core.placement import Placement

SLOW_RANK, DELAY = 1, 0.3
_delay = {"seconds": 0.0}  # per process: set on SLOW_RANK only


class SlowPlacement(Placement):
    """A placement whose `balancedness` takes `_delay` seconds (the rebalance thread
    predicts the gain with it before the change knows its layers)."""

    def balancedness(self, load):
        time.sleep(_delay["seconds"])
        return super().balancedness(load)


def _body(rank, world):
    from moe import MoEModel

    from eplb.core.config import EplbConfig
    from eplb.runtime import EplbRuntime
    from test_runtime import _args, check_committed

    args = _args(num_layers=2, num_redundant_experts=world)
    model = MoEModel(args, group=dist.group.WORLD)
    runtime = EplbRuntime(model, EplbConfig(num_redundant_experts=world, rebalance_interval=0,
                                            control_interval=0, async_rebalance=True,
                                            transfer_timeout=2.0))
    _delay["seconds"] = DELAY if rank == SLOW_RANK else 0.0
    for _ in range(3):
        cur = runtime.placement
        same = SlowPlacement(cur.physical_to_logical.copy(), cur.num_logical_experts,
                             cur.num_gpus, cur.num_nodes, "test", None)
        assert runtime.apply_placement(same, wait=False) is None
        for _ in range(40):  # lockstep: 40 steps of >= 20 ms, longer than the delay
            runtime.step()
            for maps in (runtime.physical_to_logical, runtime.logical_to_physical_map,
                         runtime.logical_replica_count):
                assert_same_on_every_rank(maps)
            time.sleep(0.02)
        in_flight = np.array([runtime.rebalance_in_flight])
        assert not in_flight[0], "the change with no changed layer did not finish"
        check_committed(args, runtime, "cpu")
    runtime.close()


def test_async_change_with_no_changed_layer_finishes_together():
    run_distributed(_body, 2, timeout=90)
