"""Expert work timed on a real GPU: an `eplb.core.cost_model.ExpertCost` for `eplb.core.scale`
(`eplb simulate --cost gpu`).

One virtual GPU's expert work is the grouped GEMM of its local slots with their token
counts, run by the reference model's kernel (`moe.experts.GroupedExperts`, bf16,
`torch._grouped_mm`) and timed with CUDA events over back-to-back runs, captured in a CUDA
graph when a run is short (`GpuGemmCost._time_graph`). Timing every GPU of every step, layer
and placement at EP 256 would take hours, so:

1. an estimate ranks the GPUs of a layer: at first the sum over its slots of single-slot
   times measured on a log grid of token counts (an upper bound: a grouped GEMM runs its
   groups side by side), then, once 200 GEMMs ran, a least-squares fit of the measured
   times on `features` (launch, slots with tokens, tokens, 64- and 128-row tiles), refit
   whenever the measurements double;
2. per layer, the GPUs whose estimate is within `margin` of the largest (at most
   `max_measured` of them) are run for real; the layer's slowest time is the largest of
   these measured times. The other GPUs keep their estimates (they only enter the
   GPU-idle fraction), scaled by the layer's measured / estimated ratio.

Identical work (the same sorted token counts, rounded up to `bucket` tokens) is measured
once and cached. With `audit_every` k, every k-th layer also has all its GPUs measured, to
check that the picked GPUs held the slowest one (`stats()["audit_min_ratio"]`). `stats()` says how many GEMMs ran, how many the cache served, and how far
the estimates were from the measured times. On a CPU device (tests) the reference
model's CPU path runs instead (`moe.experts.swiglu` per slot), timed with perf_counter.

Comparing placements: a replay times one placement kind's GEMMs after another's, minutes
apart, and a GPU's speed drifts over minutes by about as much as two good placements
differ. `retime` times the GEMMs a replay used again, in shuffled rounds, so that every
kind's GEMMs are timed side by side; `freeze` first, so that the replay run again picks the
same GPUs, and `use_round` to score each round on its own (the spread of the rounds' ratios
is the noise left).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from eplb.core.cost_model import ModelShape
from moe.experts import swiglu


FIT_MIN = 200  # measured GEMMs before the estimate switches to the fitted model
GRAPH_SECONDS = 0.003  # how long one timed CUDA graph replay should last (see _time_graph)
MAX_INNER = 20  # the most runs one graph holds


FEATURES = ("launch", "slots_with_tokens", "tokens", "tiles64", "tiles128")  # the columns of `features`


def features(c: np.ndarray) -> np.ndarray:  # [..., S] token counts -> [..., 5]
    """What a grouped GEMM's time depends on: a launch, the slots with tokens (weight
    reads), the tokens (FLOPs), and the 64- and 128-row tiles the kernel pads each group to."""
    nz = c > 0
    return np.stack([np.ones(c.shape[:-1]), nz.sum(-1), c.sum(-1), np.ceil(c / 64).sum(-1),
                     np.ceil(c / 128).sum(-1)], axis=-1)


def inner_runs(t: float) -> int:
    """Runs of a GEMM of `t` seconds in one timed CUDA graph: as many as fill GRAPH_SECONDS,
    1 to MAX_INNER (1: it is timed without a graph, `GpuGemmCost._time_graph`)."""
    return int(min(MAX_INNER, max(1, round(GRAPH_SECONDS / max(t, 1e-7)))))


def timing_runs(t: float, reps: int) -> int:
    """Runs of a GEMM of `t` seconds that `GpuGemmCost._time_graph` launches: a warm-up and
    `reps` queued runs, then, up to GRAPH_SECONDS / 1.5 (2 ms), a graph of `inner_runs(t)`
    runs replayed once to warm up and `reps` times (capturing a graph runs nothing). Device
    time of a timing: t x timing_runs(t, reps) (`diag/issue29_row_time.py` forecasts rows
    with it)."""
    inner = inner_runs(t)
    return 1 + reps + (0 if inner == 1 else inner * (1 + reps))


def fitted_seconds(counts: np.ndarray, coef: np.ndarray) -> np.ndarray:  # [..., S], [5] -> [...]
    """The fitted estimate: `features(counts) @ coef` seconds, 0 where no slot has tokens
    (`GpuGemmCost.estimate` once fitted; offline, from a run's `stats()["fit"]`)."""
    c = np.asarray(counts, dtype=np.float64)
    return np.where(c.sum(-1) > 0, features(c) @ np.asarray(coef, dtype=np.float64), 0.0)


class GpuGemmCost:
    """`cost(shape, counts [L, M, S]) -> [L, M]` seconds, measured on `device`."""

    def __init__(self, shape: ModelShape, max_slots: int, max_tokens: int, device: str = "cuda",
                 bucket: int = 8, margin: float = 0.05, max_measured: int = 4, reps: int = 3,
                 audit_every: int = 0, seed: int = 0) -> None:
        from moe.experts import GroupedExperts  # the reference model's expert weights

        if str(device).startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError("--cost gpu needs a CUDA GPU (torch.cuda.is_available() is False); "
                                   "use --cost analytic on a machine without one")
            if not hasattr(torch, "_grouped_mm"):
                raise RuntimeError(f"--cost gpu needs torch._grouped_mm (torch {torch.__version__} "
                                   "lacks it)")
        self.shape, self.device = shape, torch.device(device)
        self.bucket, self.margin, self.max_measured, self.reps = bucket, margin, max_measured, reps
        self.experts = GroupedExperts(max_slots, shape.hidden, shape.intermediate, dtype=torch.bfloat16,
                                      device=self.device)
        self._fill_weights(seed)
        self.max_tokens = max_tokens  # the calibration grid's top
        self.x = self._tokens(max_tokens)  # [T', H]
        self.cache: dict[tuple[int, ...], float] = {}
        self.runs = self.hits = 0
        self.errors: list[float] = []  # estimate / measured - 1, per measured GPU
        self.audit_every, self.layers_seen = audit_every, 0
        self.audits: list[float] = []  # picked slowest / true slowest, per audited layer
        self._rows: list[np.ndarray] = []  # features of every measured GEMM
        self._times: list[float] = []
        self.coef: np.ndarray | None = None  # the fitted estimate, once FIT_MIN GEMMs ran
        self._fitted_on = 0
        self.frozen = False  # no refits (`freeze`)
        self.touched: set[tuple[int, ...]] | None = None  # keys asked for since `track()`
        self.rounds: dict[tuple[int, ...], list[float]] = {}  # key -> its times, one per `retime` round
        self.grid, self.single = self._calibrate()

    def _fill_weights(self, seed: int) -> None:
        """Small random expert weights N(0, 0.02^2) (a GEMM's time does not depend on the
        values). On CUDA they are drawn on the device: DeepSeek-V3's 34 slots are 1.5 G
        weights, seconds of drawing on a CPU for every cost object (every `--cost gpu` row)."""
        with torch.no_grad():
            if self.device.type == "cuda":
                g = torch.Generator(device=self.device).manual_seed(seed)
                for w in (self.experts.w13, self.experts.w2):
                    w.normal_(0.0, 0.02, generator=g)
                return
            g = torch.Generator(device="cpu").manual_seed(seed)
            for w in (self.experts.w13, self.experts.w2):
                w.copy_((torch.randn(w.shape, generator=g) * 0.02).to(w.dtype))

    def _tokens(self, n: int) -> torch.Tensor:  # [n, H] bf16 activations
        """Activations N(0, 0.1^2), seeded by n. On CUDA they are drawn on the device: drawn on
        the CPU, DeepSeek-V3's 131,072-row prefill buffer took 16 s (2-core VM), and the buffer
        doubles each time a hotter GPU needs more rows (benchmarks/README.md, 2026-12-05)."""
        if self.device.type == "cuda":
            g = torch.Generator(device=self.device).manual_seed(n)
            x = torch.empty(n, self.shape.hidden, dtype=torch.bfloat16, device=self.device)  # [n, H]
            return x.normal_(0.0, 0.1, generator=g)
        g = torch.Generator(device="cpu").manual_seed(n)
        return (torch.randn(n, self.shape.hidden, generator=g) * 0.1).to(torch.bfloat16).to(self.device)

    # ---- one measurement ------------------------------------------------------------
    def measure(self, counts) -> float:
        """Seconds of the grouped GEMM over slots with these token counts (cached)."""
        c = np.asarray(counts, dtype=np.int64)
        c = c[c > 0]
        if c.size == 0:
            return 0.0
        key = tuple(sorted((-(-c // self.bucket) * self.bucket).tolist(), reverse=True))
        if self.touched is not None:
            self.touched.add(key)
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        if len(key) > self.experts.num_slots:
            raise ValueError(f"work of {len(key)} slots exceeds the {self.experts.num_slots} slots "
                             "this cost model holds")
        if sum(key) > self.x.shape[0]:  # a hotter GPU than the buffer was sized for
            rows = max(sum(key), 2 * self.x.shape[0])
            self.x = None  # free the old buffer first: at prefill sizes it is gigabytes
            self.x = self._tokens(rows)
        self.cache[key] = t = self._time_explained(key)
        self.runs += 1
        self._rows.append(features(np.asarray(key, dtype=np.float64)))
        self._times.append(t)
        if not self.frozen and len(self._times) >= FIT_MIN and len(self._times) >= 2 * self._fitted_on:
            self._fit()
        return t

    def gemm(self, key: tuple[int, ...]):
        """The work of one virtual GPU holding slots with token counts `key`, as a function
        of no arguments that returns the output rows [sum(key), H]: on CUDA the reference model's grouped GEMM
        (`GroupedExperts.forward_grouped_mm`) over the first len(key) slots, elsewhere its
        CPU path (`forward_loop`: `swiglu` per slot). What `_time` times; the benchmarks and
        the CUDA test call it to time the same work their own way."""
        S = len(key)
        w13, w2 = self.experts.w13[:S], self.experts.w2[:S]  # the first S slots' weights, no copy
        x = self.x[:int(sum(key))]  # [sum(key), H]
        if self.device.type != "cuda":
            out = torch.empty_like(x)  # [sum(key), H]

            def run_loop() -> torch.Tensor:
                start = 0
                for s, n in enumerate(key):
                    out[start:start + n] = swiglu(x[start:start + n], w13[s], w2[s])
                    start += n
                return out
            return run_loop
        offs = torch.tensor(key, dtype=torch.int64, device=self.device).cumsum(0).to(torch.int32)

        def run() -> torch.Tensor:
            gate_up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            gate, up = gate_up.chunk(2, dim=-1)
            return torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
        return run

    def _time_explained(self, key: tuple[int, ...], reps: int | None = None) -> float:
        """`_time(key, reps)`, with a CUDA out-of-memory error that says what was timed and
        what helps. A prefill GEMM of the hottest GPU at EP 256 needs tens of GiB of
        activations; on an 80 GiB H100 one failed with 13 GiB held by the allocator in
        fragmented blocks, and ran with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
        (benchmarks/README.md, issue 29, 2026-12-06 (tenth))."""
        try:
            return self._time(key, reps)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(
                f"timing the grouped GEMM of {len(key)} slots with {sum(key)} tokens on {self.device} "
                "ran out of GPU memory; start the process with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation), or use a GPU "
                f"with more memory. {e}") from e

    def _time(self, key: tuple[int, ...], reps: int | None = None) -> float:
        """Seconds of `gemm(key)`: over a CUDA graph on CUDA (`_time_graph`), else the
        median of `reps` (default `self.reps`) perf_counter timings after a warm-up."""
        reps = self.reps if reps is None else reps
        run = self.gemm(key)
        if self.device.type == "cuda":
            return self._time_graph(run, reps)
        run()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def _time_graph(self, run, reps: int) -> float:
        """Seconds of one `run()` on CUDA. First a warm-up and `reps` runs queued back to back
        between CUDA events (the warm-up keeps the GPU busy, so no launch gap enters the
        first timing). A run over `GRAPH_SECONDS / 1.5` (`inner_runs` 1: prefill-sized
        GEMMs) is timed by these: the median of the `reps`; its kernels queue ahead of the
        GPU, so launches leave no gaps there. A shorter run is timed over a CUDA graph of
        `inner` back-to-back runs (as many as fill GRAPH_SECONDS, at most MAX_INNER): the
        median over `reps` replays, divided by `inner`. Timed one launch at a time (median of
        3), a decode GEMM's time varied by about 1.5% from one measurement to the next on an
        H200 (launch gaps, timer jitter), enough to swing a placement comparison by 1%; over
        the graph by about 0.25% (benchmarks/gpu_timing_noise.py; benchmarks/README.md,
        2026-12-03 (fifth)). A model served with CUDA graphs has no launch gaps either. The
        runs a timing costs: `timing_runs`."""
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # warm-up off the default stream, as a capture wants
            run()
        stream.wait_stream(side)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
        marks[0].record()
        for mark in marks[1:]:
            run()
            mark.record()
        marks[-1].synchronize()
        queued = [a.elapsed_time(b) * 1e-3 for a, b in zip(marks, marks[1:])]  # [reps] seconds
        inner = inner_runs(queued[0])
        if inner == 1:
            return float(np.median(queued))
        start, end = marks[0], marks[1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                run()
        graph.replay()  # warm-up
        times = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / inner)
        del graph
        return float(np.median(times))

    # ---- side-by-side re-timing (see the module docstring) ------------------------------
    def freeze(self, frozen: bool = True) -> None:
        """Stop refitting the estimate (or start again): the GPUs a layer measures then depend
        on its counts alone, so a replay run twice asks for the same GEMMs."""
        self.frozen = frozen

    def track(self) -> None:
        """Start recording the keys `measure` is asked for (into `touched`)."""
        self.touched = set()

    def retime(self, keys, rounds: int, reps: int = 1, seed: int = 0,
               progress: Callable[[], None] | None = None) -> None:
        """Time the measured GEMMs `keys` again `rounds` times, each round over all of them in
        a new random order (`reps` timings each), and serve from then on the median of a
        key's rounds. `progress()` is called after each timing."""
        keys = sorted(keys)
        if missing := [k for k in keys if k not in self.cache]:
            raise ValueError(f"retime: {len(missing)} of the keys were never measured, e.g. {missing[0]}")
        rounds = int(rounds)
        if rounds < 1:
            raise ValueError(f"retime needs at least one round, got {rounds}")
        rng = np.random.default_rng(seed)
        times: dict[tuple[int, ...], list[float]] = {k: [] for k in keys}
        for _ in range(rounds):
            for i in rng.permutation(len(keys)):
                times[keys[i]].append(self._time_explained(keys[i], reps))
                if progress:
                    progress()
        self.rounds = times
        self.use_round(None)

    def use_round(self, r: int | None) -> None:
        """Serve the re-timed keys' times of round `r`, or (None) the median of their rounds."""
        for k, ts in self.rounds.items():
            self.cache[k] = float(np.median(ts)) if r is None else ts[r]

    def measured(self) -> list[tuple[list[int], float]]:
        """Every GEMM measured so far: (its sorted, bucketed token counts, seconds)."""
        return [(list(k), t) for k, t in self.cache.items()]

    # ---- estimates ------------------------------------------------------------------
    def _calibrate(self) -> tuple[np.ndarray, np.ndarray]:
        hi = max(2, self.max_tokens)
        grid = np.unique(np.round(np.geomspace(1, hi, 48)).astype(np.int64))  # [G]
        grid = np.unique(-(-grid // self.bucket) * self.bucket)
        single = np.array([self.measure([n]) for n in grid])  # [G] seconds
        return grid, single

    def estimate(self, counts: np.ndarray) -> np.ndarray:  # [..., S] -> [...]
        """Predicted seconds per GPU: the fitted model once enough GEMMs ran, else the sum
        of single-slot times."""
        if self.coef is not None:
            return fitted_seconds(counts, self.coef)
        c = np.asarray(counts, dtype=np.float64)
        t = np.interp(c, self.grid, self.single, left=self.single[0])  # [..., S]
        return np.where(c > 0, t, 0.0).sum(-1)

    def _fit(self) -> None:
        """Least squares of the measured times on `features` (relative error: rows / time)."""
        X, y = np.asarray(self._rows), np.asarray(self._times)  # [K, F], [K]
        coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
        self.coef, self._fitted_on = coef, len(y)

    def __call__(self, shape: ModelShape, counts: np.ndarray) -> np.ndarray:  # [L, M, S] -> [L, M]
        if shape != self.shape:
            raise ValueError(f"this GpuGemmCost was built for {self.shape.name}, not {shape.name}")
        counts = np.asarray(counts)
        est = self.estimate(counts)  # [L, M]
        out = est.copy()
        for layer in range(counts.shape[0]):
            e = est[layer]
            if e.max() <= 0:
                continue
            order = np.argsort(-e, kind="stable")
            pick = [g for g in order[:self.max_measured] if e[g] >= (1 - self.margin) * e.max()]
            measured = np.array([self.measure(counts[layer, g]) for g in pick])
            self.errors.extend((e[pick] / measured - 1).tolist())
            ratio = measured.sum() / e[pick].sum()
            out[layer] = e * ratio
            out[layer, pick] = measured
            self.layers_seen += 1
            if self.audit_every and self.layers_seen % self.audit_every == 0:  # measure every GPU
                true = max(self.measure(counts[layer, g]) for g in range(counts.shape[1]))
                self.audits.append(float(measured.max() / true))
        return out

    def stats(self) -> dict:
        err = np.abs(np.asarray(self.errors)) if self.errors else np.zeros(1)
        audits = np.asarray(self.audits) if self.audits else np.ones(1)
        q = np.percentile(audits, [5, 50])
        return {"gemms_run": self.runs, "cache_hits": self.hits, "calibration_points": len(self.grid),
                "estimate_error_median": float(np.median(err)), "estimate_error_max": float(err.max()),
                # layers where every GPU was measured: the picked slowest time over the true one
                "audited_layers": len(self.audits), "audit_min_ratio": float(audits.min()),
                "audit_p5_ratio": float(q[0]), "audit_median_ratio": float(q[1]),
                "audit_exact_fraction": float(np.mean(audits >= 1 - 1e-12)),
                # the fitted estimate: seconds per feature (None before FIT_MIN GEMMs ran)
                "fit": None if self.coef is None else dict(zip(FEATURES, self.coef.tolist())),
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}
