"""A placement change's timers and counts live in one record (`ChangeStats`), and the
`RebalanceEvent` is built from it in one place (`RebalanceEvent.of_change`, issue 31):
every figure of the event comes from the field it names, the transfer totals from
`transfer_stats`, the plan's figures from the caller."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.core.transfer_plan import transfer_stats
from eplb.runtime.events import ChangeStats, RebalanceEvent


def test_step_loop_time_adds_up_and_keeps_the_longest_call():
    s = ChangeStats(t_start=10.0)
    for seconds in (0.25, 1.5, 0.125):
        s.charge_step_loop(seconds)
    assert s.seconds_step_loop == pytest.approx(1.875) and s.max_step_loop == 1.5
    assert s.seconds_transfer == 0.0  # unfinished
    s.seconds_plan, s.t_end = 2.0, 15.0
    assert s.seconds_transfer == pytest.approx(3.0)  # end - start - planning
    s.t_end = 11.0
    assert s.seconds_transfer == 0.0  # never negative


@pytest.mark.parametrize("asynchronous", [False, True])
def test_every_event_figure_comes_from_its_source(asynchronous):
    old = Placement.initial(2, 8, 8, 2)  # GPU 0 holds experts 0-3, GPU 1 experts 4-7
    p2l = old.physical_to_logical.copy()  # [L, P]
    p2l[0, [0, 4]] = p2l[0, [4, 0]]  # swap two experts between the GPUs in layer 0
    new = old.with_physical_to_logical(p2l, "test")
    moved = transfer_stats(old, new, 2)
    stats = ChangeStats(t_start=1.0, t_end=4.5, seconds_plan=0.5, seconds_switch=0.75, steps=7,
                        seconds_step_loop=0.3, max_step_loop=0.2, seconds_agree_wait=0.05)
    before, after = np.array([0.5, 0.6]), np.array([0.9, 0.8])  # [L]
    event = RebalanceEvent.of_change(
        stats, moved, step=42, trigger="api", before=before, after=after, placement=new,
        bytes_per_expert=1000, seconds_plan=0.25, asynchronous=asynchronous,
        predicted_gain=0.3, skipped=False, min_gain=0.01, skip_reason="")
    want = dict(step=42, trigger="api", experts_moved=moved.experts_moved,
                local_copies=moved.local_copies, slots_changed=moved.slots_changed,
                bytes_moved=moved.experts_moved * 1000, seconds_plan=0.25,
                seconds_transfer=pytest.approx(3.0), seconds_commit=0.75,
                steps_in_flight=7 if asynchronous else 0, seconds_step_loop=0.3,
                max_step_loop_seconds=0.2, seconds_agree_wait=0.05, predicted_gain=0.3,
                skipped=False, min_gain=0.01, skip_reason="")
    got = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    assert {k: got[k] for k in want} == want
    assert moved.experts_moved == 2 and event.placement is new
    assert event.balancedness_before is before and event.balancedness_after is after
