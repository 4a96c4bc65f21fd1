"""The transport contract, written down: `Transport` (what the layer mover and
`eplb.runtime.transfer` call on a transport, and when) and `TransportBase` (the optional
members' default behaviour; every transport derives from it; its `write` is
`eplb.runtime.staging.write_layer`).

Below both transports (`eplb.runtime.transports.P2PTransport`, `eplb.runtime.ipc.IpcTransport`)
and the mover, so each of them imports it and none imports the others back.

Shapes: `weights` is one layer's local expert tensors, each `[S, ...]` (stacked slots,
views allowed, non-contiguous too), written only with `copy_` into slot views; `staging`
one contiguous `[>= plan.num_staged, ...]` buffer per weight tensor (same dtype and
device); `plan` the rank's `LayerTransferPlan` of that layer; `group` the process group
whose group-relative ranks the plan uses (the runtime's transfer group).
"""
from __future__ import annotations

import abc
from typing import ClassVar, Protocol, Sequence, runtime_checkable

import torch

from eplb.core.transfer_plan import LayerTransferPlan
from eplb.runtime.staging import write_layer

__all__ = ["REQUIRED", "Transport", "TransportBase"]


@runtime_checkable
class Transport(Protocol):
    """How one layer's experts travel between the ranks of a group. Required: `name`,
    `exchange`, `settle`; the rest have defaults in `TransportBase`.

    Threads and streams: `exchange` runs on the thread that moves the layer: the caller's
    (synchronous), the rebalance thread (asynchronous, launch "thread") or the step loop
    (asynchronous, launch "step"), with a side CUDA stream current in the last two; it may
    leave its work queued on the current stream. `write`, `move` and `close` run on the
    caller's thread (the step loop), `write` and `move` on the caller's stream. `can_move`
    is called where the layer is prepared (either thread); `settle` only by
    `transfer.execute_layer_transfer` (the mover's agreement is its barrier instead)."""

    name: ClassVar[str]
    """The `EplbConfig.transport` value it stands for ("nccl", "ipc"), for logs."""

    exchange_launches_no_kernels: ClassVar[bool]
    """True when `exchange` launches no NCCL kernel, so it may run in a background thread
    beside the model's collectives (`MoveOptions.launch="auto"` then keeps it in the
    thread); False: an asynchronous change on GPUs launches it from the step loop."""

    hold: list[torch.Tensor] | None
    """A buffer of one layer of local experts the transport owns (`[S, ...]` per weight
    tensor), or None. `StagingCache` uses it as the change's staging buffer when it fits,
    so a change adds no memory (the IPC transport's hold buffer)."""

    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        """Fill staging rows `0 .. plan.num_staged - 1`: local sources about to be
        overwritten and the experts received from peers. Only READS `weights` (the model
        serves meanwhile). Every rank with a non-noop plan for the layer calls it. Returns
        bytes received."""
        ...

    def settle(self, plan: LayerTransferPlan, group) -> None:
        """After `exchange`, before writing: order this rank's writes after every peer's
        reads of its slots (a no-op where `exchange` already completed the sends)."""
        ...

    def write(self, plan: LayerTransferPlan, weights: list[torch.Tensor],
              staging: list[torch.Tensor]) -> None:
        """Write every changed slot of the layer from staging or an unchanged local slot
        (the switch). Default: `write_layer`."""
        ...

    def can_move(self, weights: Sequence[torch.Tensor]) -> bool:
        """Whether `move` can carry out a layer of these weights. Default: False."""
        ...

    def move(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group) -> int:
        """The whole layer in place in one pass, nothing staged (synchronous moves only,
        when `can_move`; every rank with a non-noop plan calls it). Returns bytes received.
        A failure inside leaves the layer partly written. Default: raises."""
        ...

    def close(self) -> None:
        """Release what the transport holds of its peers (the runtime's `close()`; not
        collective). Default: nothing."""
        ...


class TransportBase(abc.ABC):
    """The base of every transport: the optional members of `Transport` with their
    default behaviour; a subclass sets `name` and implements `exchange` and `settle`
    (abstract: a transport lacking one cannot be made)."""

    name: ClassVar[str]
    exchange_launches_no_kernels: ClassVar[bool] = False
    hold: list[torch.Tensor] | None = None

    @abc.abstractmethod
    def exchange(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group,
                 staging: list[torch.Tensor]) -> int:
        """See `Transport.exchange`."""

    @abc.abstractmethod
    def settle(self, plan: LayerTransferPlan, group) -> None:
        """See `Transport.settle`."""

    def write(self, plan: LayerTransferPlan, weights: list[torch.Tensor],
              staging: list[torch.Tensor]) -> None:
        write_layer(plan, weights, staging)

    def can_move(self, weights: Sequence[torch.Tensor]) -> bool:
        return False

    def move(self, plan: LayerTransferPlan, weights: list[torch.Tensor], group) -> int:
        raise NotImplementedError(f"{type(self).__name__} cannot move a layer in place "
                                  "(can_move is False): use exchange, settle and write")

    def close(self) -> None:
        pass


REQUIRED = ("name", "exchange", "settle")
"""The members of `Transport` a subclass of `TransportBase` must define itself."""
