"""Prometheus metrics of an EplbRuntime, and the job's recorded load for GET /load.

    metrics = EplbMetrics(runtime, interval=10)      # on EVERY rank, before the first step()
    if runtime.rank == 0:
        EplbServer(runtime, metrics, port=9400).start()   # eplb.ops.server: one scrape target per job

Design: rank 0 aggregates. Every rank attaches an `EplbMetrics`. Its step hook adds this
rank's per-GPU counts of the step (`recorder.last_gpu_load()`, `[L, M]`) and, with
`export_load` (the default), its logical counts of the step (`[L, N]`) into small
accumulators on the device: tensor ops, no host synchronisation. Every `interval` steps
every rank all-reduces ONE buffer on the runtime's group: the per-GPU accumulator `[L, M]`,
and with `export_load` also the logical accumulator `[L, N]` and this rank's part of the
planner's window (`[L, N]` logical, weighted by `load_decay` like the planner's, and `[L, M]`
per GPU since the placement in force began), i.e. `[L, 2M + 2N]` int64 (float64 when
`load_decay < 1`; counts stay exact below 2**53). Rank 0 alone copies it to the host, sets
the load gauges and keeps the load snapshot that `GET /load` serves (the HTTP thread only
reads that host copy: it never runs a collective). So the job exposes one consistent view
of all GPUs from one process, at the cost of one all-reduce per interval, the window sums
(`window_size x L x (N + M)` elements read per interval on every rank) and one host sync per
interval on rank 0 only. Because the hook is a collective, every rank of the group must
attach with the same `interval` and `export_load`. The per-GPU accumulator restarts at every
rebalance that changed the placement, so the load gauges describe the placement in force.

Rebalance figures come from `runtime.add_listener` (events are identical on every rank);
failures come from `runtime.add_failure_listener` (`track()`, installed by default).
Step count, window fill, placement age and the per-layer GPU load are read at scrape time.

Metric names (stable; the Grafana dashboard and alerting rules depend on them):

    eplb_balancedness_ratio{layer}                mean/max GPU load per layer, last interval
    eplb_balancedness_overall_ratio               mean of the above over layers
    eplb_gpu_load_tokens{gpu}                     token-expert assignments per GPU (all
                                                  layers) per step, mean over last interval
    eplb_gpu_layer_load_tokens{layer,gpu}         opt-in (per_layer_gpu_load=True): the same
                                                  per layer, L x M series
    eplb_rebalances_total{trigger,outcome}        trigger interval|request|api|initial|shift|resize
                                                  (HTTP requests count as "request"),
                                                  outcome success|failure|skipped (skipped:
                                                  the predicted gain was below min_gain, no
                                                  weights moved)
    eplb_rebalance_duration_seconds{phase}        histogram, phase plan|transfer|commit|total
                                                  (a skipped rebalance observes plan only)
    eplb_experts_moved_total                      remote expert copies, all ranks
    eplb_bytes_moved_total                        bytes sent between ranks, all ranks
    eplb_rebalance_balancedness_ratio{when}       before|after (predicted) of the last rebalance
                                                  (skipped ones included)
    eplb_rebalance_layers_ratio{basis}            share of the layers the last planned rebalance
                                                  planned with earlier steady windows
                                                  (basis steady_windows) or on the window's
                                                  drift trend (basis drift_trend); a layer may
                                                  be in both
    eplb_rebalance_move_tolerance                 the move tolerance the last planned rebalance
                                                  used (0 after a load shift or on a drift)
    eplb_expert_replicas{layer,expert}            opt-in (per_expert_replicas=True): L x N series
    eplb_load_window_fill_ratio                   steps in the planner's window / window size
    eplb_placement_age_seconds                    seconds since the placement last changed
    eplb_steps_total                              runtime.steps
    eplb_info{version,policy,num_gpus,num_nodes,num_slots,num_layers}   always 1

A label or key that carries an EplbConfig setting is named as its field (`policy`,
`num_nodes` in eplb_info; `window_size`, `load_decay` in GET /load); docs/operations.md
("Settings") lists them and tests/test_config.py checks that table.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from eplb.core.placement import balancedness_of_gpu_loads

if TYPE_CHECKING:
    from eplb.runtime import EplbRuntime, RebalanceEvent

log = logging.getLogger("eplb.ops.metrics")

TRIGGERS = ("interval", "request", "api", "initial", "shift", "resize")
OUTCOMES = ("success", "failure", "skipped")
PHASES = ("plan", "transfer", "commit", "total")
WHEN = ("before", "after")
BASES = ("steady_windows", "drift_trend")  # what a plan adds to its window (eplb_rebalance_layers_ratio)
# rebalances take from about a millisecond (small CPU jobs) to minutes (large models)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0, float("inf"))


class EplbMetrics:
    """Prometheus metrics of one runtime; see the module docstring for names and design.

    `registry`: where the metrics live; None makes a private `CollectorRegistry` (so several
    runtimes or tests never collide); pass `prometheus_client.REGISTRY` to expose them next
    to your own metrics. `interval`: steps between load updates (and all-reduces), the same
    on every rank. `per_expert_replicas`: also export `eplb_expert_replicas` (L x N series).
    `per_layer_gpu_load`: also export `eplb_gpu_layer_load_tokens{layer,gpu}` (L x M series,
    e.g. 61 x 256 = 15,616; set at scrape time, no cost on the step loop). `export_load`:
    keep the snapshot of the recorded load that `GET /load` serves (`load_snapshot()`);
    the same on every rank. `track_failures`: count failed rebalances (see `track()`).
    """

    def __init__(self, runtime: "EplbRuntime", registry: CollectorRegistry | None = None,
                 interval: int = 10, per_expert_replicas: bool = False, track_failures: bool = True,
                 per_layer_gpu_load: bool = False, export_load: bool = True):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1 (steps), got {interval!r}")
        self.runtime = runtime
        self.registry = CollectorRegistry() if registry is None else registry
        self.interval = interval
        self.per_expert_replicas = per_expert_replicas
        self.per_layer_gpu_load = bool(per_layer_gpu_load)
        self.export_load = bool(export_load)
        placement = runtime.placement
        L, M = placement.num_layers, runtime.world_size
        N = placement.num_logical_experts
        r = self.registry

        self.balancedness = Gauge(
            "eplb_balancedness_ratio", "Mean over max GPU load of a layer over the last "
            "metrics interval (1 = perfectly balanced).", ["layer"], registry=r)
        self.gpu_load = Gauge(
            "eplb_gpu_load_tokens", "Token-expert assignments routed to a GPU per step (summed "
            "over layers), averaged over the last metrics interval.", ["gpu"], registry=r)
        self.rebalances = Counter(
            "eplb_rebalances_total", "Rebalances by trigger (interval, request, api, initial, shift, "
            "resize) and outcome (success, failure, skipped).", ["trigger", "outcome"], registry=r)
        self.duration = Histogram(
            "eplb_rebalance_duration_seconds", "Duration of rebalances by phase (plan, transfer, "
            "commit, total): a successful one observes every phase, a skipped one plan only.",
            ["phase"], buckets=DURATION_BUCKETS, registry=r)
        self.experts_moved = Counter(
            "eplb_experts_moved_total", "Expert copies received from another rank, all ranks "
            "together.", registry=r)
        self.bytes_moved = Counter(
            "eplb_bytes_moved_total", "Expert weight bytes sent between ranks, all ranks "
            "together.", registry=r)
        self.rebalance_balancedness = Gauge(
            "eplb_rebalance_balancedness_ratio", "Balancedness of the last rebalance's window: "
            "measured before, predicted after (mean over layers).", ["when"], registry=r)
        self.plan_layers = Gauge(
            "eplb_rebalance_layers_ratio", "Share of the layers the last planned rebalance planned "
            "with earlier steady windows (steady_windows) or on the window's drift trend (drift_trend).",
            ["basis"], registry=r)
        self.move_tolerance = Gauge(
            "eplb_rebalance_move_tolerance", "Move tolerance the last planned rebalance used (the "
            "config's, or 0 after a load shift or on a drifting load).", registry=r)
        self.replicas = Gauge(
            "eplb_expert_replicas", "Physical replicas of a logical expert.",
            ["layer", "expert"], registry=r) if per_expert_replicas else None
        self.info = Info("eplb", "EPLB runtime configuration.", registry=r)
        self.info.info(self._info_labels())
        r.register(_ScrapeTimeCollector(self))
        for trigger in TRIGGERS:  # counters exist at 0, so rate() and alerts work from the start
            for outcome in OUTCOMES:
                self.rebalances.labels(trigger, outcome)
        for phase in PHASES:
            self.duration.labels(phase)

        # load accumulation: this rank's per-GPU counts since the last update, on the device
        self._acc = torch.zeros(L, M, dtype=torch.int64, device=runtime.device)  # [L, M]
        self._acc_steps = 0
        # export_load: this rank's logical counts since the last update (never restarted:
        # logical counts do not depend on the placement), on the device
        self._acc_logical = torch.zeros(L, N, dtype=torch.int64, device=runtime.device) \
            if self.export_load else None  # [L, N]
        self._logical_steps = 0
        # rank 0, host: logical counts of every step since attaching, and the /load snapshot
        self._total_logical = np.zeros((L, N), dtype=np.int64)  # [L, N]
        self._total_steps = 0
        self._snapshot: dict | None = None  # replaced whole, never mutated: safe to read from any thread
        self._overall: float | None = None  # exported once the first interval is measured
        self._layer_gpu: np.ndarray | None = None  # [L, M] per step, last interval (opt-in metric)
        self._placement_changed_at = time.monotonic()
        self._tracked = False
        self._set_replicas(placement)
        for event in runtime.events:  # rebalances before attaching (e.g. trigger "initial")
            self._record_event(event)
        runtime.add_listener(self._on_event)
        runtime.add_step_hook(self._on_step)
        if track_failures:
            self.track()

    # ---- what the runtime calls --------------------------------------------------
    def _on_step(self, runtime: "EplbRuntime") -> None:
        self._acc.add_(runtime.recorder.last_gpu_load())  # device op, no host sync
        self._acc_steps += 1
        if self._acc_logical is not None:
            rec = runtime.recorder  # this step's logical counts [L, N]: the newest ring entry
            self._acc_logical.add_(rec.logical_ring[(rec.steps_recorded - 1) % rec.window_size])
            self._logical_steps += 1
        if runtime.steps % self.interval == 0:
            self.update()

    def update(self) -> None:
        """All-reduce the accumulated load (and, with `export_load`, this rank's part of the
        planner's window) in one buffer; on rank 0 set the load gauges and keep the /load
        snapshot. Collective: called by the step hook on every rank at the same steps."""
        n, n_logical = self._acc_steps, self._logical_steps
        if n == 0 and n_logical == 0:  # identical on every rank: all skip together
            return
        rt = self.runtime
        decay = rt.config.load_decay
        parts = [self._acc]  # [L, M]
        if self._acc_logical is not None:
            logical, gpu = rt.recorder.local_window(decay)  # [L, N], [L, M]
            parts += [self._acc_logical, logical, gpu]
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.int64
        buf = torch.cat([p.to(dtype) for p in parts], dim=1) if len(parts) > 1 else self._acc
        if rt.world_size > 1 and dist.is_initialized():
            dist.all_reduce(buf, group=rt.group)
        if rt.rank == 0:
            host = buf.cpu().numpy()  # [L, 2M + 2N] (or [L, M]): the one host sync, rank 0 only
            M = self._acc.shape[1]
            try:
                if n:
                    self._set_load(_exact_int(host[:, :M]), n)
                if self._acc_logical is not None:
                    self._keep_snapshot(host[:, M:], n_logical, decay)
            except Exception:  # metrics must never break the training/serving loop
                log.exception("eplb metrics: could not update the load gauges")
        self._acc.zero_()
        self._acc_steps = 0
        if self._acc_logical is not None:
            self._acc_logical.zero_()
            self._logical_steps = 0

    def _set_load(self, gpu: np.ndarray, steps: int) -> None:  # gpu [L, M] summed over `steps`
        bal = balancedness_of_gpu_loads(gpu)  # [L]
        for layer, b in enumerate(bal):
            self.balancedness.labels(str(layer)).set(float(b))
        self._overall = float(bal.mean())
        per_step = gpu.sum(0) / steps  # [M]
        for g, tokens in enumerate(per_step):
            self.gpu_load.labels(str(g)).set(float(tokens))
        if self.per_layer_gpu_load:  # exported at scrape time (L x M series)
            self._layer_gpu = gpu / steps  # [L, M]

    def _keep_snapshot(self, host: np.ndarray, n_logical: int, decay: float) -> None:
        """Rank 0: fold the interval's logical counts into the totals and replace the /load
        snapshot. `host` [L, 2N + M]: interval logical, window logical, window per-GPU."""
        rt, rec = self.runtime, self.runtime.recorder
        N = self._total_logical.shape[1]
        self._total_logical += _exact_int(host[:, :N])
        self._total_steps += n_logical
        window = host[:, N:2 * N]  # [L, N] as the planner sees it (weighted when decay < 1)
        L, M = window.shape[0], rt.world_size
        self._snapshot = {  # scalars first, so that `curl .../load | head -c 300` reads well
            "step": rt.steps, "time": time.time(), "steps": rec.fill,
            "gpu_steps": min(rec.gpu_steps, rec.window_size), "window_size": rec.window_size,
            "load_decay": float(decay), "interval": self.interval, "layers": L, "experts": N,
            "gpus": M, "total_steps": self._total_steps,
            "logical_count": _exact_int(window) if decay == 1 else window.copy(),  # [L, N]
            "gpu_load": _exact_int(host[:, 2 * N:]),  # [L, M]
            "total_logical_count": self._total_logical.copy(),  # [L, N]
        }

    def load_snapshot(self) -> dict | None:
        """Rank 0: the recorded load as of the last metrics update (what `GET /load`
        serves), or None before the first update, on other ranks, or without `export_load`.
        Keys: `logical_count` [L, N] (the planner's window: summed over the last `steps`
        steps, weighted by `load_decay` when it is below 1), `gpu_load` [L, M] (per-GPU load
        of the window's last `gpu_steps` steps, those under the placement in force),
        `steps`, `gpu_steps`, `window_size`, `load_decay`, `step` (runtime step the snapshot
        was taken at), `time` (unix seconds), `layers`, `experts`, `gpus`, `interval`,
        `total_logical_count` [L, N] (plain counts of every step since the metrics were
        attached) and `total_steps`. Arrays are numpy; the dict is never mutated."""
        return self._snapshot

    def _on_event(self, event: "RebalanceEvent") -> None:
        skipped = bool(getattr(event, "skipped", False))
        try:
            self._record_event(event)
            if event.slots_changed and not skipped:
                self._placement_changed_at = time.monotonic()
        except Exception:
            log.exception("eplb metrics: could not record a rebalance")
        if skipped:  # nothing moved: the load counted so far describes the placement in force
            return
        # load counted so far was routed under the old placement: start over (every rank
        # receives the same events, so the accumulators stay in step)
        self._acc.zero_()
        self._acc_steps = 0

    def _record_event(self, event: "RebalanceEvent") -> None:
        # skipped: the planner's predicted gain was below the config's min_gain, so no
        # weights moved; it has a plan phase but no transfer or commit (nor a total)
        skipped = bool(getattr(event, "skipped", False))
        self.rebalances.labels(event.trigger, "skipped" if skipped else "success").inc()
        phases = (("plan", event.seconds_plan),) if skipped else (
            ("plan", event.seconds_plan), ("transfer", event.seconds_transfer),
            ("commit", event.seconds_commit), ("total", event.seconds))
        for phase, seconds in phases:
            self.duration.labels(phase).observe(max(0.0, float(seconds)))
        if not skipped:
            self.experts_moved.inc(max(0, int(event.experts_moved)))
            self.bytes_moved.inc(max(0, int(event.bytes_moved)))
        self.rebalance_balancedness.labels("before").set(float(np.mean(event.balancedness_before)))
        self.rebalance_balancedness.labels("after").set(float(np.mean(event.balancedness_after)))
        if event.move_tolerance is not None:  # planned (not a given placement): how
            layers = max(1, len(event.balancedness_after))
            for basis, k in zip(BASES, (event.steady_layers, event.trend_layers)):
                self.plan_layers.labels(basis).set(k / layers)
            self.move_tolerance.set(float(event.move_tolerance))
        self._set_replicas(event.placement)

    def _set_replicas(self, placement) -> None:
        if self.replicas is None:
            return
        counts = placement.replica_count()  # [L, N]
        for layer, row in enumerate(counts):
            for expert, c in enumerate(row):
                self.replicas.labels(str(layer), str(expert)).set(int(c))

    def _info_labels(self) -> dict:
        from eplb import __version__

        rt, p = self.runtime, self.runtime.placement
        return {"version": __version__, "policy": str(rt.config.policy),
                "num_gpus": str(rt.world_size), "num_nodes": str(rt.config.num_nodes),
                "num_slots": str(p.num_slots), "num_layers": str(p.num_layers)}

    # ---- failures ------------------------------------------------------------------
    def track(self) -> None:
        """Count failed rebalances (synchronous or asynchronous, any trigger) as
        outcome="failure", through `runtime.add_failure_listener`. Idempotent; installed
        by the constructor by default."""
        if self._tracked:
            return
        self.runtime.add_failure_listener(self._on_failure)
        self._tracked = True

    def _on_failure(self, trigger: str, error: BaseException) -> None:
        self.rebalances.labels(str(trigger), "failure").inc()

    # ---- read back (tests, the demo) -----------------------------------------------
    def value(self, name: str, **labels: str) -> float | None:
        """Current value of one sample by its exposed name, e.g.
        `value("eplb_rebalances_total", trigger="request", outcome="success")`."""
        return self.registry.get_sample_value(name, labels or None)


class _ScrapeTimeCollector:
    """Values read when Prometheus scrapes: steps, window fill, placement age, and the
    overall balancedness (absent until the first interval is measured, rather than 0)."""

    def __init__(self, metrics: EplbMetrics):
        self.m = metrics

    def describe(self):
        out = [CounterMetricFamily("eplb_steps", "Runtime steps (forward passes) so far."),
               GaugeMetricFamily("eplb_load_window_fill_ratio", ""),
               GaugeMetricFamily("eplb_placement_age_seconds", ""),
               GaugeMetricFamily("eplb_balancedness_overall_ratio", "")]
        if self.m.per_layer_gpu_load:
            out.append(GaugeMetricFamily("eplb_gpu_layer_load_tokens", "", labels=["layer", "gpu"]))
        return out

    def collect(self):
        rt = self.m.runtime
        rec = rt.recorder
        yield CounterMetricFamily("eplb_steps", "Runtime steps (forward passes) so far.",
                                  value=rt.steps)
        yield GaugeMetricFamily("eplb_load_window_fill_ratio", "Steps in the planner's load "
                                "window divided by its size (1 = full).",
                                value=rec.fill / max(1, rec.window_size))
        yield GaugeMetricFamily("eplb_placement_age_seconds", "Seconds since the expert "
                                "placement last changed (or since metrics were attached).",
                                value=time.monotonic() - self.m._placement_changed_at)
        overall = self.m._overall
        if overall is not None:
            yield GaugeMetricFamily("eplb_balancedness_overall_ratio", "eplb_balancedness_ratio "
                                    "averaged over layers.", value=overall)
        per_layer = self.m._layer_gpu  # [L, M] per step, one read (replaced whole at updates)
        if self.m.per_layer_gpu_load and per_layer is not None:
            fam = GaugeMetricFamily("eplb_gpu_layer_load_tokens", "Token-expert assignments "
                                    "routed to a GPU in one MoE layer per step, averaged over the "
                                    "last metrics interval (opt-in: L x M series).",
                                    labels=["layer", "gpu"])
            for layer, row in enumerate(per_layer.tolist()):
                for g, tokens in enumerate(row):
                    fam.add_metric([str(layer), str(g)], tokens)
            yield fam




def _exact_int(a: np.ndarray) -> np.ndarray:
    """Counts summed in int64, or in float64 (exact below 2**53), as int64."""
    return a.astype(np.int64) if a.dtype != np.float64 else np.rint(a).astype(np.int64)
