"""Plans on a drifting load use the window's trend where it predicted well (issue 29):
`trend.trend_load` against an independent least-squares fit, the `DriftTrend` rules,
the recorder's age-weighted window, and the replay and the runtime that use them."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from _dist import device_for, run_distributed
from eplb.core.trend import TREND_FLOOR, DriftTrend, trend_load
from eplb.core.simulate import simulate
from eplb.runtime.recorder import LoadRecorder


def _by_polyfit(steps: np.ndarray, ahead: float) -> np.ndarray:  # [W, L, N] -> [L, N]
    """What `trend_load` should give, computed another way: numpy's degree-1 polyfit of
    every expert's counts over the step index, its slope shrunk by its Poisson noise,
    evaluated `ahead` past the window's middle, floored and rescaled to the window's tokens
    per layer."""
    W, L, N = steps.shape
    t = np.arange(W, dtype=np.float64)
    out = np.empty((L, N))
    for layer in range(L):
        for e in range(N):
            slope, icept = np.polyfit(t, steps[:, layer, e], 1)
            mean = steps[:, layer, e].mean()
            noise = mean / np.sum((t - t.mean()) ** 2)  # a Poisson count's variance, on the slope
            slope *= min(1.0, max(0.0, 1 - noise / max(slope ** 2, 1e-300)))
            out[layer, e] = max(mean + slope * ahead, TREND_FLOOR * mean)
    return out * steps.sum((0, 2))[:, None] / out.sum(1, keepdims=True)


def _moment(steps: np.ndarray) -> np.ndarray:  # [W, L, N] oldest first -> [L, N] counts x age
    return sum(age * s for age, s in zip(range(len(steps) - 1, -1, -1), steps))


def test_trend_load_is_the_least_squares_line_floored_and_rescaled():
    rng = np.random.default_rng(3)
    for W, ahead in ((4, 4.0), (7, 2.5), (2, 10.0)):
        steps = rng.poisson(rng.uniform(1, 50, (1, 3, 9)) + rng.uniform(-5, 5, (1, 3, 9)).clip(0)
                            * np.arange(W)[:, None, None], (W, 3, 9)).astype(float)  # [W, L, N]
        got = trend_load(steps.sum(0), _moment(steps), W, ahead)
        np.testing.assert_allclose(got, _by_polyfit(steps, ahead), rtol=1e-9)
        np.testing.assert_allclose(got.sum(1), steps.sum((0, 2)))  # the window's tokens per layer
    # one step: no slope to fit, the window as it is
    one = np.array([[[3.0, 4.0]]])
    np.testing.assert_array_equal(trend_load(one.sum(0), _moment(one), 1, 5.0), one.sum(0))


def test_drift_trend_uses_a_layer_where_its_last_trend_predicted_better():
    # two layers drifting alike; what follows goes on along the trend in layer 0 and goes
    # back to the window in layer 1
    line = np.stack([np.array([[1e4 + 1e3 * j, 2e4 - 1e3 * j]] * 2) for j in range(4)])  # [4, L, N]
    window, moment = line.sum(0), _moment(line)
    state = DriftTrend()
    load, state, used = state.plan(window, window, moment, 4, 1.0, fresh=True, drift=True)
    assert not used.any() and np.array_equal(load, window)  # the first trend is only made, to judge
    made = state.last[0]
    # what came: layer 0 went on as the trend said, layer 1 went back to where the window was
    came = np.stack([made[0], window[1]])
    other = came * 3  # what the plan would plan on otherwise (e.g. with earlier steady windows)
    load, state2, used = state.plan(came, other, moment, 4, 1.0, fresh=True, drift=True)
    assert used.tolist() == [True, False]
    # layer 0: the trend's move from the window, carried over to three windows' worth (1
    # step past the window's middle: no floor reached)
    np.testing.assert_allclose(load[0], other[0] + 3 * (trend_load(came, moment, 4, 1.0)[0] - came[0]))
    np.testing.assert_array_equal(load[1], other[1])  # the other layer keeps the plan's load
    # the drift rule quiet: a layer on the trend last time stays on it while it predicts
    # better; one that was not does not start
    again = np.stack([state2.last[0][0], state2.last[0][1]])  # both layers went on as the trends said
    _, _, used = state2.plan(again, again, moment, 4, 1.0, fresh=True, drift=False)
    assert used.tolist() == [True, False]
    _, _, used = state2.plan(again, again, moment, 4, 1.0, fresh=True, drift=True)
    assert used.tolist() == [True, True]
    # not a fresh scheduled plan, or no moment, or off: `load`, and the state forgets
    for kw in (dict(fresh=False), dict(fresh=True, moment=None)):
        args = dict(window=came, load=other, moment=moment, steps=4, ahead=1.0, fresh=True, drift=True)
        args.update(kw)
        load, after, used = state2.plan(**args)
        assert after.last is None and not used.any() and np.array_equal(load, other)
    load, after, used = DriftTrend(on=False, last=state.last).plan(came, other, moment, 4, 1.0, True, True)
    assert not used.any() and np.array_equal(load, other) and after.last is None


def test_trend_load_shrinks_a_slope_within_routing_noise():
    """A slope no larger than a Poisson count's noise is shrunk towards 0 (the window mean
    stays); a slope well clear of it is kept almost whole."""
    flat = np.stack([np.array([[100.0 + d, 100.0 - d]]) for d in (1, -1, 1, -1)])  # [4, 1, 2] noise-sized
    np.testing.assert_allclose(trend_load(flat.sum(0), _moment(flat), 4, 6.0), flat.sum(0))
    steep = np.stack([np.array([[1e4 + 1e3 * j, 1e4 - 1e3 * j]]) for j in range(4)])  # means 11500, 8500
    got = trend_load(steep.sum(0), _moment(steep), 4, 2.0)  # 2 steps past the window's middle
    # each slope (+-1000 a step) less its noise share: variance mean / sxx, sxx = 5 over 4 steps
    up, down = 11500 + 2 * 1e3 * (1 - 2300 / 1e6), 8500 - 2 * 1e3 * (1 - 1700 / 1e6)
    np.testing.assert_allclose(got, [[up, down]] / np.float64(up + down) * 80000, rtol=1e-12)
    assert got[0, 0] > 4 * 11500 + 7900  # almost the whole 2 x 1000 a step, over 4 steps


def _moment_all_reduces(rank: int, world: int) -> None:
    device = device_for(rank)
    L, N, M, S, W = 2, 4, 2, 3, 5
    rec = LoadRecorder(L, N, M, S, window_size=W, device=device)
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 0, 2]], device=device)
    rng = np.random.default_rng(11)
    logical = []
    for t in range(7):  # the ring wraps: the window holds steps 2..6
        x = torch.tensor(rng.integers(0, 9, (L, 2 * S)) * (rank + 1), dtype=torch.int64)
        logical.append(np.stack([np.bincount(p2l[i].cpu().numpy(), weights=x[i].numpy(), minlength=N)
                                 for i in range(L)]))
        rec.record(x.to(device), p2l)
    total, gpu, moment = rec.window_load(moment=True)
    factor = world * (world + 1) // 2  # every rank's counts are (rank + 1) x the same draws
    want = sum(age * c for age, c in zip(range(W - 1, -1, -1), logical[-W:])) / (rank + 1) * factor
    assert moment.dtype == torch.int64 and np.array_equal(moment.cpu().numpy(), want)
    assert np.array_equal(total.cpu().numpy(), sum(logical[-W:]) / (rank + 1) * factor)
    assert len(rec.window_load()) == 2  # without it, the two sums as before


def test_recorder_all_reduces_the_age_weighted_window():
    run_distributed(_moment_all_reduces, 2)


def _linear_drift(tokens_per_step: float = 1e5, T: int = 40, seed: int = 2) -> np.ndarray:  # [T, 2, 16]
    """Expected counts moving linearly from one random profile to another."""
    rng = np.random.default_rng(seed)
    a, b = rng.lognormal(0, 1.5, (2, 2, 16))
    a, b = a / a.sum(-1, keepdims=True), b / b.sum(-1, keepdims=True)
    x = np.linspace(0, 1, T)[:, None, None]
    return np.rint(tokens_per_step * ((1 - x) * a + x * b))


def test_replay_on_a_drift_plans_on_the_trend_and_serves_it_better():
    trace = _linear_drift()
    runs = {on: simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.05, oracle=False, drift_trend=on)
            for on in (True, False)}
    recs = {on: r.policies["default"].rebalances for on, r in runs.items()}
    assert [r.move_tolerance for r in recs[False]][2:] == [0.0] * (len(recs[False]) - 2)  # the drift rule fires
    # the same plans until the trend has predicted once, then better balance out of sample
    served = {on: float(runs[on].policies["default"].scored.mean()) for on in runs}
    assert served[True] < served[False] - 0.005, served
    # the records say which plans used the trend: none with it off; with it on, the first
    # plan that says so is the first whose moves differ from the plan off (the same load
    # until then)
    assert not any(r.trend_layers for r in recs[False])
    on = [i for i, r in enumerate(recs[True]) if r.trend_layers]
    moves = {k: [(r.slots_changed, r.experts_moved, r.predicted) for r in v] for k, v in recs.items()}
    assert on and on[0] == next(i for i, (a, b) in enumerate(zip(moves[True], moves[False])) if a != b), \
        [r.to_dict() for r in recs[True]]
    # off, or without shift detection: the window alone, as before this setting existed
    off = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.0, oracle=False, drift_trend=True)
    ref = simulate(trace, 8, 24, 4, 4, min_gain=0.0, shift_threshold=0.0, oracle=False, drift_trend=False)
    np.testing.assert_array_equal(off.policies["default"].scored, ref.policies["default"].scored)


def _trend_body(rank, world):
    """A hot spot travelling across the experts (one expert every 5 steps, both ranks
    counting the same; window 4, interval 8): the plans in force keep falling behind, and
    some plan uses the trend. In the layers it says it did, the policy got `_by_polyfit`
    of the window's counts (floored at TREND_FLOOR of the window, as `DriftTrend` carries a
    trend over), elsewhere the window itself."""
    import test_shift
    from test_shift import L, N, _physical, _runtime
    from eplb.ops.metrics import EplbMetrics

    device = device_for(rank)
    rt = _runtime(dist.group.WORLD, device, 0.05)
    metrics = EplbMetrics(rt, interval=5)
    fed, steps_at, gauges = {}, {}, {}
    for step in range(1, 41):
        load = 10.0 + 400.0 * np.exp(-0.5 * (np.arange(N) - step / 5.0) ** 2)[None].repeat(L, 0)  # [L, N]
        phys = _physical(rt, load, rank)  # [L, P] under the placement in force
        p2l = rt.placement.physical_to_logical  # [L, P]
        fed[step] = np.stack([np.bincount(p2l[i], weights=phys[i].numpy(), minlength=N) for i in range(L)])
        rt.expert_load_pass.copy_(phys.to(device))
        before = len(rt.events)
        rt.step()
        rt.finish_rebalance()  # each plan done before the next step: a plan's window is known
        for _ in rt.events[before:]:
            steps_at[len(steps_at)] = step
        if len(rt.events) > before:  # the gauges of the last planned rebalance
            gauges[len(rt.events) - 1] = (metrics.value("eplb_rebalance_layers_ratio", basis="drift_trend"),
                                          metrics.value("eplb_rebalance_move_tolerance"))
    rt.close()
    used = [i for i, e in enumerate(rt.events) if e.trend_layers]
    assert used, [(e.step, e.trigger, e.move_tolerance, e.trend_layers) for e in rt.events]
    for i in used:
        e = rt.events[i]
        assert e.summary()["trend_layers"] == e.trend_layers
        assert f", drift trend in {e.trend_layers} of {L} layers" in e.describe(), e.describe()
    if rank != 0:
        return
    assert len(test_shift.LOADS) == len(rt.events)  # every rebalance planned, in order
    TOLERANCES = test_shift.TOLERANCES
    for i in used:
        s = steps_at[i]
        window = np.stack([2 * fed[t] for t in range(s - 3, s + 1)])  # [4, L, N] both ranks
        seen = test_shift.LOADS[i]  # [L, N] what the policy planned on
        total = window.sum(0)  # [L, N] what the plan would plan on otherwise (no steady windows on a drift)
        trend = _by_polyfit(window, (4 + 8) / 2)
        # the trend's move carried over to that load: floored at TREND_FLOOR of it, same tokens
        moved = np.maximum(trend, TREND_FLOOR * total)
        moved *= total.sum(1, keepdims=True) / moved.sum(1, keepdims=True)
        on_trend = [not np.array_equal(seen[layer], total[layer]) for layer in range(L)]
        assert sum(on_trend) == rt.events[i].trend_layers
        assert gauges[i][0] == sum(on_trend) / L, (i, gauges[i], on_trend)
        assert gauges[i][1] == TOLERANCES[i], (i, gauges[i], TOLERANCES[i])  # what the policy was given
        for layer in np.flatnonzero(on_trend):
            np.testing.assert_allclose(seen[layer], moved[layer], rtol=1e-9)


def test_runtime_plans_a_drifting_load_on_its_trend():
    run_distributed(_trend_body, 2)
