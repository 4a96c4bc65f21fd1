"""Demo workloads: the synthetic drifting Zipf load, trace replay, trace loading errors."""
from __future__ import annotations

import re

import math

import numpy as np
import pytest

from eplb.core.workload import TRACES, SkewedDriftWorkload, TraceWorkload, cosine_drift, load_trace, routing_bias


def hot_set(pop: np.ndarray, k: int) -> list[set[int]]:  # per layer: the k most popular experts
    return [set(np.argsort(-row, kind="stable")[:k].tolist()) for row in pop]


# ---- SkewedDriftWorkload ---------------------------------------------------------------

def test_skewed_rows_are_distributions():
    w = SkewedDriftWorkload(num_layers=3, num_experts=16, zipf_s=1.2, period=10, seed=1)
    for step in (0, 1, 5, 9, 10, 17, 123):
        pop = w.popularity(step)
        assert pop.shape == (3, 16)
        assert (pop > 0).all()
        np.testing.assert_allclose(pop.sum(1), 1.0, rtol=0, atol=1e-12)


def test_skewed_is_zipf_at_regime_starts():
    N, s = 16, 1.2
    w = SkewedDriftWorkload(2, N, zipf_s=s, period=10, seed=0)
    ranks = np.arange(1, N + 1, dtype=np.float64)
    zipf = ranks ** -s / (ranks ** -s).sum()
    for step in (0, 10, 20):  # a pure regime: each layer is a permutation of the Zipf law
        pop = w.popularity(step)
        for row in pop:
            np.testing.assert_allclose(np.sort(row)[::-1], zipf, rtol=1e-12)
    assert w.popularity(0).max() / (1 / N) > 3  # skewed: the hottest expert is >3x the mean


def test_skewed_is_deterministic_per_seed():
    a = SkewedDriftWorkload(2, 16, period=10, seed=7)
    b = SkewedDriftWorkload(2, 16, period=10, seed=7)
    c = SkewedDriftWorkload(2, 16, period=10, seed=8)
    for step in (0, 4, 13):
        assert np.array_equal(a.popularity(step), b.popularity(step))
    assert not np.array_equal(a.popularity(0), c.popularity(0))
    # layers get different rankings too
    assert not np.array_equal(a.popularity(0)[0], a.popularity(0)[1])


def test_skewed_drifts_smoothly_to_a_new_hot_set():
    period = 20
    w = SkewedDriftWorkload(4, 32, period=period, seed=0)
    start, later = w.popularity(0), w.popularity(3 * period)
    assert np.abs(start - later).max() > 0.05
    assert hot_set(start, 4) != hot_set(later, 4)
    # the hot set of at least one layer changes between consecutive regimes
    assert any(a != b for a, b in zip(hot_set(w.popularity(0), 4), hot_set(w.popularity(period), 4)))
    # drift is gradual: neighbouring steps differ much less than regimes do
    step_change = max(np.abs(w.popularity(t + 1) - w.popularity(t)).max() for t in range(period))
    regime_change = np.abs(w.popularity(period) - w.popularity(0)).max()
    assert step_change < regime_change / 4
    # mid-regime the load is a blend of the two rankings, neither the old nor the new one
    mid = w.popularity(period // 2)
    assert not np.allclose(mid, w.popularity(0)) and not np.allclose(mid, w.popularity(period))


# ---- TraceWorkload and load_trace ---------------------------------------------------------

def test_packaged_esft_trace_loads():
    assert "esft" in TRACES and TRACES["esft"].is_file()
    trace = load_trace("esft")
    assert trace.ndim == 3 and trace.shape[1:] == (26, 64)
    assert trace.shape[0] > 100
    assert trace.dtype == np.float64
    assert (trace >= 0).all() and trace.sum() > 0


def test_trace_replay_follows_the_trace_with_layer_wrap():
    trace = load_trace("esft")  # [T, 26, 64]
    T, Lt, N = trace.shape
    L = Lt + 3  # more model layers than the trace has: layer l replays trace layer l % Lt
    w = TraceWorkload(trace, num_layers=L, num_experts=N)
    for step in (0, 5, T - 1):
        pop = w.popularity(step)
        assert pop.shape == (L, N)
        np.testing.assert_allclose(pop.sum(1), 1.0, atol=1e-12)
        want = trace[step] + 1e-3
        want = want / want.sum(1, keepdims=True)
        np.testing.assert_allclose(pop[:Lt], want, rtol=1e-12)
        np.testing.assert_array_equal(pop[Lt:], pop[:3])  # wrapped layers
        # the replayed load is skewed like the real trace: its hottest expert is well above mean
        assert pop.max() > 2 / N
    # steps wrap around the trace length
    np.testing.assert_array_equal(w.popularity(T), w.popularity(0))
    assert not np.array_equal(w.popularity(0), w.popularity(1))


def test_trace_replay_window_sums_consecutive_entries():
    trace = np.arange(4 * 2 * 3, dtype=np.float64).reshape(4, 2, 3)  # [T=4, L=2, N=3]
    w = TraceWorkload(trace, num_layers=2, num_experts=3, window=2)
    counts = trace[3] + trace[0] + 1e-3  # step 3 wraps to entry 0
    np.testing.assert_allclose(w.popularity(3), counts / counts.sum(1, keepdims=True))


def test_trace_rejects_wrong_expert_count():
    with pytest.raises(ValueError, match="64 experts but the model has 32") as e:
        TraceWorkload(load_trace("esft"), num_layers=2, num_experts=32)
    assert "--experts 64" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad,needle", [
    (np.ones((4, 8)), "[T, L, N]"),
    (np.zeros((0, 2, 8)), "empty"),
    (np.full((2, 2, 8), np.nan), "NaN"),
    (-np.ones((2, 2, 8)), "negative"),
])
def test_trace_workload_rejects_bad_arrays(bad, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        TraceWorkload(bad, num_layers=2, num_experts=8)


def test_load_trace_reads_npy_and_npz(tmp_path):
    arr = np.random.default_rng(0).integers(0, 9, (5, 2, 8)).astype(np.uint16)
    np.save(tmp_path / "t.npy", arr)
    np.savez(tmp_path / "t.npz", counts=arr)
    for name in ("t.npy", "t.npz"):
        got = load_trace(str(tmp_path / name))
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, arr)


