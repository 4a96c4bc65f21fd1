"""EplbRuntime: the one place that wires model, recorder, policy and transfer together.

    runtime = EplbRuntime(model, EplbConfig(...), group=ep_group)
    for batch in data:
        out = model(batch)
        runtime.step()          # after every forward; rebalances on schedule
    runtime.rebalance()         # or now, on every rank (a collective)

Every rank of `group` must call `step()` and `rebalance()` in lockstep.

Its parts live in their own modules (groups, registration checks, the rank-0 planner
and plan broadcast, the layer mover, events); what stays here, about 500 lines, is the
step loop and the life of one placement change (begin, advance, finish or fail), kept in
one class because they share the runtime's state (placement, maps, change in flight).
"""
from __future__ import annotations

import atexit
import logging
import time
import weakref
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.core.planning import ShiftState, plan_tolerance, predicted_gain, worth_moving
from eplb.core.transfer_plan import transfer_stats
from eplb.protocol import (ForwardCounter, MixtureOfExperts, is_unwrapped_hf_model,
                           missing_members, supports_replica_weights)
from eplb.runtime.control import RebalanceRequests, agree, agree_max
from eplb.runtime.events import NO_LOAD, RebalanceEvent
from eplb.runtime.groups import EplbGroups, NoSpareGroups
from eplb.runtime.placement_change import EplbFatalError, MoveOptions, PlacementChange, RebalanceError
from eplb.runtime.plan_broadcast import Rank0Planner
from eplb.runtime.recorder import LoadRecorder
from eplb.runtime.registration import check_registration, expert_weights_problem
from eplb.runtime.transport_choice import make_transport

log = logging.getLogger("eplb.runtime")

__all__ = ["NO_LOAD", "EplbRuntime", "RebalanceEvent", "RebalanceError", "EplbFatalError"]

_LIVE_RUNTIMES: "weakref.WeakSet[EplbRuntime]" = weakref.WeakSet()


# Groups of closed runtimes, destroyed at exit rather than in close(): torch names a group
# made with use_local_synchronization by hashing its ranks, skipping the names of live
# groups, so destroying one frees its name and the next runtime's group would reuse it,
# with the old group's addresses still in the store under that name (its ranks then
# connect to closed ports and the creation times out).
_RETIRED_GROUPS: list[dist.ProcessGroup] = []


