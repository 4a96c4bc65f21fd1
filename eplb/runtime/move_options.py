"""`MoveOptions`: how a placement change moves layers (verification, timeout, where an
asynchronous change launches its exchanges, nodes), and the one rule that resolves
`launch="auto"`. Read by `PlacementChange`; the runtime builds them from `EplbConfig`."""
from __future__ import annotations

from dataclasses import dataclass

from eplb.core.config import LAUNCH_MODES
from eplb.runtime.transport_base import Transport

__all__ = ["MoveOptions"]


@dataclass(frozen=True)
class MoveOptions:
    """How a change moves layers. `verify`: check every staged expert of a layer against
    its pre-transfer checksum before that layer is written. `timeout`: seconds without any
    layer switching after which this rank counts the change as failed (the agreement then
    aborts it everywhere). `launch`: where an asynchronous change launches each layer's exchange:
    "thread" (the background thread), "step" (the step loop, in `advance()`, at the same
    step on every rank: its NCCL kernels then enter every GPU in the same order relative to
    the model's collectives, which two threads cannot promise, see NVIDIA/nccl#1766) or
    "auto" ("step" on CUDA with more than one rank and a transport that launches NCCL
    kernels, i.e. not one with `exchange_launches_no_kernels`; else "thread").
    `num_nodes`: for the same-node sender preference of the transfer plan."""

    verify: bool = False
    timeout: float = 300.0
    launch: str = "auto"
    num_nodes: int = 1

    def __post_init__(self) -> None:
        if self.launch not in LAUNCH_MODES:
            raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {self.launch!r}")

    @classmethod
    def of_config(cls, config) -> "MoveOptions":
        """The options an `EplbConfig` sets (verify_transfers, transfer_timeout,
        exchange_launch, num_nodes)."""
        return cls(verify=config.verify_transfers, timeout=config.transfer_timeout,
                   launch=config.exchange_launch, num_nodes=config.num_nodes)

    def launches_in_step(self, cuda: bool, num_ranks: int, transport: Transport) -> bool:
        """Whether an asynchronous change launches each exchange from the step loop."""
        return self.launch == "step" or (self.launch == "auto" and cuda and num_ranks > 1
                                         and not transport.exchange_launches_no_kernels)
