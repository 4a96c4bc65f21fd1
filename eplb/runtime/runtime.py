"""EplbRuntime: the one place that wires model, recorder, policy and transfer together.

    runtime = EplbRuntime(model, EplbConfig(...), group=ep_group)
    for batch in data:
        out = model(batch)
        runtime.step()          # after every forward; rebalances on schedule
    runtime.rebalance()         # or now, on every rank (a collective)

Every rank of `group` must call `step()` and `rebalance()` in lockstep.

Its parts live in their own modules: groups, registration checks, the rank-0 planner and
plan broadcast, what a rebalance moves to (`targets`), the replica-share routing
(`share_routing`), the layer mover (`placement_change`), events, and what outlives a
runtime (`lifecycle`). What stays here is the step loop and the life of one placement
change (begin, advance, finish or fail), which share the runtime's state (placement,
maps, the change in flight).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.core.transfer_plan import transfer_stats
from eplb.protocol import ForwardCounter, MixtureOfExperts
from eplb.runtime import lifecycle
from eplb.runtime.control import RebalanceRequests, agree_requested
from eplb.runtime.events import EplbFatalError, RebalanceError, RebalanceEvent, layers_left
from eplb.runtime.groups import EplbGroups, NoSpareGroups
from eplb.runtime.move_options import MoveOptions
from eplb.runtime.placement_change import PlacementChange
from eplb.runtime.plan_broadcast import Rank0Planner
from eplb.runtime.recorder import LoadRecorder
from eplb.runtime.registration import (check_model, check_registration, check_slots,
                                       expert_weights_problem, model_device)
from eplb.runtime.share_routing import ShareRouting
from eplb.runtime.targets import RebalanceTargets
from eplb.runtime.transport_choice import make_transport

log = logging.getLogger("eplb.runtime")

__all__ = ["EplbRuntime"]


class EplbRuntime:
    MAX_EVENTS = 1000  # `events` keeps the newest this many RebalanceEvents

    def __init__(self, model: MixtureOfExperts, config: EplbConfig | None = None,
                 group: dist.ProcessGroup | None = None, *, groups: EplbGroups | None = None,
                 transport=None):
        """`group`: the EP group (None: the world). `groups`: the process groups to use
        (`EplbGroups`; default: `EplbGroups.create(group, config.transfer_timeout)`, a
        collective over the group); their `ep` must be `group` when both are given.
        `transport`: a transport object to move weights with (as `make_transport` returns,
        or one wrapping it, e.g. to inject faults in tests); default: made from
        `config.transport` (collective)."""
        check_model(model)  # a MixtureOfExperts with MoE layers
        if groups is not None:
            if group is not None and groups.ep is not group:
                raise ValueError("groups.ep is not the group passed as `group`")
            group = groups.ep
        self.model = model
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        L, N = model.num_moe_layers, model.num_logical_experts
        P, S = model.num_physical_experts, model.num_local_physical_experts
        config = config or EplbConfig()  # num_redundant_experts unset: the model's P - N
        self.config = config.verify(N, self.world_size, num_physical_experts=P)
        check_slots(model, self.world_size)

        self.placement = Placement.initial(L, N, P, self.world_size, self.config.num_nodes)
        self.device = model_device(model)
        self.max_replicas = self.placement.max_replicas
        # runtime-owned tensors, shared with the model; only ever updated in place
        self.expert_load_pass = torch.zeros(L, P, dtype=torch.int64, device=self.device)  # [L, P]
        self.physical_to_logical = torch.zeros(L, P, dtype=torch.int64, device=self.device)  # [L, P]
        self.logical_to_physical_map = torch.zeros(L, N, self.max_replicas, dtype=torch.int64,
                                                   device=self.device)  # [L, N, R]
        self.logical_replica_count = torch.zeros(L, N, dtype=torch.int64, device=self.device)  # [L, N]
        # weighted replicas: cumulative replica shares in logical_to_physical order, rows end at 1.0
        self.logical_replica_cdf = torch.ones(L, N, self.max_replicas, dtype=torch.float32,
                                              device=self.device)  # [L, N, R]
        for dst, src in zip(self._maps, self.placement.maps(self.max_replicas)):
            dst.copy_(torch.from_numpy(src))  # later switched layer by layer (PlacementChange)
        model.set_eplb_state(self.expert_load_pass, self.logical_to_physical_map,
                             self.logical_replica_count)
        # optional protocol extension (eplb.protocol.SupportsReplicaWeights); without it the
        # model splits every expert's tokens evenly over its replicas
        self.routing = ShareRouting(model, self.logical_replica_cdf, self.rank)
        self.routing.update(self.placement, self.config.weighted_replicas)
        # optional extension (eplb.protocol.ForwardCounter): the model counts its forwards,
        # so a job that never steps is warned and ranks' forward counts can be compared
        self.forward_counter = ForwardCounter()
        if callable(getattr(model, "set_eplb_forward_counter", None)):
            model.set_eplb_forward_counter(self.forward_counter)
        self.expert_weights = [list(w) for w in model.expert_weights]  # L lists of [S, ...] tensors
        problem = expert_weights_problem(model, self.expert_weights, S)  # this rank's; all ranks agree below

        self.recorder = LoadRecorder(L, N, self.world_size, S, self.config.window_size, self.device)
        self.steps = 0
        self.events: list[RebalanceEvent] = []
        self._listeners: list[Callable[[RebalanceEvent], None]] = []
        self._failure_listeners: list[Callable[[str, BaseException], None]] = []
        self._step_hooks: list[Callable[["EplbRuntime"], None]] = []
        self.requests = RebalanceRequests()  # filled from any thread, served in step()
        # the groups, with the config's timeout, so a dead or frozen peer is detected (see
        # eplb.runtime.groups): gloo for the per-step agreements and the rebalance
        # thread's CPU collectives, the EP group's backend for weight transfers
        self._owns_groups = groups is None
        self.groups = groups if groups is not None else EplbGroups.create(
            group, self.config.transfer_timeout, device=self.device)
        try:
            check_registration(problem, self.expert_weights, self.placement, self.rank,
                               self.world_size, self.device, self.groups.plan)  # collective
        except ValueError:
            self._retire_groups()
            raise
        self.bytes_per_expert = sum(w.numel() // S * w.element_size() for w in self.expert_weights[0])
        # the first window sum launches its kernels for the first time (on a GPU, lazy
        # module loading): do it now rather than inside the step that starts a rebalance
        self.recorder.warm_up(self.group, decay=self.config.load_decay)
        # collective (IPC: every rank maps its peers' expert tensors once)
        self.transport = transport if transport is not None else make_transport(
            self.config.transport if self.world_size > 1 else "nccl", self.expert_weights,
            self.groups.transfer, timeout=self.config.transfer_timeout, cpu_group=self.groups.tokens)
        # the rebalance thread's side stream, made here: the first stream a process makes
        # sets up torch's stream pool, which would otherwise hold the GIL inside the step
        # that starts the first rebalance
        self._side_stream = (torch.cuda.Stream(self.device)
                             if self.device.type == "cuda" and self.config.async_rebalance else None)
        # rank 0 plans (in a child process in asynchronous mode), every rank gets the plan
        self.planner = Rank0Planner(self.config, self.world_size, model.num_expert_groups, self.rank,
                                    use_process=self.config.async_rebalance and self.config.planner_process)
        if self.config.async_rebalance:
            self.planner.warm_up(self.placement)
        self.targets = RebalanceTargets(self.recorder, self.planner, self.group, self.device,
                                        self.routing)
        self._move_options = MoveOptions.of_config(self.config)
        self._change: PlacementChange | None = None  # the rebalance in flight (async mode)
        self._change_info: dict = {}
        self._stale: list[PlacementChange] = []  # aborted changes whose thread may still run
        self.fatal_error: EplbFatalError | None = None
        self.closed = False
        lifecycle.track(self)  # closed at exit if still alive (a weak reference)
        if self.config.initial_placement:
            target = Placement.load(self.config.initial_placement, N, self.world_size)
            self.apply_placement(target, trigger="initial")

    # ---- listeners and the step loop ---------------------------------------------
    def add_listener(self, fn: Callable[[RebalanceEvent], None]) -> None:
        """Call `fn(event)` after every rebalance (the hook metrics attach to)."""
        self._listeners.append(fn)

    def add_failure_listener(self, fn: Callable[[str, BaseException], None]) -> None:
        """Call `fn(trigger, error)` after every rebalance that failed (synchronous or not)."""
        self._failure_listeners.append(fn)

    def add_step_hook(self, fn: Callable[["EplbRuntime"], None]) -> None:
        """Call `fn(runtime)` in every `step()` after the step's load is recorded, before its
        rebalance work (not when `step()` raises before that: closed, or a fatal error)."""
        self._step_hooks.append(fn)

    def request_rebalance(self, trigger: str = "api") -> int:
        """Ask for a rebalance at the next control check (every `control_interval` steps,
        none with 0, none while a change is in flight); thread-safe, returns a status id."""
        return self.requests.request(trigger)

    def rebalance_status(self, request_id: int) -> dict | None:
        """State of a requested rebalance: pending, running, done (with a summary) or failed."""
        return self.requests.status(request_id)

    @property
    def rebalance_in_flight(self) -> bool:
        """True while an asynchronous rebalance is planning or moving weights."""
        return self._change is not None

    def step(self) -> RebalanceEvent | None:
        """Call after every forward: records this step's load; rebalances on schedule or
        when a rank holds a request (all ranks agree at the same step). In asynchronous
        mode it also advances the rebalance in flight (at most one layer switches per
        step) and returns its event on the step it completes.

        Raises EplbFatalError when a peer died or stopped answering, or a write failed;
        a synchronous rebalance that failed raises RebalanceError, an asynchronous one is
        logged and reported to failure listeners and serving continues."""
        if self.fatal_error is not None:
            raise self.fatal_error
        if self.closed:
            raise RuntimeError("this EplbRuntime was closed (close())")
        self.recorder.record(self.expert_load_pass, self.physical_to_logical)
        self.forward_counter.step()
        self.steps += 1
        if self.steps == self.config.zero_load_warn_steps:  # once (0 = never)
            self.recorder.warn_if_no_load(self.groups.control, self.rank, self.steps)
        for hook in self._step_hooks:
            hook(self)
        if self._change is not None:
            return self._advance()
        interval, control = self.config.rebalance_interval, self.config.control_interval
        if control and self.steps % control == 0 and agree_requested(
                self.requests, self.forward_counter.forwards, self.groups.control,
                self.world_size, self.steps):
            return self._start("request", self.requests.start(self.steps))
        if interval and self.steps % interval == 0:
            return self._start("interval")
        if control and self.steps % control == 0 and self.targets.shift_now(self.config):
            return self._start("shift")
        return None

    def rebalance(self, trigger: str = "api") -> RebalanceEvent | None:
        """Plan on the recorded window and move weights (collective over the group), after
        `finish_rebalance()` (which raises a failing rebalance in flight's RebalanceError).
        Synchronous mode: returns the event once every layer switched. Asynchronous mode:
        returns None; `step()` completes it and the event reaches listeners and `events`."""
        self.finish_rebalance()
        return self._start(trigger)

    def finish_rebalance(self) -> RebalanceEvent | None:
        """Drive the rebalance in flight (if any) to its end now, on every rank (collective).
        Raises its RebalanceError if it fails (`step()` only logs a non-fatal one)."""
        event = None
        while self._change is not None:
            event = self._advance(raise_failure=True)
            if self._change is not None:
                time.sleep(0.001)
        return event

    def _start(self, trigger: str, request_ids: list[int] | None = None) -> RebalanceEvent | None:
        """Begin a rebalance planned on the recorded window (`RebalanceTargets.planned`:
        rank 0 plans, then broadcasts; skipped when it gains less than `min_gain`)."""
        plan_fn, info = self.targets.planned(trigger, request_ids or [], self.placement,
                                             self.groups.plan, self.config)
        return self._begin(plan_fn, info, self.config.async_rebalance)

    def apply_placement(self, new: Placement, trigger: str = "api", *, wait: bool = True,
                        before: np.ndarray | None = None, load: np.ndarray | None = None,
                        seconds_plan: float = 0.0) -> RebalanceEvent | None:
        """Move weights to `new` (same on every rank) and switch the maps layer by layer,
        after `finish_rebalance()` (which raises a failing rebalance in flight's error).
        `wait=True`: now, returning the event; raises RebalanceError if it stops part-way
        (layers then wholly old or new, bar one an EplbFatalError names partly written).
        `wait=False`: in the background, like an asynchronous rebalance (returns None)."""
        old = self.placement
        if (new.num_layers, new.num_slots, new.num_logical_experts, new.num_gpus) != (
                old.num_layers, old.num_slots, old.num_logical_experts, old.num_gpus):
            raise ValueError(f"placement {new} does not fit the running model {old}")
        self.finish_rebalance()
        plan_fn, info = self.targets.given(old, new, trigger, self.config, before=before,
                                           load=load, seconds_plan=seconds_plan)
        # before any layer switches to new's maps
        self.routing.update(self.placement, self.config.weighted_replicas, coming=new)
        return self._begin(plan_fn, info, asynchronous=not wait)

    def close(self, timeout: float | None = None) -> None:
        """Stop background work before the process exits: abandon a rebalance in flight
        (layers that switched stay switched), wait up to `timeout` s (default
        `transfer_timeout`) for transfer threads (after an aborted rebalance one may sit in
        a transfer until its group's timeout), then release the runtime's own groups
        (destroyed at exit, so later groups never reuse their names); while a thread is
        still alive they are kept instead, with a warning. Not a collective; idempotent;
        also run at exit for runtimes still alive. `step()` refuses to run afterwards."""
        if self._change is not None:
            self._change.abandon()
            self._stale.append(self._change)
            self._change = None
        deadline = time.monotonic() + (self.config.transfer_timeout if timeout is None else timeout)
        for change in self._stale:
            change.join(max(0.0, deadline - time.monotonic()))
        self._stale = [c for c in self._stale if c.thread_alive]
        self.planner.close()
        self.transport.close()  # IPC: drop the mappings of the peers' tensors
        if self._stale:
            log.warning("eplb: %d rebalance thread(s) still waiting in a transfer at close",
                        len(self._stale))
        elif not self.closed and dist.is_initialized():
            # destroyed at exit (before interpreter teardown), not now: see _retire_groups
            self._retire_groups()
        self.closed = True

    # ---- one placement change: begin, advance, end ------------------------------
    def _begin(self, plan_fn: Callable[[], Placement], info: dict,
               asynchronous: bool) -> RebalanceEvent | None:
        """Start moving to `plan_fn()`'s placement. `info` (trigger, request ids, start
        time) is the very dict `plan_fn` fills (load, before, predicted_gain, skipped,
        seconds_plan): `_finished` reports from it."""
        # an aborted change's thread may still wait in a transfer until its group's timeout
        # and is left to end; it writes only its staging, but over IPC that is the shared hold
        # buffer and its tokens use groups.tokens, not renewed (known limit: reliability.md)
        self._stale = [c for c in self._stale if c.thread_alive]
        change = PlacementChange(
            self.placement, plan_fn, self.expert_weights, self._maps, groups=self.groups,
            transport=self.transport, device=self.device, options=self._move_options,
            # not beside a stale thread's stream work, which may wait on a hung transfer
            stream=None if self._stale else self._side_stream)
        info["asynchronous"] = asynchronous
        self._change, self._change_info = change, info
        if asynchronous:
            change.start()
            change.stats.charge_step_loop(time.perf_counter() - info["t_start"])
            return None
        try:
            change.run()
        except RebalanceError as e:
            raise self._failed(e) from e
        return self._finished()

    def _advance(self, raise_failure: bool = False) -> RebalanceEvent | None:
        """One step boundary of the asynchronous rebalance in flight."""
        try:
            done = self._change.advance()
        except RebalanceError as e:
            error = self._failed(e)
            if raise_failure or isinstance(error, EplbFatalError):
                raise error from e
            return None
        return self._finished() if done else None

    def _retire_groups(self) -> None:
        """Drop the groups this runtime made (none when the caller passed them): they are
        destroyed at exit, not now (see eplb.runtime.lifecycle)."""
        if self._owns_groups and dist.is_initialized():
            lifecycle.retire(self.groups)
        self.groups = EplbGroups(self.group, None, None, None, None, self.config.transfer_timeout)

    @property
    def _maps(self) -> tuple[torch.Tensor, ...]:
        """The shared map tensors, rewritten in place layer by layer."""
        return (self.physical_to_logical, self.logical_to_physical_map,
                self.logical_replica_count, self.logical_replica_cdf)

    def _failed(self, error: RebalanceError) -> RebalanceError:
        """Record a stopped change: keep the layers that switched, report the failure, and
        return the error for the caller (EplbFatalError when the group is unusable)."""
        change, info = self._change, self._change_info
        self._change = None
        old = self.placement
        done = change.switched_layers
        if done:
            self.placement = old.with_layers_of(change.new, done)
            self.recorder.on_placement_change()
        fatal = isinstance(error, EplbFatalError)
        stage = ("while planning" if change.layers is None else
                 f"after {len(done)} of {len(change.layers)} changed layers")
        where = f"rebalance ({info['trigger']}) failed {stage} ({error}); {layers_left(error)}"
        if fatal:
            out = self.fatal_error = EplbFatalError(
                where + "; the process group is unusable: stop this job",
                partly_written=error.partly_written)
        else:
            out = RebalanceError(where + "; serving can continue")
            if change.thread_alive:
                self._stale.append(change)
            if self.world_size > 1:  # ops of the aborted change may still be pending: fresh groups
                try:
                    self.groups = self.groups.renew(self.device)
                except NoSpareGroups as e:  # the same verdict on every member
                    out = self.fatal_error = EplbFatalError(f"{where}; {e}")
        log.error("%s (step %d)", out, self.steps)
        self.requests.finish(info["request_ids"], error=f"{type(out).__name__}: {out}")
        for fn in self._failure_listeners:
            fn(info["trigger"], out)
        return out

    def _finished(self) -> RebalanceEvent:
        """The change in flight completed on every rank: adopt it, report it."""
        change, info = self._change, self._change_info
        self._change = None
        old, new = self.placement, change.new
        skipped = bool(info.get("skipped", False))
        if not skipped:
            self.placement = new
            self.routing.adopted(new, self.config.weighted_replicas)
            self.recorder.on_placement_change()
        load = info["load"]  # [L, N] the window the plan was made on
        before = info.get("before")  # [L] measured, or None (apply_placement given a load)
        event = RebalanceEvent.of_change(
            change.stats, transfer_stats(old.physical_to_logical, new.physical_to_logical, self.world_size),
            step=self.steps, trigger=info["trigger"],
            before=before if before is not None else self.routing.realised(old).balancedness(load),
            after=self.routing.realised(new).balancedness(load), placement=new,
            bytes_per_expert=self.bytes_per_expert, seconds_plan=info.get("seconds_plan") or 0.0,
            asynchronous=info["asynchronous"], predicted_gain=float(info.get("predicted_gain", 0.0)),
            skipped=skipped, min_gain=self.config.min_gain, skip_reason=info.get("skip_reason", ""),
            move_tolerance=info.get("move_tolerance"), steady_layers=int(info.get("steady_layers", 0)),
            trend_layers=int(info.get("trend_layers", 0)))
        self.events.append(event)
        del self.events[:-self.MAX_EVENTS]  # the newest MAX_EVENTS: bounded memory in long jobs
        if self.rank == 0:
            log.info("%s", event.describe())
        self.requests.finish(info["request_ids"], result=event.summary())
        for fn in self._listeners:
            fn(event)
        return event
