"""EplbRuntime: the one place that wires model, recorder, policy and transfer together.

    runtime = EplbRuntime(model, EplbConfig(...), group=ep_group)
    for batch in data:
        out = model(batch)
        runtime.step()          # after every forward; rebalances on schedule
    runtime.rebalance()         # or now, on every rank (a collective)

Every rank of `group` must call `step()` and `rebalance()` in lockstep.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from eplb.config import EplbConfig
from eplb.control import RebalanceRequests, agree, control_group
from eplb.placement import Placement, balancedness_of_gpu_loads
from eplb.planning import plan
from eplb.protocol import MixtureOfExperts, missing_members, replica_cdf, supports_replica_weights
from eplb.recorder import LoadRecorder
from eplb.transfer import TransferExecutor, TransferVerificationError, transfer_stats

log = logging.getLogger("eplb.runtime")


class RebalanceError(RuntimeError):
    """A rebalance stopped part-way; the runtime stays consistent (see `apply_placement`)."""


@dataclass
class RebalanceEvent:
    """What one rebalance did, identical on every rank."""

    step: int
    trigger: str
    balancedness_before: np.ndarray  # [L] measured over the window (mean/max GPU load)
    balancedness_after: np.ndarray  # [L] predicted: the same window's load on the new placement
    experts_moved: int  # remote expert copies received, all ranks together
    local_copies: int  # slots filled from another slot on the same rank
    slots_changed: int
    bytes_moved: int  # bytes sent between ranks, all ranks together
    seconds_plan: float
    seconds_transfer: float
    seconds_commit: float
    placement: Placement = field(repr=False)

    @property
    def seconds(self) -> float:
        return self.seconds_plan + self.seconds_transfer + self.seconds_commit

    def summary(self) -> dict:
        """JSON-ready figures of this rebalance (no placement)."""
        return {
            "step": self.step, "trigger": self.trigger,
            "balancedness_before": float(np.mean(self.balancedness_before)),
            "balancedness_after": float(np.mean(self.balancedness_after)),
            "experts_moved": self.experts_moved, "local_copies": self.local_copies,
            "slots_changed": self.slots_changed, "bytes_moved": self.bytes_moved,
            "seconds_plan": self.seconds_plan, "seconds_transfer": self.seconds_transfer,
            "seconds_commit": self.seconds_commit,
        }


class EplbRuntime:
    def __init__(self, model: MixtureOfExperts, config: EplbConfig | None = None,
                 group: dist.ProcessGroup | None = None):
        missing = missing_members(model)
        if missing:
            raise TypeError(f"{type(model).__name__} does not implement MixtureOfExperts: "
                            f"missing {', '.join(missing)}")
        if model.num_moe_layers < 1:
            raise ValueError("model has no MoE layers (num_moe_layers must be >= 1)")
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
        self._check_expert_weights(S)
        self.bytes_per_expert = sum(w.numel() // S * w.element_size() for w in self.expert_weights[0])

        self.recorder = LoadRecorder(L, N, self.world_size, S, self.config.window_size, self.device)
        self.executor = TransferExecutor(num_nodes=self.config.num_nodes,
                                         verify=self.config.verify_transfers)
        self.steps = 0
        self.events: list[RebalanceEvent] = []
        self._listeners: list[Callable[[RebalanceEvent], None]] = []
        self._step_hooks: list[Callable[["EplbRuntime"], None]] = []
        self.requests = RebalanceRequests()  # filled from any thread, served in step()
        self._control_group = None  # gloo group for agreeing on requests, made on first use
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

    def _check_expert_weights(self, S: int) -> None:
        if len(self.expert_weights) != self.model.num_moe_layers:
            raise ValueError(f"model.expert_weights has {len(self.expert_weights)} layers after "
                             f"set_eplb_state, expected num_moe_layers={self.model.num_moe_layers}")
        for i, ws in enumerate(self.expert_weights):
            for t in ws:
                if t.shape[0] != S:
                    raise ValueError(f"expert_weights[{i}] holds a tensor of shape {tuple(t.shape)}; "
                                     f"dim 0 must be num_local_physical_experts={S}")

    def add_listener(self, fn: Callable[[RebalanceEvent], None]) -> None:
        """Call `fn(event)` after every rebalance (the hook metrics attach to)."""
        self._listeners.append(fn)

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

    def step(self) -> RebalanceEvent | None:
        """Call after every forward: records this step's load; rebalances on schedule or
        when a rank holds a request (all ranks agree at the same step)."""
        self.recorder.record(self.expert_load_pass, self.physical_to_logical)
        self.steps += 1
        for hook in self._step_hooks:
            hook(self)
        interval, control = self.config.rebalance_interval, self.config.control_interval
        requested = False
        if control and self.steps % control == 0:
            if self._control_group is None and self.world_size > 1:
                self._control_group = control_group(self.group)
            requested = agree(self.requests.has_pending(), self._control_group)
        if requested:
            ids = self.requests.start(self.steps)
            try:
                event = self.rebalance(trigger="request")
            except Exception as e:
                self.requests.finish(ids, error=f"{type(e).__name__}: {e}")
                raise
            self.requests.finish(ids, result=event.summary())
            return event
        if interval and self.steps % interval == 0:
            return self.rebalance(trigger="interval")
        return None

    def rebalance(self, trigger: str = "api") -> RebalanceEvent:
        """Plan on the recorded window and move weights now (collective over the group)."""
        t0 = time.perf_counter()
        logical, gpu = self.recorder.window_load(self.group, decay=self.config.load_decay)  # [L, N], [L, M]
        load = logical.cpu().numpy().astype(np.float64)  # [L, N]
        new = self._plan_on_rank0_and_broadcast(load)
        before = balancedness_of_gpu_loads(gpu.cpu().numpy())  # [L]
        seconds_plan = time.perf_counter() - t0
        return self.apply_placement(new, trigger, before=before, load=load, seconds_plan=seconds_plan)

    def _plan_on_rank0_and_broadcast(self, load: np.ndarray) -> Placement:
        """Rank 0 plans, then one broadcast gives every rank the very same placement.

        Message (float64, exact for slot ids): physical_to_logical [L*P], shares [L*P],
        has-shares flag, status flag. The status flag makes a planning error fail every
        rank instead of leaving the others waiting.
        """
        L, P = self.placement.num_layers, self.placement.num_slots
        msg = torch.zeros(2 * L * P + 2, dtype=torch.float64, device=self.device)  # [2LP + 2]
        error = None
        if self.rank == 0:
            try:
                planned = plan(load, self.world_size, P, self.config.num_nodes,
                               self.model.num_expert_groups, self.config.policy, previous=self.placement,
                               move_tolerance=self.config.move_tolerance,
                               weighted=self.config.weighted_replicas)
                msg[:L * P].copy_(torch.from_numpy(planned.physical_to_logical.ravel().astype(np.float64)))
                if planned.shares is not None:
                    msg[L * P:2 * L * P].copy_(torch.from_numpy(planned.shares.ravel().copy()))
                    msg[-2] = 1
                msg[-1] = 1
            except ValueError as e:
                error = e
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(msg, src=src, group=self.group)
        msg = msg.cpu().numpy()
        if error is not None:
            raise error
        if msg[-1] != 1:
            raise RuntimeError("rebalance aborted: planning failed on rank 0 (see its log)")
        p2l = msg[:L * P].astype(np.int64).reshape(L, P)  # [L, P]
        shares = msg[L * P:2 * L * P].reshape(L, P) if msg[-2] == 1 else None  # [L, P]
        return self.placement.with_physical_to_logical(p2l, self.config.policy, shares)

    def apply_placement(self, new: Placement, trigger: str = "api", *, before: np.ndarray | None = None,
                        load: np.ndarray | None = None, seconds_plan: float = 0.0) -> RebalanceEvent:
        """Move weights to `new` (same on every rank) and commit the maps in place."""
        old = self.placement
        if (new.num_layers, new.num_slots, new.num_logical_experts, new.num_gpus) != (
                old.num_layers, old.num_slots, old.num_logical_experts, old.num_gpus):
            raise ValueError(f"placement {new} does not fit the running model {old}")
        t1 = time.perf_counter()
        new_maps = self._maps_of(new)
        done: list[int] = []

        def commit_layer(layer: int) -> None:
            """Weights of `layer` are final: switch its maps with them (same stream)."""
            for dst, src in zip((self.physical_to_logical, self.logical_to_physical_map,
                                 self.logical_replica_count, self.logical_replica_cdf), new_maps):
                dst[layer].copy_(src[layer])
            done.append(layer)

        try:
            self.executor.execute(old.physical_to_logical, new.physical_to_logical,
                                  self.expert_weights, self.group, on_layer_done=commit_layer)
        except Exception as e:
            # every layer is wholly old or wholly new, with maps matching its weights
            mixed = old.physical_to_logical.copy()  # [L, P]
            mixed[done] = new.physical_to_logical[done]
            shares = None
            if old.shares is not None or new.shares is not None:
                shares = old.slot_shares().copy()  # [L, P]
                shares[done] = new.slot_shares()[done]
            self.placement = old.with_physical_to_logical(mixed, old.policy, shares)
            self.recorder.on_placement_change()
            if isinstance(e, TransferVerificationError):
                # the layer's weights were already rewritten (one slot wrong) under its old maps
                raise RebalanceError(
                    f"rebalance failed after {len(done)} of {old.num_layers} layers ({e}); "
                    f"layers before {e.layer} are on the new placement, later ones on the old; "
                    f"layer {e.layer} keeps its old maps but its weights were rewritten and are "
                    f"NOT consistent: reload them before serving") from e
            raise RebalanceError(
                f"rebalance failed after {len(done)} of {old.num_layers} layers "
                f"({type(e).__name__}: {e}); every layer is on its old or its new placement "
                f"and serving can continue") from e
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        t2 = time.perf_counter()
        self.placement = new
        if not self.replica_weights_supported and _has_uneven_shares(new):
            self._warn_even_split(type(self.model).__name__)
        self.recorder.on_placement_change()
        seconds_commit = time.perf_counter() - t2
        stats = transfer_stats(old.physical_to_logical, new.physical_to_logical, self.world_size)
        if load is None:
            load = np.ones((old.num_layers, old.num_logical_experts))
        event = RebalanceEvent(
            step=self.steps, trigger=trigger,
            balancedness_before=before if before is not None else self._realised(old).balancedness(load),
            balancedness_after=self._realised(new).balancedness(load),
            experts_moved=stats.experts_moved, local_copies=stats.local_copies,
            slots_changed=stats.slots_changed, bytes_moved=stats.experts_moved * self.bytes_per_expert,
            seconds_plan=seconds_plan, seconds_transfer=t2 - t1, seconds_commit=seconds_commit,
            placement=new,
        )
        self.events.append(event)
        if self.rank == 0:
            log.info("rebalance at step %d (%s): balancedness %.4f -> %.4f, %d experts moved "
                     "(%.1f MB) in %.3f s", event.step, trigger, event.balancedness_before.mean(),
                     event.balancedness_after.mean(), event.experts_moved, event.bytes_moved / 1e6,
                     event.seconds)
        for fn in self._listeners:
            fn(event)
        return event

    def _write_maps(self, placement: Placement, layers=None) -> None:
        """Rewrite the shared maps of `layers` (default all) in place from `placement`
        (storage unchanged, so every view, and any captured CUDA graph, sees it)."""
        rows = slice(None) if layers is None else list(layers)
        maps = self._maps_of(placement)
        for dst, src in zip((self.physical_to_logical, self.logical_to_physical_map,
                             self.logical_replica_count, self.logical_replica_cdf), maps):
            dst[rows] = src[rows].to(dst.device)

    def _maps_of(self, placement: Placement) -> tuple[torch.Tensor, ...]:
        """CPU tensors p2l [L, P], l2p [L, N, R], count [L, N], cdf [L, N, R] of a placement."""
        count = placement.replica_count()  # [L, N]
        # shares in l2p order (even when placement.shares is None), cumulated; last valid = 1.0
        cdf = replica_cdf(placement.replica_shares(self.max_replicas), count)  # [L, N, R]
        return (torch.from_numpy(placement.physical_to_logical.copy()),
                torch.from_numpy(placement.logical_to_physical(self.max_replicas)),
                torch.from_numpy(count), torch.from_numpy(np.asarray(cdf)))

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
