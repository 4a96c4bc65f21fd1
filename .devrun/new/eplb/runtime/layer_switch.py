"""What the step loop does to one layer of a placement change, on the caller's thread and
stream, once the change's agreement says every rank may: `switch_layer` (write the staged
experts into the changed slots, or move the layer in place, then copy the layer's rows of
the new maps: weights and maps switch together) and `launch_exchange` (launch a prepared
layer's exchange on the mover's side stream, at the same step on every rank). When to do
either is `eplb.runtime.placement_change`'s agreement; this module is the doing."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from eplb.core.transfer_plan import LayerTransferPlan
from eplb.runtime import transfer as _transfer
from eplb.runtime.events import ChangeStats
from eplb.runtime.transport_base import Transport

__all__ = ["bytes_per_slot", "launch_exchange", "switch_layer"]


def switch_layer(plan: LayerTransferPlan, weights: list[torch.Tensor], layer: int, *,
                 staging: list[torch.Tensor] | None, maps: Sequence[torch.Tensor],
                 new_maps: Sequence[torch.Tensor], transport: Transport, group,
                 in_place: bool, ready_event, device: torch.device,
                 stats: ChangeStats):
    """Switch `layer` on the current stream: weights (the transport's `write` from
    `staging` after `ready_event`, the staging being complete; or, `in_place`, its whole
    synchronous `move`), then the layer's rows of `maps [L, ...]` from `new_maps`. Counts
    into `stats`; returns the CUDA event after the switch (None on CPU). Raises whatever
    failed: the layer may then be partly written."""
    cuda = device.type == "cuda"
    if in_place:  # synchronous IPC: exchange and write in one pass
        stats.bytes_received += _transfer.execute_layer_transfer(plan, weights, group,
                                                                 transport=transport)
    else:
        if cuda:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(ready_event)
            # staging and the new maps come from the mover thread's stream: keep their
            # memory from being reused before this stream has read them
            for t in (*staging, *new_maps):
                t.record_stream(stream)
        transport.write(plan, weights, staging)
        stats.bytes_received += plan.num_received * bytes_per_slot(weights)
    for dst, src in zip(maps, new_maps):
        dst[layer].copy_(src[layer])
    event = None
    if cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    stats.received += plan.num_received
    stats.local_copies += plan.num_local_copies
    stats.written += plan.num_slots_written
    stats.bytes_sent += plan.num_sent * bytes_per_slot(weights)
    return event


def launch_exchange(plan: LayerTransferPlan, weights: list[torch.Tensor],
                    staging: list[torch.Tensor], *, transport: Transport, group, stream) -> None:
    """Launch a prepared layer's exchange from the step loop on the mover thread's `stream`
    (None: CPU, the current one), so what that thread queues next (checksums, the event
    the switch waits for) comes after it."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _transfer.exchange_layer(plan, weights, group, staging, transport=transport)


def bytes_per_slot(weights: Sequence[torch.Tensor]) -> int:
    """Bytes of one expert over the layer's weight tensors (0 without slots)."""
    return sum(w[0].nbytes for w in weights) if weights and weights[0].shape[0] else 0
