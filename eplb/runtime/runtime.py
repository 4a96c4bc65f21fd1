"""EplbRuntime: the one place that wires model, recorder, policy and transfer together.

    runtime = EplbRuntime(model, EplbConfig(...), group=ep_group)
    for batch in data:
        out = model(batch)
        runtime.step()          # after every forward; rebalances on schedule
    runtime.rebalance()         # or now, on every rank (a collective)

Every rank of `group` must call `step()` and `rebalance()` in lockstep.
"""
from __future__ import annotations

import atexit
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.config import EplbConfig
from eplb.runtime.control import RebalanceRequests, agree
from eplb.runtime.groups import EplbGroups
from eplb.runtime.plan_broadcast import PlanBroadcastError, broadcast_arrays
from eplb.core.placement import Placement, balancedness_of_gpu_loads
from eplb.runtime.planner_process import PlannerProcess, PlannerProcessError
from eplb.core.planning import plan, predicted_gain, worth_moving
from eplb.protocol import MixtureOfExperts, missing_members, supports_replica_weights
from eplb.runtime.recorder import LoadRecorder
from eplb.runtime.placement_change import EplbFatalError, MoveOptions, PlacementChange, RebalanceError
from eplb.runtime.transfer import make_transport, slot_checksums, transfer_stats

log = logging.getLogger("eplb.runtime")

NO_LOAD = "no load recorded (the window is all zero: the model added nothing into expert_load_view)"


__all__ = ["EplbRuntime", "RebalanceEvent", "RebalanceError", "EplbFatalError"]

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


