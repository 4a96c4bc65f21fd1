"""The pure core: from a measured load to a placement, and from two placements to the
moves between them.

Everything here is a deterministic function of its arguments, on numpy arrays (torch
only as an array library: the ported DeepSeek policy, and a few CPU passes of the
`balanced` planner's decode-aware step): no process group, no thread, no GPU state.
`config` (the settings), `loadio` (reading and checking loads), `placement` (the
`Placement` type and its maps), `planning` (`plan()`), `policy` (the placement
policies), `transfer_plan` (which slot is written from where, which rank sends what;
`senders` chooses who sends), `resize_plan` (the same across a change of EP size),
`simulate`, `replay` and `workload` (replaying recorded loads offline: the placement in
force at every step; data only, the figures are drawn in `eplb.ops`), `trend` (a
drifting load's least-squares trend), `scale` and `cost_model` (what a placement is
worth in tokens/s). The distributed runtime (`eplb.runtime`) and the operations layer
(`eplb.ops`) build on it; it imports neither.
"""
