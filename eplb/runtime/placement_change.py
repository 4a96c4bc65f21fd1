"""PlacementChange: the one layer mover. Every move of expert weights between placements
of the same size goes through it: the runtime's rebalances (synchronous and in the
background), `apply_placement`, a resize's move to its planned placement, and the
standalone `TransferExecutor` of tools and benchmarks. Every changed layer goes through:

1. **exchange** (`transfer.exchange_layer`): stage local sources and receive remote
   experts into a staging buffer, only *reading* the weights (so it can run while the
   model serves: in a background thread, on a side CUDA stream, over its own group);
   with `verify`, the staged experts are checked against their pre-transfer checksums;
2. **agree** (`control.StepAgreement`): at a step boundary all ranks all-reduce (gloo)
   how many layers they have staged and whether anything failed;
3. **switch** (`layer_switch.switch_layer`): when every rank has the layer staged, each
   writes its changed slots and the layer's rows of the new maps, on the caller's
   stream: weights and maps switch together, at the same step on every rank.

`run()` drives the stages to the end (synchronous; over IPC without `verify` stages 1 and
3 are one in-place pass, `IpcTransport.move`). `start()` runs planning and exchanges in a
thread and the step loop calls `advance()` once per step (agree, switch at most one
layer); with `launch_in_step` (NCCL on GPUs) the thread only prepares each layer and
`advance()` launches its exchange at the same step on every rank.

Failures every rank learns through the agreement (planning error, transfer or
verification failure anywhere, no progress for `timeout` s) abort the change on all ranks
at the same layer: `RebalanceError`, earlier layers new, later ones old, maps matching
weights; serving continues. When the agreement itself fails (a peer died or froze), or
a layer's write fails here, `EplbFatalError`. Around it: `MoveOptions` in `move_options`,
`ChangeStats` and the errors in `events`, the staging buffer in `staging`, the checks of
`verify` in `verify`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from eplb.core.placement import Placement
from eplb.core.transfer_plan import LayerTransferPlan, plan_layer_transfer
from eplb.runtime import transfer as _transfer
from eplb.runtime.control import StepAgreement
from eplb.runtime.events import ChangeStats, EplbFatalError, RebalanceError
from eplb.runtime.groups import EplbGroups
from eplb.runtime.layer_switch import launch_exchange, switch_layer
from eplb.runtime.move_options import MoveOptions
from eplb.runtime.staging import StagingCache
from eplb.runtime.transport_base import Transport
from eplb.runtime.transport_choice import resolve_transport
from eplb.runtime.verify import check_staged, gather_checksums

log = logging.getLogger("eplb.runtime.placement_change")


class PlacementChange:
    """Moves expert weights and maps from `old` to the placement `plan_fn()` returns.

    `plan_fn()`: returns the new Placement, identical on every rank (it may run
    collectives on `groups.plan`, e.g. rank 0 plans and broadcasts); runs in the
    background thread in asynchronous mode.
    `weights`: per layer the local expert tensors `[S, ...]`, written in place only.
    `maps`: the runtime's map tensors (`Placement.maps` order: p2l [L, P], l2p [L, N, R],
    count [L, N], cdf [L, N, R]), or none (weights only); a layer's rows are copied when
    the layer switches.
    `groups`: `transfer` carries the weights (EP backend), `control` (gloo) the step
    loop's agreements, `plan` (gloo) the thread's small CPU collectives.
    `transport`: a `Transport` (`make_transport`, or one deriving from `TransportBase`);
    the mover calls its `exchange`, `write`, `can_move`/`move`, `hold` and
    `exchange_launches_no_kernels`.
    `stream`: the side CUDA stream of the background thread (asynchronous mode; None
    creates one, which initialises torch's stream pool the first time).
    `staging`: the owner's StagingCache (default: a new one, freed when the change ends).
    `on_switch(layer)`: called on the caller's thread right after a layer switched.
    """

    def __init__(self, old: Placement, plan_fn: Callable[[], Placement],
                 weights: Sequence[Sequence[torch.Tensor]], maps: Sequence[torch.Tensor] = (), *,
                 groups: EplbGroups, transport, device: torch.device | None = None,
                 options: MoveOptions = MoveOptions(), stream=None,
                 staging: StagingCache | None = None,
                 on_switch: Callable[[int], None] | None = None) -> None:
        self.old = old
        self.plan_fn = plan_fn
        self.weights = [list(w) for w in weights]
        self.maps = list(maps)
        self.groups = groups
        self.rank, self.num_ranks = groups.rank, groups.size
        self.options = options
        self.device = device if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.transport: Transport = resolve_transport(transport)
        self.stream = stream  # the background thread's CUDA stream (None: a new one)
        self.staging_cache = staging if staging is not None else StagingCache()
        self.on_switch = on_switch
        self.launch_in_step = False  # resolved by start(): exchanges launched by advance()
        # everything already queued on the caller's stream (earlier writes of expert
        # weights among it) comes before this change reads a weight on another stream
        self._start_event = None
        if self.cuda:
            self._start_event = torch.cuda.Event()
            self._start_event.record(torch.cuda.current_stream(self.device))

        self.new: Placement | None = None
        self.layers: list[int] | None = None  # changed layers, in order (same on every rank)
        self.ready = -1  # -1 until planned, then layers staged so far
        self._all_planned = False  # an agreement said every rank has planned
        self.prepared = 0  # layers whose exchange the thread has prepared (launch in step)
        self.launched = 0  # layers whose exchange advance() launched (launch in step)
        self.committed = 0  # layers switched so far
        self.error: BaseException | None = None  # this rank's failure, if any
        self.aborted = False
        self.stats = ChangeStats()  # timers and counts, what the RebalanceEvent reports

        self._cv = threading.Condition()
        self._agreement = StepAgreement(groups.control, self.num_ranks)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_progress = time.monotonic()
        self._plans: list[LayerTransferPlan | None] = []
        self._staging: list[torch.Tensor] | None = None
        self._new_maps: list[torch.Tensor] = []
        self._ready_events: list = []
        self._write_events: list = []
        self._in_place: list[bool] = []  # per changed layer: moved by the switch itself

    # ---- state -------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Every changed layer switched, and every rank knows that every rank planned (the
        same verdict on every rank, at the same step: a change with no changed layer must
        not finish on one rank's own planning while another rank still plans)."""
        return self._all_planned and self.layers is not None and self.committed == len(self.layers)

    @property
    def pipelined(self) -> bool:
        """Asynchronous mode: each agreement is read one step later."""
        return self._agreement.pipelined

    @property
    def switched_layers(self) -> list[int]:
        return [] if self.layers is None else self.layers[:self.committed]

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- driving -----------------------------------------------------------------
    def run(self) -> None:
        """Synchronous: plan, then exchange, agree and switch every layer, on this thread."""
        stages = self._stages()
        while not self.finished:
            if self.error is None:
                try:
                    next(stages)
                except StopIteration:
                    pass
                except Exception as e:  # noqa: BLE001 - every failure goes through the agreement
                    self._fail(e)
            self.advance()
        stages.close()

    def start(self) -> None:
        """Asynchronous: plan and exchange in a daemon thread; call `advance()` every step.
        With `launch_in_step`, the thread prepares each layer and `advance()` launches its
        exchange."""
        self._agreement.pipelined = True
        self.launch_in_step = self.options.launches_in_step(self.cuda, self.num_ranks, self.transport)
        if self.cuda and self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self._thread = threading.Thread(target=self._background, name="eplb-rebalance", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
                ctx = torch.cuda.stream(self.stream)
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                for _ in self._stages():
                    pass
        except BaseException as e:  # noqa: BLE001 - reported through the agreement
            self._fail(e)

    def advance(self) -> bool:
        """One step boundary: agree with every rank, then switch the next layer if every
        rank has it staged. Returns `finished`. Raises RebalanceError when any rank failed
        (the change is aborted everywhere at the same layer), EplbFatalError when the
        agreement itself fails.

        Asynchronous mode pipelines the agreement: the all-reduce started at one boundary
        (gloo, in its own thread) is read at the next one, so the step loop does not wait
        for a round trip; every rank acts on the same agreed values, one step later."""
        t0 = time.perf_counter()
        try:
            return self._advance()
        finally:
            self.stats.charge_step_loop(time.perf_counter() - t0)

    def _advance(self) -> bool:
        self.stats.steps += 1
        t_agree = time.perf_counter()
        try:
            agreed = self._agreement.agree(self._local_state)
            if agreed is None:  # the first pipelined boundary only starts an agreement
                return False
            self.stats.seconds_agree_wait += time.perf_counter() - t_agree
        except Exception as e:  # noqa: BLE001
            self._stop_thread()
            raise EplbFatalError(
                f"rebalance lost contact with its peers after {self.committed} switched layers "
                f"({type(e).__name__}: {e}); a rank died or stopped answering") from e
        min_ready, min_prepared, all_ok, failed_rank = agreed
        if min_ready >= 0:  # every rank has planned (ready is -1 until then)
            self._all_planned = True
        if not all_ok:
            self._stop_thread()
            self.aborted = True
            self.stats.t_end = time.perf_counter()
            why = (f"{type(self.error).__name__}: {self.error}" if self.error is not None
                   else f"rank {failed_rank} failed, see its log")
            raise RebalanceError(why) from self.error
        if min_ready > self.committed:
            self._switch_next()
        if self.launch_in_step and min_prepared > self.launched:  # every rank, same step
            self._launch_next()
        if self.finished:
            if self.stats.t_end is None:
                self.stats.t_end = time.perf_counter()
        elif self.pipelined:  # every rank takes this branch together
            try:
                self._agreement.start_next(self._local_state())
            except Exception as e:  # noqa: BLE001
                self._stop_thread()
                raise EplbFatalError(f"rebalance lost contact with its peers ({e})") from e
        return self.finished

    def _local_state(self) -> list[int]:
        """[layers staged, layers prepared, ok, this rank if failed else num_ranks]; a change
        with no layer switched for `timeout` seconds counts as failed here."""
        with self._cv:
            ready, prepared, ok = self.ready, self.prepared, self.error is None
        timeout = self.options.timeout
        if ok and time.monotonic() - self._last_progress > timeout:
            self._fail(TimeoutError(f"no layer switched for {timeout:g} s (the move's timeout: "
                                    "EplbConfig.transfer_timeout, or TransferExecutor's timeout)"))
            ok = False
        return [ready, prepared, int(ok), self.num_ranks if ok else self.rank]

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()

    def _stop_thread(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def abandon(self) -> None:
        """Let the background thread stop at its next layer (shutdown); nothing is undone."""
        self._stop_thread()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the background thread (after an abort it may still sit in a transfer
        until the group's timeout); True when it is gone."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.thread_alive

    # ---- the stages ----------------------------------------------------------------
    def _stages(self):
        """Generator: plan (yield), then per changed layer exchange into staging (yield).
        Before each exchange it waits until the previous layer switched (one staging
        buffer: at most one layer of local experts of extra memory)."""
        t0 = time.perf_counter()
        if self._start_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._start_event)
        new = self.plan_fn()
        old_p2l, new_p2l = self.old.physical_to_logical, new.physical_to_logical  # [L, P]
        if self.maps:  # changed layers: other experts in some slot, or other replica shares
            R = self.maps[1].shape[2]
            maps_new, maps_old = new.maps(R), self.old.maps(R)  # numpy, [L, ...] each
            layers = [l for l in range(old_p2l.shape[0])
                      if not all(np.array_equal(a[l], b[l]) for a, b in zip(maps_new, maps_old))]
        else:  # weights only: layers with other experts in some slot
            maps_new = ()
            layers = [l for l in range(old_p2l.shape[0]) if not np.array_equal(old_p2l[l], new_p2l[l])]
        new_maps = [torch.from_numpy(a).to(self.device) for a in maps_new] if layers else []
        self.stats.seconds_plan = time.perf_counter() - t0
        with self._cv:
            self.new, self.layers, self._new_maps = new, layers, new_maps
            n = len(layers)
            self._plans, self._ready_events, self._write_events = [None] * n, [None] * n, [None] * n
            self._in_place = [False] * n
            self.ready = 0
        yield
        for i, layer in enumerate(layers):
            with self._cv:
                while self.committed < i and not self._stop:
                    self._cv.wait(0.05)
                if self._stop:
                    return
            if self.cuda and i > 0:  # staging is free once the previous layer's write ran
                torch.cuda.current_stream(self.device).wait_event(self._write_events[i - 1])
            weights = self.weights[layer]
            plan = plan_layer_transfer(old_p2l[layer], new_p2l[layer], self.num_ranks, self.rank,
                                       self.options.num_nodes)
            verify = self.options.verify
            if not self.pipelined and not verify and self.transport.can_move(weights):
                # synchronous, over IPC: the switch moves the layer in place in one pass
                # (`IpcTransport.move`), nothing is staged ahead
                with self._cv:
                    self._plans[i], self._in_place[i] = plan, True
                    self.ready = i + 1
                yield
                continue
            if self._staging is None:
                self._staging = self.staging_cache.get(self.transport, weights)
            old_sums = (gather_checksums(weights, self.groups.plan, self.num_ranks)  # [P]
                        if verify else None)
            if self.launch_in_step:  # advance() launches it on this thread's stream
                with self._cv:
                    self._plans[i] = plan
                    self.prepared = i + 1
                    while self.launched <= i and not self._stop and self.error is None:
                        self._cv.wait(0.05)
                    if self._stop or self.error is not None:
                        return
            else:
                _transfer.exchange_layer(plan, weights, self.groups.transfer, self._staging,
                                         transport=self.transport)
            if old_sums is not None:
                check_staged(self._staging, plan, layer, self.rank,
                             self.old.physical_to_logical[layer], old_sums)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                event.synchronize()  # the host learns the layer is staged (this thread only)
            with self._cv:
                self._plans[i], self._ready_events[i] = plan, event
                self.ready = i + 1
            yield

    def _launch_next(self) -> None:
        """Launch the next prepared layer's exchange from the step loop, on the side stream
        (launch in step). Every rank does it at the same step (the agreed `prepared`), so
        the transfer group's kernels enter each GPU in the same order relative to the
        model's collectives. A failure goes through the agreement like one in the thread."""
        i = self.launched
        try:
            launch_exchange(self._plans[i], self.weights[self.layers[i]], self._staging,
                            transport=self.transport, group=self.groups.transfer,
                            stream=self.stream if self.cuda else None)
        except Exception as e:  # noqa: BLE001 - reported through the agreement
            self._fail(e)
            return
        with self._cv:
            self.launched = i + 1
            self._cv.notify_all()

    def _switch_next(self) -> None:
        """Switch the next staged layer (`switch_layer`: weights, then maps) on the caller's
        stream. A failure here leaves this rank inconsistent: fatal, naming the layer
        (`EplbFatalError.partly_written`)."""
        t0 = time.perf_counter()
        i = self.committed
        layer = self.layers[i]
        try:
            self._write_events[i] = switch_layer(
                self._plans[i], self.weights[layer], layer, staging=self._staging, maps=self.maps,
                new_maps=self._new_maps, transport=self.transport, group=self.groups.transfer,
                in_place=self._in_place[i], ready_event=self._ready_events[i],
                device=self.device, stats=self.stats)
        except Exception as e:  # noqa: BLE001
            self._stop_thread()
            raise EplbFatalError(f"writing layer {layer} failed ({type(e).__name__}: {e}); its "
                                 "weights may be partly rewritten: reload the model",
                                 partly_written=layer) from e
        with self._cv:
            self.committed = i + 1
            self._plans[i] = None
            if self.finished:
                self._staging = None  # free the staging buffer (unless the cache keeps it)
                self.staging_cache.done()
            self._cv.notify_all()
        self._last_progress = time.monotonic()
        self.stats.seconds_switch += time.perf_counter() - t0
        if self.on_switch is not None:
            self.on_switch(layer)