@atexit.register
def _close_live_runtimes() -> None:
    """At exit, stop the background work of runtimes still alive (see `close`), then
    destroy the groups of closed runtimes (unless the default group is gone already)."""
    for runtime in list(_LIVE_RUNTIMES):
        try:
            runtime.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.exception("eplb: closing a runtime at exit failed")
    while _RETIRED_GROUPS:
        group = _RETIRED_GROUPS.pop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - destroyed with the default group, or exiting
                pass


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
        missing = missing_members(model)
        if missing and is_unwrapped_hf_model(model):
            raise TypeError(f"{type(model).__name__} is a transformers model: pass what "
                            "`moe.hf.expert_parallel(model, R)` returns (the expert-parallel "
                            "wrapper, which implements MixtureOfExperts), not the model itself")
        if missing:
            raise TypeError(f"{type(model).__name__} does not implement MixtureOfExperts: "
                            f"missing {', '.join(missing)}")
        if model.num_moe_layers < 1:
            raise ValueError("model has no MoE layers (num_moe_layers must be >= 1)")
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
        if S * self.world_size != P:
            raise ValueError(f"model has num_local_physical_experts={S} on each of {self.world_size} "
                             f"ranks, but num_physical_experts={P} (expected {P // self.world_size})")

        self.placement = Placement.initial(L, N, P, self.world_size, self.config.num_nodes)
        self.device = self._find_device(model)
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
        self._write_maps(self.placement)
        model.set_eplb_state(self.expert_load_pass, self.logical_to_physical_map,
                             self.logical_replica_count)
        # optional protocol extension (eplb.protocol.SupportsReplicaWeights); without it the
        # model splits every expert's tokens evenly over its replicas
        self.replica_weights_supported = supports_replica_weights(model)
        self._warned_even_split = False
        self._cdf_registered = False  # whether the model routes by logical_replica_cdf now
        self._route_by_shares()
        # optional extension (eplb.protocol.ForwardCounter): the model counts its forwards,
        # so a job that never steps is warned and ranks' forward counts can be compared
        self.forward_counter = ForwardCounter()
        if callable(getattr(model, "set_eplb_forward_counter", None)):
            model.set_eplb_forward_counter(self.forward_counter)
        self.expert_weights = [list(w) for w in model.expert_weights]  # L lists of [S, ...] tensors
        problem = expert_weights_problem(model, self.expert_weights, S)  # this rank's; all ranks agree below

        self.recorder = LoadRecorder(L, N, self.world_size, S, self.config.window_size, self.device)
        self.steps = 0
        self._shift = ShiftState()  # shift detection (EplbConfig.shift_threshold), same as the simulator's
        self._early_used = False  # an early (shift) rebalance ran in this rebalance interval
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
        self._side_stream = None
        if self.device.type == "cuda" and self.config.async_rebalance:
            self._side_stream = torch.cuda.Stream(self.device)
        # rank 0 plans (in a child process in asynchronous mode), every rank gets the plan
        self.planner = Rank0Planner(self.config, self.world_size, model.num_expert_groups, self.rank,
                                    use_process=self.config.async_rebalance and self.config.planner_process)
        if self.config.async_rebalance:
            self.planner.warm_up(self.placement)
        self._move_options = MoveOptions(
            verify=self.config.verify_transfers, timeout=self.config.transfer_timeout,
            launch=self.config.exchange_launch, num_nodes=self.config.num_nodes)
        self._change: PlacementChange | None = None  # the rebalance in flight (async mode)
        self._change_info: dict = {}
        self._stale: list[PlacementChange] = []  # aborted changes whose thread may still run
        self.fatal_error: EplbFatalError | None = None
        self.closed = False
        _LIVE_RUNTIMES.add(self)  # closed at exit if still alive (a weak reference)
        if self.config.initial_placement:
            target = Placement.load(self.config.initial_placement, N, self.world_size)
            self.apply_placement(target, trigger="initial")

    # ---- set-up helpers ----------------------------------------------------------
    @staticmethod
    def _find_device(model) -> torch.device:
        for w in getattr(model, "expert_weights", None) or []:
            for t in w:
                return t.device
        if isinstance(model, torch.nn.Module):
            for p in model.parameters():
                return p.device
        return torch.device("cpu")

    def add_listener(self, fn: Callable[[RebalanceEvent], None]) -> None:
        """Call `fn(event)` after every rebalance (the hook metrics attach to)."""
        self._listeners.append(fn)

    def add_failure_listener(self, fn: Callable[[str, BaseException], None]) -> None:
        """Call `fn(trigger, error)` after every rebalance that failed (synchronous or not)."""
        self._failure_listeners.append(fn)

    # ---- the step loop -----------------------------------------------------------
    def add_step_hook(self, fn: Callable[["EplbRuntime"], None]) -> None:
        """Call `fn(runtime)` at the end of every `step()` (before any rebalance)."""
        self._step_hooks.append(fn)

    def request_rebalance(self, trigger: str = "api") -> int:
        """Ask for a rebalance at the next control check (thread-safe, does not block);
        returns an id for `rebalance_status()`."""
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

        Raises EplbFatalError when a peer died or stopped answering during a rebalance;
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
            self._warn_if_no_load()
        for hook in self._step_hooks:
            hook(self)
        if self._change is not None:
            return self._advance()
        interval, control = self.config.rebalance_interval, self.config.control_interval
        if control and self.steps % control == 0 and self._agree_requested():
            return self._start("request", self.requests.start(self.steps))
        if interval and self.steps % interval == 0:
            return self._start("interval")
        if control and self.steps % control == 0 and self._shift_now():
            return self._start("shift")
        return None

    def _shift_now(self) -> bool:
        """Shift-aware early rebalance (`EplbConfig.shift_threshold`): whether the load
        recorded since the last plan shows a shift (`ShiftState.shifted`, the
        same decision as the simulator's), at most once between two other rebalances. Collective
        when it checks: one all-reduce of the window and one host read, every
        `control_interval` steps while a plan's prediction is known."""
        thr = self.config.shift_threshold
        steps = self.recorder.steps_since_plan
        if not thr or self._early_used or self._shift.predicted is None or steps < 1:
            return False  # the same on every rank: config, step counts and the state agree
        _, gpu = self.recorder.window_load(self.group, since_plan=True)  # [L, M] all-reduced
        measured = float(np.mean(balancedness_of_gpu_loads(gpu.cpu().numpy())))
        return self._shift.shifted(measured, steps, thr)

    def _warn_if_no_load(self) -> None:
        """Warn once (rank 0) when no rank recorded any load so far: the model is not
        counting into `expert_load_view`. One host read and, with several ranks, one
        agreement on the control group, at this one step."""
        seen = self.recorder.any_load()
        if self.world_size > 1:
            seen = agree(seen, self.groups.control)
        if not seen and self.rank == 0:
            log.warning("eplb: the model recorded no load in %d steps: expert_load_view is "
                        "still all zero; the model must add the tokens each slot receives into "
                        "the load view it was given (see docs/bring-your-own-model.md); "
                        "rebalancing is held off until it does", self.steps)

    def _agree_requested(self) -> bool:
        """Whether any rank of the group holds a request (a one-rank group asks no one).
        The same all-reduce compares the ranks' forward counts (`ForwardCounter`): raises
        RuntimeError on every rank when they differ."""
        pending = self.requests.has_pending()
        if self.world_size == 1:
            return pending
        forwards = self.forward_counter.forwards
        pending, high, low = agree_max([int(pending), forwards, -forwards], self.groups.control)
        if high != -low:
            raise RuntimeError(
                f"EP ranks ran different numbers of forwards by step {self.steps}: this rank "
                f"{forwards}, the ranks between {-low} and {high}; every rank of the EP group "
                "must run the same number of forwards (the same number of generate() steps, "
                "the same batches) and call runtime.step() after each")
        return bool(pending)

    def rebalance(self, trigger: str = "api") -> RebalanceEvent | None:
        """Plan on the recorded window and move weights (collective over the group).
        Synchronous mode: returns the event once every layer switched. Asynchronous mode:
        finishes any rebalance in flight, starts this one and returns None; `step()`
        completes it and the event reaches listeners and `events`."""
        self.finish_rebalance()
        return self._start(trigger)

    def finish_rebalance(self) -> RebalanceEvent | None:
        """Drive the rebalance in flight (if any) to its end now, on every rank (collective)."""
        event = None
        while self._change is not None:
            event = self._advance(raise_failure=True)
            if self._change is not None:
                time.sleep(0.001)
        return event

    def _start(self, trigger: str, request_ids: list[int] | None = None) -> RebalanceEvent | None:
        """Begin a rebalance planned on the recorded window (rank 0 plans, then broadcasts).
        A plan that gains less than `config.min_gain` moves nothing (a skipped rebalance);
        an all-zero window is not planned on at all (skipped, reason NO_LOAD)."""
        info = {"request_ids": request_ids or [], "t_start": time.perf_counter(), "trigger": trigger,
                "steps": self.recorder.steps_since_plan}
        early = trigger == "shift"  # plans on the load since the last plan, with tolerance 0
        self._early_used = early  # the bounded rate: one early rebalance between two other plans
        read_window = self._window_reader(info, since_plan=early)  # collective: the all-reduce
        self.recorder.on_plan()  # shift detection measures from this plan on

        def plan_fn() -> Placement:
            t0 = time.perf_counter()
            read_window()
            if not info["load"].any():  # all-reduced: the same verdict on every rank
                info.update(skipped=True, skip_reason=NO_LOAD, predicted_gain=0.0,
                            seconds_plan=time.perf_counter() - t0)
                return self.placement
            steps = info["steps"]
            measured = float(np.mean(info["measured"]))
            shifted = early or self._shift.shifted(measured, steps, self.config.shift_threshold)
            if not early:
                self._shift = self._shift.checked(measured, steps, shifted)
            info["shifted"] = shifted
            tol = plan_tolerance(shifted, self.config.move_tolerance)
            planned = self.planner.plan(info["load"], self.placement, self.groups.plan, move_tolerance=tol)
            # the same decision on every rank: same broadcast plan, same all-reduced load
            move, info["predicted_gain"] = worth_moving(
                self._realised(self.placement), self._realised(planned), info["load"],
                self.config.min_gain)
            info["skipped"] = not move
            info["seconds_plan"] = time.perf_counter() - t0
            chosen = planned if move else self.placement
            self._shift = self._shift.planned(np.mean(self._realised(chosen).balancedness(info["load"])))
            return chosen

        return self._begin(plan_fn, info, self.config.async_rebalance)

    def _window_reader(self, info: dict, since_plan: bool = False) -> Callable[[], None]:
        """All-reduce the recorded window now (a collective, on the step loop) and return
        the function that fills `info` from it on the host: "load" [L, N] (what the planner
        sees) and "before" [L] (balancedness measured from the per-GPU window). In
        asynchronous mode that function runs in the rebalance thread, after the
        all-reduce's kernels, so the step loop never waits for the copy."""
        logical, gpu = self.recorder.window_load(self.group, decay=self.config.load_decay,
                                                 since_plan=since_plan)  # [L, N], [L, M]
        # what shift detection measures: the steps since the last plan (one more small all-reduce)
        recent = gpu  # [L, M]
        if not since_plan and self.config.shift_threshold:
            recent = self.recorder.window_load(self.group, since_plan=True)[1]
        window_done = None
        if self.device.type == "cuda":  # read() may run on another thread and stream
            window_done = torch.cuda.Event()
            window_done.record(torch.cuda.current_stream(self.device))

        def read() -> None:
            if window_done is not None:
                torch.cuda.current_stream(self.device).wait_event(window_done)
            info["load"] = logical.cpu().numpy().astype(np.float64)  # [L, N]
            info["before"] = balancedness_of_gpu_loads(gpu.cpu().numpy())  # [L]
            info["measured"] = balancedness_of_gpu_loads(recent.cpu().numpy())  # [L]

        return read

    def apply_placement(self, new: Placement, trigger: str = "api", *, wait: bool = True,
                        before: np.ndarray | None = None, load: np.ndarray | None = None,
                        seconds_plan: float = 0.0) -> RebalanceEvent | None:
        """Move weights to `new` (same on every rank) and switch the maps layer by layer,
        after finishing any rebalance in flight. `wait=True`: now, returning the event;
        raises RebalanceError if it stops part-way (every layer is then on its old or its
        new placement on every rank). `wait=False`: in the background like an asynchronous
        rebalance (returns None; `step()` completes it)."""
        old = self.placement
        if (new.num_layers, new.num_slots, new.num_logical_experts, new.num_gpus) != (
                old.num_layers, old.num_slots, old.num_logical_experts, old.num_gpus):
            raise ValueError(f"placement {new} does not fit the running model {old}")
        self.finish_rebalance()
        info = {"request_ids": [], "t_start": time.perf_counter(), "trigger": trigger,
                "seconds_plan": seconds_plan}
        if load is None:  # report on the recorded window, like a planned rebalance
            read_window = self._window_reader(info)  # collective
        else:
            info["load"] = np.asarray(load, dtype=np.float64)  # [L, N]
            info["before"] = before  # [L] or None: predicted on `load` (see _finished)
            read_window = lambda: None  # noqa: E731

        def plan_fn() -> Placement:
            read_window()
            info["predicted_gain"] = predicted_gain(self._realised(old), self._realised(new),
                                                    info["load"])
            return new

        self._route_by_shares(coming=new)  # before any layer switches to new's maps
        return self._begin(plan_fn, info, asynchronous=not wait)

    def close(self, timeout: float | None = None) -> None:
        """Stop background work before the process exits: abandon a rebalance in flight
        (layers that switched stay switched) and wait up to `timeout` seconds (default
        `transfer_timeout`) for transfer threads, which may sit in a transfer until their
        group's timeout after an aborted rebalance; then release the runtime's own process
        groups (destroyed at exit, so a later runtime's groups never reuse their names).
        Not a collective. Idempotent; also run at exit for runtimes still alive.
        `step()` refuses to run afterwards."""
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
            # drop the runtime's own groups; they are destroyed at exit (before interpreter
            # teardown), not now: see _RETIRED_GROUPS
            self._retire_groups()
        self.closed = True

    # ---- one placement change: begin, advance, end ------------------------------
    def _begin(self, plan_fn: Callable[[], Placement], info: dict,
               asynchronous: bool) -> RebalanceEvent | None:
        """Start moving to `plan_fn()`'s placement. `info` (trigger, request ids, start
        time) is the very dict `plan_fn` fills (load, before, predicted_gain, skipped,
        seconds_plan): `_finished` reports from it."""
        # an aborted change's thread may still wait in its old group until that group's
        # timeout; it only reads weights and writes its own staging, so it is left to end
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
            change.charge_step_loop(time.perf_counter() - info["t_start"])
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
        destroyed at exit, not now (see _RETIRED_GROUPS)."""
        if self._owns_groups and dist.is_initialized():
            g = self.groups
            _RETIRED_GROUPS.extend(x for x in (g.transfer, g.plan, g.control, g.tokens, *sum(g.spares, ()))
                                   if x is not None)
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
            mixed = old.physical_to_logical.copy()  # [L, P]
            mixed[done] = change.new.physical_to_logical[done]
            shares = None
            if old.shares is not None or change.new.shares is not None:
                shares = old.slot_shares().copy()  # [L, P]
                shares[done] = change.new.slot_shares()[done]
            self.placement = old.with_physical_to_logical(mixed, old.policy, shares)
            self.recorder.on_placement_change()
        fatal = isinstance(error, EplbFatalError)
        stage = ("while planning" if change.layers is None else
                 f"after {len(done)} of {len(change.layers)} changed layers")
        where = (f"rebalance ({info['trigger']}) failed {stage} ({error}); every layer is on "
                 f"its old or its new placement with maps matching weights")
        if fatal:
            out = self.fatal_error = EplbFatalError(where + "; the process group is unusable: "
                                                    "stop this job")
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
            if not self.replica_weights_supported and _has_uneven_shares(new):
                self._warn_even_split(type(self.model).__name__)
            self._route_by_shares()
            self.recorder.on_placement_change()
        stats = transfer_stats(old.physical_to_logical, new.physical_to_logical, self.world_size)
        load = info["load"]  # [L, N] the window the plan was made on
        before = info.get("before")  # [L] measured, or None (apply_placement given a load)
        event = RebalanceEvent(
            step=self.steps, trigger=info["trigger"],
            balancedness_before=before if before is not None else self._realised(old).balancedness(load),
            balancedness_after=self._realised(new).balancedness(load),
            experts_moved=stats.experts_moved, local_copies=stats.local_copies,
            slots_changed=stats.slots_changed, bytes_moved=stats.experts_moved * self.bytes_per_expert,
            seconds_plan=info.get("seconds_plan") or 0.0,
            seconds_transfer=max(0.0, change.t_end - change.t_start - change.seconds_plan),
            seconds_commit=change.seconds_switch, placement=new,
            # step boundaries only an asynchronous change spans (run() drives it on one)
            steps_in_flight=change.steps if info["asynchronous"] else 0,
            seconds_step_loop=change.seconds_step_loop,
            max_step_loop_seconds=change.max_step_loop,
            seconds_agree_wait=change.seconds_agree_wait,
            predicted_gain=float(info.get("predicted_gain", 0.0)), skipped=skipped,
            min_gain=self.config.min_gain, skip_reason=info.get("skip_reason", ""),
        )
        self.events.append(event)
        del self.events[:-self.MAX_EVENTS]  # the newest MAX_EVENTS: bounded memory in long jobs
        if self.rank == 0:
            log.info("%s", event.describe())
        self.requests.finish(info["request_ids"], result=event.summary())
        for fn in self._listeners:
            fn(event)
        return event

    def _write_maps(self, placement: Placement) -> None:
        """Fill the shared maps in place from `placement` (set-up; a placement change
        switches them layer by layer, see PlacementChange)."""
        for dst, src in zip(self._maps, placement.maps(self.max_replicas)):
            dst.copy_(torch.from_numpy(src))

    def _route_by_shares(self, coming: Placement | None = None) -> None:
        """Register `logical_replica_cdf` with the model only while routing may need it:
        when the config plans weighted replicas, or the placement in force (or `coming`,
        about to be applied) has uneven shares. Otherwise register None: the model then
        takes its even-split path, which picks bitwise the replicas the cdf path picks
        for even rows (`moe.dispatch.weighted_replica`) in a few kernels instead of ~20,
        a large part of a decode step's host time."""
        if not self.replica_weights_supported:
            return
        want = (self.config.weighted_replicas or _has_uneven_shares(self.placement)
                or (coming is not None and _has_uneven_shares(coming)))
        if want != self._cdf_registered:
            self.model.set_eplb_replica_weights(self.logical_replica_cdf if want else None)
            self._cdf_registered = want

    def _realised(self, placement: Placement) -> Placement:
        """The placement as the model routes it: without the weighted-replicas extension
        every expert's tokens split evenly, whatever shares the placement carries."""
        if self.replica_weights_supported or placement.shares is None:
            return placement
        return placement.with_physical_to_logical(placement.physical_to_logical, placement.policy)

    def _warn_even_split(self, model_name: str) -> None:
        if self._warned_even_split:
            return
        self._warned_even_split = True
        if self.rank == 0:
            log.warning("%s has no set_eplb_replica_weights (the optional weighted-replicas "
                        "extension of the protocol): it splits every expert's tokens evenly over "
                        "its replicas, so the placement's uneven replica shares are ignored and the "
                        "realised balance is the even-split one, not the planned one", model_name)


def _has_uneven_shares(placement: Placement) -> bool:
    """True when the placement's shares differ from an even split over each expert's replicas."""
    if placement.shares is None:
        return False
    even = 1.0 / np.take_along_axis(placement.replica_count(), placement.physical_to_logical, 1)
    return not np.allclose(placement.shares, even, rtol=0, atol=1e-6)