@dataclass
class RebalanceEvent:
    """What one rebalance did, identical on every rank. A skipped rebalance (its plan
    gained less than `min_gain`) moved nothing and kept the placement in force."""

    step: int
    trigger: str
    balancedness_before: np.ndarray  # [L] measured over the window's per-GPU load (mean/max)
    balancedness_after: np.ndarray  # [L] predicted: the window's load on the placement in force after
    experts_moved: int  # remote expert copies received, all ranks together
    local_copies: int  # slots filled from another slot on the same rank
    slots_changed: int
    bytes_moved: int  # bytes sent between ranks, all ranks together
    seconds_plan: float
    seconds_transfer: float
    seconds_commit: float  # time the step loop spent switching layers (writes + maps)
    placement: Placement = field(repr=False)
    steps_in_flight: int = 0  # step boundaries the change spanned (asynchronous mode; else 0)
    # what the change cost the step loop (host time): in total, its longest single step
    # boundary, and the part of the total spent waiting for agreements
    seconds_step_loop: float = 0.0
    max_step_loop_seconds: float = 0.0
    seconds_agree_wait: float = 0.0
    # mean predicted balancedness of the plan minus that of the placement in force, both on
    # the window's load; a plan gaining less than min_gain is skipped
    predicted_gain: float = 0.0
    skipped: bool = False
    min_gain: float = 0.0
    skip_reason: str = ""  # set when skipped for another reason than the gain (NO_LOAD)

    @property
    def seconds(self) -> float:
        return self.seconds_plan + self.seconds_transfer + self.seconds_commit

    @property
    def outcome(self) -> str:
        """"skipped" or "success" (the `outcome` label of eplb_rebalances_total)."""
        return "skipped" if self.skipped else "success"

    def describe(self) -> str:
        """One line for logs and consoles, e.g. `rebalance at step 50 (interval): balancedness
        0.868 -> 0.984 (predicted), 20 experts moved (0.98 MB) in 0.044 s`."""
        head = f"rebalance at step {self.step} ({self.trigger})"
        before = float(np.mean(self.balancedness_before))
        if self.skipped:
            why = self.skip_reason or (
                f"nothing to gain (predicted gain {self.predicted_gain:+.4f})"
                if self.predicted_gain <= 0
                else f"predicted gain {self.predicted_gain:+.4f} < min gain {self.min_gain:.4f}")
            return f"{head} skipped: {why}; balancedness {before:.4f}, nothing moved"
        return (f"{head}: balancedness {before:.4f} -> {float(np.mean(self.balancedness_after)):.4f} "
                f"(predicted), {self.experts_moved} experts moved ({self.bytes_moved / 1e6:.2f} MB) "
                f"in {self.seconds:.3f} s"
                + (f" over {self.steps_in_flight} steps" if self.steps_in_flight else ""))

    def summary(self) -> dict:
        """JSON-ready figures of this rebalance (no placement)."""
        return {
            "step": self.step, "trigger": self.trigger, "outcome": self.outcome,
            "skipped": self.skipped, "skip_reason": self.skip_reason,
            "balancedness_before": float(np.mean(self.balancedness_before)),
            "balancedness_after": float(np.mean(self.balancedness_after)),
            "predicted_gain": self.predicted_gain, "min_gain": self.min_gain,
            "experts_moved": self.experts_moved, "local_copies": self.local_copies,
            "slots_changed": self.slots_changed, "bytes_moved": self.bytes_moved,
            "seconds_plan": self.seconds_plan, "seconds_transfer": self.seconds_transfer,
            "seconds_commit": self.seconds_commit, "steps_in_flight": self.steps_in_flight,
            "seconds_step_loop": self.seconds_step_loop,
            "max_step_loop_seconds": self.max_step_loop_seconds,
            "seconds_agree_wait": self.seconds_agree_wait,
        }


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
        config = config or EplbConfig(num_redundant_experts=P - N)
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
        if self.replica_weights_supported:
            model.set_eplb_replica_weights(self.logical_replica_cdf)
        self.expert_weights = [list(w) for w in model.expert_weights]  # L lists of [S, ...] tensors
        problem = self._expert_weights_problem(S)  # this rank's; all ranks agree below

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
            self._check_registration(problem)  # collective: every rank raises alike
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
            self.groups.transfer, timeout=self.config.transfer_timeout)
        # the rebalance thread's side stream, made here: the first stream a process makes
        # sets up torch's stream pool, which would otherwise hold the GIL inside the step
        # that starts the first rebalance
        self._side_stream = None
        if self.device.type == "cuda" and self.config.async_rebalance:
            self._side_stream = torch.cuda.Stream(self.device)
        self._planner: PlannerProcess | None = None  # rank 0, asynchronous mode
        if self.rank == 0 and self.config.async_rebalance:
            self._planner = self._start_planner_process() if self.config.planner_process else None
            self._warm_up_planner()
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
    def _start_planner_process(self) -> PlannerProcess | None:
        """The child process rank 0 plans in (asynchronous mode), or None to plan in the
        rebalance thread: when the policy was registered at run time (unknown in the
        child) or the child cannot start."""
        try:
            planner = PlannerProcess()
            if planner.can_plan(self.config.policy):
                return planner
            planner.close()
            log.info("eplb: policy %r is not built in: planning in the rebalance thread",
                     self.config.policy)
        except (OSError, PlannerProcessError) as e:
            log.warning("eplb: the planner process did not start (%s): planning in the "
                        "rebalance thread", e)
        return None

    def _plan(self, load: np.ndarray) -> Placement:
        """Rank 0's planning call: in the planner process when there is one."""
        fn = self._planner.plan if self._planner is not None else plan
        return fn(load, self.world_size, self.placement.num_slots, self.config.num_nodes,
                  self.model.num_expert_groups, self.config.policy, previous=self.placement,
                  move_tolerance=self.config.move_tolerance, weighted=self.config.weighted_replicas)

    def _warm_up_planner(self) -> None:
        """Plan once on a uniform load, now: the first plan of a process pays for imports
        and first-call costs (tens of ms of Python holding the GIL), which would otherwise
        land in the first rebalance and, in the thread, delay the steps served beside it."""
        L, N = self.placement.num_layers, self.placement.num_logical_experts
        self._plan(np.ones((L, N)))

    @staticmethod
    def _find_device(model) -> torch.device:
        for w in getattr(model, "expert_weights", None) or []:
            for t in w:
                return t.device
        if isinstance(model, torch.nn.Module):
            for p in model.parameters():
                return p.device
        return torch.device("cpu")

    def _expert_weights_problem(self, S: int) -> str | None:
        """What is wrong with this rank's registered expert tensors, or None: one list of
        tensors per MoE layer, each `[S, ...]`, sharing memory with the tensors the layer
        itself returns (`get_expert_weights`, when the layer has it)."""
        L = self.model.num_moe_layers
        if len(self.expert_weights) != L:
            return (f"model.expert_weights has {len(self.expert_weights)} layers after "
                    f"set_eplb_state, expected num_moe_layers={L}")
        for i, ws in enumerate(self.expert_weights):
            if not ws:
                return f"expert_weights[{i}] holds no tensor: register the layer's expert tensors"
            for j, t in enumerate(ws):
                if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != S:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    return (f"expert_weights[{i}][{j}] has shape {shape}; dim 0 must be the "
                            f"local slot count num_local_physical_experts={S} (one row per "
                            f"slot this rank holds)")
        layers = list(self.model.moe_layers)
        if len(layers) != L:
            return None
        for i, (layer, ws) in enumerate(zip(layers, self.expert_weights)):
            get = getattr(layer, "get_expert_weights", None)
            if not callable(get):
                continue
            used = {u.untyped_storage().data_ptr() for u in get()}
            for j, t in enumerate(ws):
                if t.untyped_storage().data_ptr() not in used:
                    return (f"expert_weights[{i}][{j}] shares no memory with the tensors "
                            f"moe_layers[{i}].get_expert_weights() returns: the runtime would "
                            f"move weights the layer never reads; register the layer's own "
                            f"tensors (or views of them), not copies")
        return None

    def _check_registration(self, problem: str | None) -> None:
        """Raise the same ValueError on every rank when any rank's expert tensors do not
        fit (`problem`) or when replicas of one expert are not bitwise equal in the
        start-up layout (slot p holds expert p mod N). Collective over the plan group:
        one all_gather of [2] ints, then one of per-slot checksums [L, S, T] int64 (only
        when some expert has replicas)."""
        L, N, P = self.placement.num_layers, self.placement.num_logical_experts, self.placement.num_slots
        M, S = self.world_size, P // self.world_size
        T = 0 if problem else max(len(ws) for ws in self.expert_weights)  # tensors per layer
        if M > 1:
            heads = self._gather(torch.tensor([problem is not None, T], dtype=torch.int64))  # [M, 2]
            bad = [r for r in range(M) if heads[r, 0]]
            if bad and problem is None:
                problem = (f"rank(s) {bad} registered expert weights that do not fit (see the "
                           f"error there)")
            elif not bad and len(set(heads[:, 1].tolist())) > 1:
                problem = (f"ranks register different numbers of expert tensors per layer: "
                           f"{heads[:, 1].tolist()} (rank by rank)")
        if problem:
            raise ValueError(f"EplbRuntime{f' (rank {self.rank})' if M > 1 else ''}: {problem}")
        if P == N:  # no expert has a replica
            return
        mine = torch.zeros(L, S, T, dtype=torch.int64, device=self.device)  # [L, S, T]
        for i, ws in enumerate(self.expert_weights):
            for j, w in enumerate(ws):
                mine[i, :, j] = slot_checksums([w]).to(self.device)  # [S]
        mine = mine.cpu()
        every = self._gather(mine) if M > 1 else mine[None]  # [M, L, S, T]
        cs = every.permute(1, 0, 2, 3).reshape(L, P, T).numpy()  # [L, P, T]
        mismatches = []  # (layer, expert, tensor, slots that differ from the expert's first)
        for i in range(L):
            for e in range(min(N, P - N)):  # experts with more than one replica
                slots = np.arange(e, P, N)  # [replicas of e]
                for j in range(T):
                    differ = slots[cs[i, slots, j] != cs[i, e, j]]
                    if differ.size:
                        mismatches.append((i, e, j, differ.tolist()))
        if mismatches:
            i, e, j, differ = mismatches[0]
            more = f" ({len(mismatches)} such mismatches in all)" if len(mismatches) > 1 else ""
            raise ValueError(
                f"EplbRuntime: replicas of one expert are not bitwise equal: layer {i}, "
                f"expert {e}: tensor {j} (expert_weights[{i}][{j}]) of slot(s) {differ} "
                f"(rank(s) {[p // S for p in differ]}) differs from slot {e} (rank {e // S})"
                f"{more}. At start-up slot p must hold logical expert p mod N (N={N}, "
                f"P={P} slots, rank r holds slots [r*S, (r+1)*S), S={S}), the layout of "
                f"Placement.initial: fill the slots in that order, with the same weights for "
                f"every replica, before creating the runtime")

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """All ranks' `t` (CPU) stacked, over the plan group: [M, *t.shape]."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.groups.plan)
        return torch.stack(parts)

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
        return None

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
        """Whether any rank of the group holds a request (a one-rank group asks no one)."""
        pending = self.requests.has_pending()
        return pending if self.world_size == 1 else agree(pending, self.groups.control)

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
        info = {"request_ids": request_ids or [], "t_start": time.perf_counter(), "trigger": trigger}
        read_window = self._window_reader(info)  # collective: the window's all-reduce

        def plan_fn() -> Placement:
            t0 = time.perf_counter()
            read_window()
            if not info["load"].any():  # all-reduced: the same verdict on every rank
                info.update(skipped=True, skip_reason=NO_LOAD, predicted_gain=0.0,
                            seconds_plan=time.perf_counter() - t0)
                return self.placement
            planned = self._plan_on_rank0_and_broadcast(info["load"])
            # the same decision on every rank: same broadcast plan, same all-reduced load
            move, info["predicted_gain"] = worth_moving(
                self._realised(self.placement), self._realised(planned), info["load"],
                self.config.min_gain)
            info["skipped"] = not move
            info["seconds_plan"] = time.perf_counter() - t0
            return planned if move else self.placement

        return self._begin(plan_fn, info, self.config.async_rebalance)

    def _window_reader(self, info: dict) -> Callable[[], None]:
        """All-reduce the recorded window now (a collective, on the step loop) and return
        the function that fills `info` from it on the host: "load" [L, N] (what the planner
        sees) and "before" [L] (balancedness measured from the per-GPU window). In
        asynchronous mode that function runs in the rebalance thread, after the
        all-reduce's kernels, so the step loop never waits for the copy."""
        logical, gpu = self.recorder.window_load(self.group, decay=self.config.load_decay)  # [L, N], [L, M]
        window_done = None
        if self.device.type == "cuda":  # read() may run on another thread and stream
            window_done = torch.cuda.Event()
            window_done.record(torch.cuda.current_stream(self.device))

        def read() -> None:
            if window_done is not None:
                torch.cuda.current_stream(self.device).wait_event(window_done)
            info["load"] = logical.cpu().numpy().astype(np.float64)  # [L, N]
            info["before"] = balancedness_of_gpu_loads(gpu.cpu().numpy())  # [L]

        return read

    def _plan_on_rank0_and_broadcast(self, load: np.ndarray) -> Placement:
        """Rank 0 plans, then one broadcast (CPU, the gloo plan group) gives every rank the
        very same placement (eplb.runtime.plan_broadcast); a planning error on rank 0
        fails every rank."""
        L, P = self.placement.num_layers, self.placement.num_slots

        def make():
            planned = self._plan(load)
            return planned.physical_to_logical, planned.shares

        try:
            p2l, shares = broadcast_arrays(make, [(L, P), (L, P)], self.groups.plan)
        except PlanBroadcastError as e:
            raise RuntimeError(str(e)) from None
        return self.placement.with_physical_to_logical(p2l.astype(np.int64), self.config.policy, shares)

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
        if self._planner is not None:
            self._planner.close()
            self._planner = None
        close_transport = getattr(self.transport, "close", None)
        if close_transport is not None:  # IPC: drop the mappings of the peers' tensors
            close_transport()
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
            _RETIRED_GROUPS.extend(x for x in (g.transfer, g.plan, g.control) if x is not None)
        self.groups = EplbGroups(self.group, None, None, None, self.config.transfer_timeout)

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
                self.groups = self.groups.renew(self.device)
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
