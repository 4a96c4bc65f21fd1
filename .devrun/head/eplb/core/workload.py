"""Routing workloads for the demo and benchmarks: which experts are popular at each step.

A workload gives `popularity(step) -> [L, N]` (each row sums to 1). The demo turns it
into a router selection bias (`log p`), so tokens pick hot experts more often, the way
real traffic does. Pure numpy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eplb.core.loadio import MAX_LOAD_ELEMENTS

DATA_DIR = Path(__file__).parent.parent / "data"
TRACES = {"esft": DATA_DIR / "esft_dsv2lite_alltasks_per_seq.npz"}


class SkewedDriftWorkload:
    """Zipf-skewed expert popularity whose hot set drifts: every `period` steps the
    ranking of experts blends smoothly into a new random ranking (a domain shift)."""

    def __init__(self, num_layers: int, num_experts: int, zipf_s: float = 1.2,
                 period: int = 100, seed: int = 0):
        self.L, self.N = num_layers, num_experts
        self.period, self.seed = max(1, period), seed
        ranks = np.arange(1, num_experts + 1, dtype=np.float64)
        self.zipf = ranks ** -zipf_s / (ranks ** -zipf_s).sum()  # [N] by popularity rank

    def _ranking(self, phase: int) -> np.ndarray:  # [L, N] popularity rank of each expert
        rng = np.random.default_rng((self.seed, phase))
        return np.argsort(rng.random((self.L, self.N)), axis=1)

    def popularity(self, step: int) -> np.ndarray:  # [L, N]
        phase, frac = divmod(step, self.period)
        w = frac / self.period
        w = w * w * (3 - 2 * w)  # smoothstep: gentle drift, then a new regime
        a = self.zipf[self._ranking(phase)]  # [L, N]
        b = self.zipf[self._ranking(phase + 1)]  # [L, N]
        return (1 - w) * a + w * b


def cosine_drift(a: np.ndarray, b: np.ndarray, steps: int) -> np.ndarray:
    """Shares [T, L, N] that move from profile `a` to profile `b` (each [L, N], > 0, any
    scale: each is normalised per layer) along half a cosine over `steps` steps: a smooth
    drift with no jump (the `drift` family of benchmarks/issue29.py and of the shift tests)."""
    x = (1 - np.cos(np.pi * np.arange(steps) / steps)) / 2  # [T] 0 -> 1
    a = a / a.sum(-1, keepdims=True)
    b = b / b.sum(-1, keepdims=True)
    return (1 - x)[:, None, None] * a + x[:, None, None] * b


class TraceWorkload:
    """Replays a measured `[T, L, N]` trace of expert counts: step t uses the sum of
    `window` consecutive entries starting at t (wrapping); model layer l uses trace
    layer l % L_trace."""

    def __init__(self, trace: np.ndarray, num_layers: int, num_experts: int, window: int = 1):
        trace = check_trace(trace)  # [T, L, N] float64
        if trace.shape[2] != num_experts:
            raise ValueError(f"trace has {trace.shape[2]} experts but the model has {num_experts}; "
                             f"run with --experts {trace.shape[2]}")
        self.trace, self.L, self.window = trace, num_layers, max(1, window)

    def popularity(self, step: int) -> np.ndarray:  # [L, N]
        T, Lt, _ = self.trace.shape
        idx = (step + np.arange(self.window)) % T
        counts = self.trace[idx].sum(0)[np.arange(self.L) % Lt] + 1e-3  # [L, N]
        return counts / counts.sum(1, keepdims=True)


def load_trace(name_or_path: str) -> np.ndarray:  # -> [T, L, N] float64
    """A packaged trace by name (`esft`) or a `.npy` / `.npz` file holding `[T, L, N]`
    (in an `.npz`: the array `counts`, else its only array), checked by `check_trace`.
    Used by the demo's replay and by `eplb simulate`."""
    path = TRACES.get(name_or_path, Path(name_or_path))
    if not path.is_file():
        raise ValueError(f"trace not found: {name_or_path} (packaged: {', '.join(TRACES)})")
    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)  # .npy: mapped, not read yet
        if hasattr(data, "files"):  # .npz
            with data:
                if not data.files:
                    raise ValueError("the .npz holds no array")
                if "counts" in data.files:
                    arr = data["counts"]
                elif len(data.files) == 1:
                    arr = data[data.files[0]]
                else:
                    raise ValueError(f"the .npz holds {data.files}, none named 'counts'")
        else:
            if data.size > MAX_LOAD_ELEMENTS:
                raise ValueError(f"shape {tuple(data.shape)} is too large (limit {MAX_LOAD_ELEMENTS} "
                                 f"elements)")
            arr = np.array(data)
    except Exception as e:  # truncated, pickled, not numpy at all: many exception types
        msg = " ".join(str(e).split())
        raise ValueError(f"{path}: not a readable .npy/.npz trace ({msg})") from None
    try:
        return check_trace(arr)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def check_trace(trace: Any) -> np.ndarray:  # -> [T, L, N] float64
    """A non-empty, finite, non-negative numeric `[T, L, N]` array as float64, else ValueError."""
    arr = np.asarray(trace)
    numeric = np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    if arr.dtype == bool or not numeric:
        raise ValueError(f"trace must hold numbers, got dtype {arr.dtype}")
    if arr.ndim != 3:
        raise ValueError(f"trace must be [T, L, N] (steps, layers, experts), got shape {arr.shape}")
    if 0 in arr.shape:
        raise ValueError(f"trace is empty: shape {arr.shape}")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise ValueError("trace contains NaN or inf")
    if (arr < 0).any():
        raise ValueError(f"trace contains negative counts (min {arr.min():g})")
    return arr



def routing_bias(popularity: np.ndarray, strength: float = 1.0) -> np.ndarray:  # [L, N]
    """Selection bias that makes top-k routing favour popular experts: strength * log p."""
    return strength * np.log(np.maximum(popularity, 1e-9))
