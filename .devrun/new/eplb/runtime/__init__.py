"""The distributed runtime: recording load, agreeing across ranks and moving weights.

`runtime` (`EplbRuntime`: the step loop that ties the rest together), `groups` (the
process groups it uses, built by the caller or from the EP group), `recorder` (per-step
load into a window), `control` (requests from outside and cross-rank agreement),
`targets` and `plan_broadcast` (what a rebalance moves to; rank 0 plans, every rank gets
the same placement), `placement_change` (the one layer mover: exchange, verify, agree,
switch; synchronous or in the background), `transport_base` (the `Transport` contract),
`transfer`, `transports` and `ipc` (one layer's exchange and write; point-to-point and
CUDA IPC), `verify` (slot checksums), `events` (what a rebalance did),
`planner_process` (planning off the serving process) and `resize` (changing the EP
size). Every collective takes an explicit group; nothing here imports `eplb.ops`.
"""
from eplb.runtime.events import NO_LOAD, EplbFatalError, RebalanceError, RebalanceEvent
from eplb.runtime.runtime import EplbRuntime

__all__ = ["NO_LOAD", "EplbFatalError", "EplbRuntime", "RebalanceError", "RebalanceEvent"]
