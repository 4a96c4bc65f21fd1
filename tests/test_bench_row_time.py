"""benchmarks/diag/issue29_row_time.py: the forecast of a `--cost gpu` row's device time
replays `GpuGemmCost`'s own choices, and counts device time as `_time_graph` spends it."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np

from eplb.core.cost_model import LinkModel, ModelShape
from eplb.core.scale import plan_scale, scale_replay

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelShape("tiny", hidden=64, intermediate=32, num_experts=16, top_k=2, num_groups=1,
                  num_moe_layers=2)
COEF = np.array([30e-6, 3e-6, 1e-9, 0.0, 11e-6])  # seconds per launch, slot, token, 64-, 128-row tile


def diag_module(name: str):
    """The module `name` of benchmarks/diag (which imports its neighbours by name)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "diag"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _forecast_module():
    return diag_module("issue29_row_time")


def _device_seconds(t: float, reps: int) -> float:
    """Device time of one timing of a GEMM of `t` seconds, written out here: a warm-up and
    `reps` runs queued back to back; a run under 2 ms (a graph of one run would not fill
    3 ms) is then timed over a graph of `inner` runs (filling 3 ms, 1 to 20), replayed once
    to warm up and `reps` times."""
    if t > 0.002:  # 3 ms / t rounds to 1
        return t * (1 + reps)
    inner = min(20, max(1, round(0.003 / t)))
    return t * (1 + reps + inner + reps * inner)


def test_forecast_measures_what_the_gpu_cost_would_and_adds_up_its_device_time():
    from eplb.ops.gpu_cost import GpuGemmCost, fitted_seconds
    rt = _forecast_module()
    rng = np.random.default_rng(0)
    trace = rng.gamma(0.5, 1.0, (12, 2, 16)) * 1000  # [T, L, N]
    M, P = 4, 20
    planned = plan_scale(trace, TINY, M, P, 2, 2, LinkModel(gpus_per_node=2), ("deepseek", "default"))

    class FitTimed(GpuGemmCost):  # the GPU cost with each GEMM's time the fit's, as if measured
        def _time(self, key, reps=None):
            return float(fitted_seconds(np.asarray(key, dtype=np.float64), COEF))

    kw = dict(bucket=4, max_measured=2, reps=3)
    real = FitTimed(TINY, 4 + 1, 64, device="cpu", **kw)
    fc = rt.ForecastCost(TINY, 4 + 1, 64, coef=COEF, **kw)
    assert fc.experts.w13.device.type == "meta" and fc.x.numel() == 0  # nothing allocated
    out = {}
    for name, cost in (("real", real), ("forecast", fc)):
        out[name] = scale_replay(trace, TINY, M, P, 256, 2, 2, cost, LinkModel(gpus_per_node=2),
                                 placements=("deepseek", "default"), planned=planned).rows
    assert fc.measured() == real.measured() and fc.runs == real.runs > 20
    for kind in ("deepseek", "default"):
        assert out["forecast"][kind].tokens_per_s == out["real"][kind].tokens_per_s
    # every GEMM timed (calibration included) costs its runs; the grid grew the buffer too
    want = sum(_device_seconds(t, 3) for _, t in real.measured())
    assert fc.timed == fc.runs and abs(fc.device_s - want) < 1e-12 * max(want, 1.0)
    assert fc.x.shape[0] == real.x.shape[0]
    # re-timing rounds time each key again, one replay each (reps 1)
    keys = [tuple(k) for k, _ in fc.measured()[:5]]
    before = fc.device_s
    fc.retime(keys, 2)
    again = 2 * sum(_device_seconds(float(fitted_seconds(np.asarray(k, dtype=np.float64), COEF)), 1) for k in keys)
    assert fc.timed == fc.runs + 10 and abs(fc.device_s - before - again) < 1e-12


def test_forecast_scales_a_fit_to_a_model_without_one(tmp_path):
    """A model and preset without a fit of their own take DeepSeek-V3's, per-token terms
    scaled by the expert size (hidden x intermediate), the launch kept."""
    import json
    from eplb.core.cost_model import MODEL_PRESETS
    from eplb.ops.gpu_cost import FEATURES
    rt = _forecast_module()
    f = tmp_path / "issue29.json"
    f.write_text(json.dumps({"gpu": {"deepseek-v3": {"prefill": {"fit": dict(zip(FEATURES, COEF.tolist()))}}}}))
    coef, source = rt.fit_for("qwen3-235b", "prefill", {("deepseek-v3", "prefill"): f})
    q, d = MODEL_PRESETS["qwen3-235b"], MODEL_PRESETS["deepseek-v3"]
    scale = (4096 * 1536) / (7168 * 2048)
    assert (q.hidden, q.intermediate, d.hidden, d.intermediate) == (4096, 1536, 7168, 2048)
    assert coef[0] == COEF[0] and np.allclose(coef[1:], COEF[1:] * scale) and "scaled" in source
    same, _ = rt.fit_for("deepseek-v3", "prefill", {("deepseek-v3", "prefill"): f})
    assert np.array_equal(same, COEF)


def test_rows_pack_into_calls_in_order_one_model_each_within_the_limit():
    rt = _forecast_module()
    rows = [{"spec": "8:prefill:esft", "model": "deepseek-v3", "forecast_s": 100.0},  # limit 180
            {"spec": "16:prefill:esft:--retime=2", "model": "deepseek-v3", "forecast_s": 200.0},  # 330
            {"spec": "32:prefill:esft", "model": "deepseek-v3", "forecast_s": 20.0},  # 60: 570 > 560
            {"spec": "8:decode:drift:--model=qwen3-235b", "model": "qwen3-235b", "forecast_s": 20.0},  # 60
            {"spec": "64:prefill:drift", "model": "deepseek-v3", "forecast_s": 1000.0}]  # 1530 -> 560
    calls = rt.pack_calls(rows, 560)
    assert calls == [("deepseek-v3", ["8:prefill:esft:180", "16:prefill:esft:330:--retime=2"]),
                     ("deepseek-v3", ["32:prefill:esft:60"]),
                     ("qwen3-235b", ["8:decode:drift:60"]),
                     ("deepseek-v3", ["64:prefill:drift:560"])]
    assert [rt.row_limit(x) for x in (0.0, 100.0, 1.0)] == [30, 180, 32]


def test_timing_runs_counts_the_runs_of_a_timing_short_and_long():
    from eplb.ops.gpu_cost import timing_runs
    for t in (1e-5, 1.5e-4, 1e-3, 1.9e-3, 2.1e-3, 3e-3, 0.05):
        for reps in (1, 3):
            assert t * timing_runs(t, reps) == _device_seconds(t, reps), (t, reps)
    assert timing_runs(0.01, 3) == 4 and timing_runs(1e-3, 3) == 1 + 3 + 3 * 4  # inner 3

