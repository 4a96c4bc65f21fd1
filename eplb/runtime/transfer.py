"""Moving expert weights from one placement to the next, into the model's own tensors.

Four modules:

* `eplb.core.transfer_plan` (pure, numpy): from the old and new `physical_to_logical` rows of
  one layer, one rank's plan: which local slots stay, which are filled from an expert the
  rank already holds, which experts arrive from which peer and what the rank sends;
* how experts travel: `eplb.runtime.transports.P2PTransport` (NCCL or gloo point-to-point),
  `eplb.runtime.ipc.IpcTransport` (CUDA IPC on one host), picked by
  `eplb.runtime.transport_choice.make_transport`, both `Transport`s
  (`eplb.runtime.transport_base`: the contract and its defaults);
* `eplb.runtime.staging`: the staging buffer, the run-wise slot copies, and
  `write_layer`, the default write of staging into the slots;
* this module: one layer carried out *into the model's own tensors* (`exchange_layer`,
  `execute_layer_transfer`): weights are written with `copy_` into slot
  views, so storage and `data_ptr` never change and CUDA graphs and registered views stay
  valid. (`TransferExecutor`, the standalone whole-placement move of tools and
  benchmarks, is in `eplb.runtime.executor`, above the one layer mover it drives.)

Per layer and rank the execution is (after vLLM's `move_to_buffer`/`move_from_buffer`
and SGLang's `update_expert_weights_single_layer`), in two public halves that an
asynchronous caller can run apart (`exchange_layer` in a background thread or launched
from the step loop, on a side stream; the transport's `write`, by default
`staging.write_layer`, at a step boundary):

1. (`exchange_layer`) copy experts needed locally whose only local source slot is about
   to be overwritten into a staging buffer (an in-place write could clobber the source);
2. (`exchange_layer`) move the remote experts into staging, reading the peers' untouched
   weights, through a transport;
3. (`write_layer`) write every changed slot from staging, or straight from an unchanged
   local slot that holds the same expert (unchanged slots are never written, so they are
   safe sources).

A synchronous move over CUDA IPC skips the staging of received experts
(`IpcTransport.move`, used by `execute_layer_transfer`): every rank first copies the old
experts of its changed slots that someone still reads into a *hold buffer*, and each
sender then writes its experts straight into the receivers' slots while later hold
chunks are still being copied. Each byte crosses NVLink once and is written once
(`in_place_ops`, pure, says which copies).

Extra memory: the staging buffer (`staging_rows(plan)` <= S rows, one layer of local
experts; for the IPC transport its hold buffer, allocated once, serves as both) plus,
for the point-to-point transport only, pack buffers of at most 2 x `chunk_bytes` per
receiving peer when sends need packing, taken from the staging rows a layer leaves
unused when they have room.
"""
from __future__ import annotations

from typing import Sequence

import torch

from eplb.core.transfer_plan import LayerTransferPlan
from eplb.runtime.staging import allocate_staging, check_staging, check_weights
from eplb.runtime.transport_choice import resolve_transport

__all__ = ["exchange_layer", "execute_layer_transfer"]


def exchange_layer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor], group,
                   staging: Sequence[torch.Tensor], *, transport=None) -> int:
    """Phases 1 and 2 of one layer: fill staging rows `0 .. plan.num_staged - 1` (local
    copies of sources that will be overwritten, and the experts received from peers).
    Reads `weights` and never writes them. Returns bytes received.

    On CUDA the work may be left queued on the current stream (like NCCL's `work.wait()`):
    staging is ready once an event recorded on the current stream afterwards completes. It
    never touches the default stream explicitly nor synchronizes the device, so it may run
    in a background thread with a side stream current.
    `transport`: None or "nccl" (`P2PTransport` with `DEFAULT_CHUNK_BYTES`), or an object
    from `make_transport`. Every rank of `group` with a non-noop plan for the layer must
    call it (plans of all ranks come from the same rows); noop ranks may skip it.
    """
    weights = check_weights(plan, weights)
    if plan.is_noop:
        return 0
    if staging is None:
        raise ValueError("staging is required: allocate_staging(weights, staging_rows(plan))")
    staging = list(staging)
    check_staging(staging, weights, plan.num_staged)
    return resolve_transport(transport).exchange(plan, weights, group, staging)


def execute_layer_transfer(plan: LayerTransferPlan, weights: Sequence[torch.Tensor],
                           group=None, staging: Sequence[torch.Tensor] | None = None, *,
                           transport=None) -> int:
    """Carry out `plan` on one layer's local expert tensors, in place; return bytes received:
    when the transport `can_move` the layer (IPC with a hold buffer), its `move` (received
    experts go straight into their slots, no staging); otherwise `exchange_layer`, the
    transport's `settle` (IPC: wait until peers finished reading), then its `write`.

    `weights`: tensors `[S, ...]` (stacked local slots, views allowed, non-contiguous too),
    written only through `copy_` into slot views, so storage and `data_ptr` are unchanged.
    `staging`: optional reusable buffer as from `allocate_staging` (at least
    `plan.num_staged` rows); else exactly the rows needed are allocated.
    `group`: the process group whose (group-relative) ranks the plan uses.
    Every rank of the group must call this for the layer (ranks with nothing to do return
    at once). Under NCCL the group must already have run a collective, since a first
    `batch_isend_irecv` that leaves some ranks out is undefined behaviour.
    """
    weights = check_weights(plan, weights)
    if plan.is_noop:
        return 0
    transport = resolve_transport(transport)
    if transport.can_move(weights):
        return transport.move(plan, weights, group)
    staging = allocate_staging(weights, plan.num_staged) if staging is None else list(staging)
    received = exchange_layer(plan, weights, group, staging, transport=transport)
    transport.settle(plan, group)
    transport.write(plan, weights, staging)
    return received