def _one_line_error(path: str) -> str:
    with pytest.raises(ValueError) as e:
        load_trace(path)
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_load_trace_errors_are_one_line(tmp_path):
    msg = _one_line_error(str(tmp_path / "missing.npy"))
    assert "not found" in msg and "esft" in msg  # names the packaged traces
    np.save(tmp_path / "flat.npy", np.ones((4, 8)))
    assert "shape (4, 8)" in _one_line_error(str(tmp_path / "flat.npy"))
    np.save(tmp_path / "four.npy", np.ones((2, 2, 2, 2)))
    assert "[T, L, N]" in _one_line_error(str(tmp_path / "four.npy"))
    (tmp_path / "empty.npy").write_bytes(b"")
    assert "not a readable" in _one_line_error(str(tmp_path / "empty.npy"))
    (tmp_path / "text.npy").write_text("hello\n")
    assert "not a readable" in _one_line_error(str(tmp_path / "text.npy"))
    np.savez(tmp_path / "none.npz")
    assert "no array" in _one_line_error(str(tmp_path / "none.npz"))
    np.save(tmp_path / "str.npy", np.array([[["a"]]]))
    assert "dtype" in _one_line_error(str(tmp_path / "str.npy"))
    assert "not found" in _one_line_error(str(tmp_path))  # a directory is not a trace


# ---- routing_bias -------------------------------------------------------------------------

def test_routing_bias_is_finite_and_ordered():
    pop = np.array([[0.0, 0.1, 0.2, 0.7], [0.25, 0.25, 0.5, 0.0]])
    bias = routing_bias(pop, strength=0.5)
    assert bias.shape == pop.shape
    assert np.isfinite(bias).all()
    assert (np.diff(bias[0]) > 0).all()  # more popular -> larger bias
    np.testing.assert_allclose(bias[0, 3], 0.5 * np.log(0.7))
    np.testing.assert_allclose(routing_bias(pop, 1.0), 2 * bias)
    assert bias[1, 3] < bias[1, 0]  # zero popularity gets the lowest, still finite, bias


def test_load_trace_refuses_a_torch_file(tmp_path):
    import torch

    path = tmp_path / "trace.pt"
    torch.save({"counts": torch.ones(2, 2, 2)}, path)
    with pytest.raises(ValueError, match="trace"):
        load_trace(str(path))


def test_cosine_drift_goes_from_a_to_b_by_half_a_cosine():
    a = np.array([[1.0, 2.0, 7.0], [5.0, 3.0, 2.0]])  # [L, N], not normalised
    b = np.array([[4.0, 4.0, 2.0], [1.0, 1.0, 8.0]])
    T = 8
    s = cosine_drift(a, b, T)  # [T, L, N]
    assert s.shape == (T, 2, 3)
    assert np.allclose(s.sum(-1), 1.0)
    assert np.allclose(s[0], a / 10.0)  # both rows of a and b sum to 10
    for t in range(T):  # weight of b at step t, written out: (1 - cos(pi t / T)) / 2
        x = (1 - math.cos(math.pi * t / T)) / 2
        assert np.allclose(s[t], (1 - x) * a / 10.0 + x * b / 10.0)
    assert np.allclose(s[T // 2], (a + b) / 20.0)  # halfway, the plain average
    steps = np.diff(s[:, 0, 0])
    assert (steps > 0).all() and steps[0] < steps[T // 2 - 1]  # smooth: slow at the start
