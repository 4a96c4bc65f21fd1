"""The large-EP cost replay (`eplb.core.scale`, `eplb simulate --cost`): every figure is
recomputed here by plain loops, independent of the vectorised code."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _cli import run_main

from eplb.core.placement import Placement
from eplb.core.cost_model import AnalyticCost, LinkModel, ModelShape, exchange_seconds, move_seconds
from eplb.core.scale import PlanOptions, plan_scale, scale_replay, slot_counts, stack_experts

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelShape("tiny", hidden=64, intermediate=32, num_experts=16, top_k=2, num_groups=1,
                  num_moe_layers=10)


def skewed_trace(T=10, L=2, N=16, seed=0):  # [T, L, N]: a very hot expert per layer, noise
    rng = np.random.default_rng(seed)
    t = rng.gamma(0.6, size=(T, L, N)) * 100 + 1
    t[:, np.arange(L), np.arange(L) % N] += 4000
    return t


def cost_cli(trace, gpus: str, gpus_per_node: str, tokens: str, *extra: str) -> list[str]:
    """`eplb simulate TRACE --cost analytic` on a tiny custom model (H 64, I 32, top-2, 10 MoE
    layers), window and interval 2, with the given EP sizes, node size and tokens per GPU."""
    return ["simulate", str(trace), "--cost", "analytic", "--model", "custom", "--hidden", "64",
            "--intermediate", "32", "--top-k", "2", "--moe-layers", "10", "--num-gpus", gpus,
            "--window-size", "2", "--rebalance-interval", "2", "--gpus-per-node", gpus_per_node,
            "--tokens-per-gpu", tokens, *extra]


# ---- pieces against loops ------------------------------------------------------------


@pytest.mark.parametrize("intra, inter", [(100.0, 10.0), (10.0, 100.0)])
def test_exchange_seconds_matches_a_pairwise_traffic_matrix(intra, inter):
    rng = np.random.default_rng(1)
    link = LinkModel(gpus_per_node=4, intra_GBps=intra, inter_GBps=inter)
    M = 8
    load = rng.integers(0, 1000, size=(3, M)).astype(float)  # [L, M]
    got = exchange_seconds(load, TINY, link)
    row = TINY.hidden * TINY.dtype_bytes
    for layer in range(3):
        worst = 0.0
        for g in range(M):
            si = sx = ri = rx = 0.0
            for h in range(M):  # every source sends 1/M of each destination's choices
                if h == g:
                    continue
                same = g // 4 == h // 4
                sent, recv = load[layer, h] / M, load[layer, g] / M
                if same:
                    si, ri = si + sent, ri + recv
                else:
                    sx, rx = sx + sent, rx + recv
            t = max(max(si, ri) * row / (intra * 1e9), max(sx, rx) * row / (inter * 1e9))
            worst = max(worst, t)
        assert got[layer] == pytest.approx(worst, rel=1e-12)


def test_move_seconds_matches_a_loop_over_receivers():
    rng = np.random.default_rng(2)
    link = LinkModel(gpus_per_node=2, intra_GBps=50.0, inter_GBps=5.0, transfer_efficiency=0.5)
    M, S, N, L = 4, 5, 16, 3
    old = Placement(np.stack([rng.permutation(np.arange(M * S) % N) for _ in range(L)]), N, M)
    new = Placement(np.stack([rng.permutation(np.arange(M * S) % N) for _ in range(L)]), N, M)
    total = 0.0
    B = TINY.bytes_per_expert
    for layer in range(L):
        o, w = old.physical_to_logical[layer], new.physical_to_logical[layer]
        worst = 0.0
        for g in range(M):
            mine = set(o[g * S:(g + 1) * S])
            node = set(o[(g // 2) * 2 * S:((g // 2) * 2 + 2) * S])
            need = set(w[g * S:(g + 1) * S]) - mine
            intra = len([e for e in need if e in node])
            worst = max(worst, intra * B / 25e9, (len(need) - intra) * B / 2.5e9)
        total += worst
    assert move_seconds(old, new, TINY, link) == pytest.approx(total, rel=1e-12)
    assert move_seconds(old, old, TINY, link) == 0.0


def test_slot_counts_split_each_expert_over_its_replicas():
    M, N = 2, 4
    p2l = np.array([[0, 1, 0, 2, 3, 0]])  # expert 0 three times
    shares = np.array([[0.5, 0.25, 0.125, 0.125]])
    even = slot_counts(shares, Placement(p2l, N, M), 1200)  # [1, 2, 3]
    assert even.tolist() == [[[200, 300, 200], [150, 150, 200]]]
    w = np.array([[0.5, 1.0, 0.25, 1.0, 1.0, 0.25]])
    weighted = slot_counts(shares, Placement(p2l, N, M, shares=w), 1200)
    assert weighted.tolist() == [[[300, 300, 150], [150, 150, 150]]]


def test_analytic_cost_is_the_roofline_by_hand():
    c = AnalyticCost(tflops=1.0, hbm_TBps=1.0, launch_us=10.0)
    counts = np.array([[[3, 0, 5], [0, 0, 0]]])  # [1, 2, 3]
    got = c(TINY, counts)
    H, I = 64, 32
    flops = 8 * 6 * H * I
    nbytes = 2 * 3 * H * I * 2 + 8 * (2 * H + 3 * I + I) * 2
    assert got[0, 0] == pytest.approx(max(flops, nbytes) / 1e12 + 10e-6)
    assert got[0, 1] == 0.0


def test_stack_experts_takes_consecutive_layers():
    t = np.arange(2 * 3 * 4, dtype=float).reshape(2, 3, 4)  # [T, L, Nt]
    assert stack_experts(t, 4) is t
    s = stack_experts(t, 8)
    for layer in range(3):
        for e in range(8):
            assert s[1, layer, e] == t[1, (layer + e // 4) % 3, e % 4]
    with pytest.raises(ValueError, match="multiple of the trace's"):
        stack_experts(t, 6)


# ---- the replay ----------------------------------------------------------------------


def test_static_row_recomputed_step_by_step():
    trace = skewed_trace()
    link = LinkModel(gpus_per_node=2)
    cost = AnalyticCost()
    M, P, tok = 4, 20, 64
    res = scale_replay(trace, TINY, M, P, tok, 2, 2, cost, link, ("static",))
    init = Placement.initial(2, 16, P, M, 2)
    layer_times, comp = [], []
    for t in range(2, 10):
        for layer in range(2):
            sh = trace[t, layer] / trace[t, layer].sum()
            per_gpu = []
            for g in range(M):
                cs = [round(round(sh[e] * M * tok * 2) / (init.replica_count()[layer, e]))
                      for e in init.physical_to_logical[layer, g * 5:(g + 1) * 5]]
                per_gpu.append(cost(TINY, np.array([[cs]]))[0, 0])
            loads = slot_counts(sh[None], init.__class__(init.physical_to_logical[layer:layer + 1], 16, M, 2),
                                M * tok * 2).sum(-1)  # [1, M]
            ex = 2 * exchange_seconds(loads, TINY, link)[0]
            layer_times.append(max(per_gpu) + ex)
            comp.append(max(per_gpu))
    row = res.rows["static"]
    assert row.layer_ms == pytest.approx(1e3 * np.mean(layer_times), rel=1e-9)
    assert row.compute_ms == pytest.approx(1e3 * np.mean(comp), rel=1e-9)
    assert row.tokens_per_s == pytest.approx(M * tok / (np.mean(layer_times) * 10), rel=1e-9)
    assert row.rebalances == 0 and row.rebalance_ms_per_step == 0


def test_balancing_pays_on_a_hot_expert_and_moves_are_charged():
    trace = skewed_trace()
    compute_bound = AnalyticCost(tflops=0.01)  # tiny experts: make FLOPs, not weight reads, count
    res = scale_replay(trace, TINY, 4, 24, 256, 2, 2, compute_bound, LinkModel(gpus_per_node=2),
                       serving_steps=10)
    rows = res.rows
    assert list(rows) == ["static", "deepseek", "default", "default-weighted", "oracle"]
    for k in ("deepseek", "default", "oracle"):
        assert rows[k].compute_ms < rows["static"].compute_ms
        assert res.gain_over_static(k) == pytest.approx(rows[k].tokens_per_s / rows["static"].tokens_per_s - 1)
    # the rebalance charge is what makes tokens/s differ from the layer time alone
    d = rows["default"]
    assert d.rebalances >= 1 and d.rebalance_ms_per_step > 0
    steps = 8 / 2 * 10  # scored steps / interval * serving_steps
    moved_ms = d.rebalance_ms_per_step * steps
    assert d.tokens_per_s == pytest.approx(4 * 256 / ((d.layer_ms * 10 + d.rebalance_ms_per_step) / 1e3))
    # per step: its layers plus its share of the rebalance that started its interval
    assert np.mean(d.step_ms) == pytest.approx(d.layer_ms * 10 + d.rebalance_ms_per_step, rel=1e-4)
    assert max(d.step_ms) > min(d.step_ms)
    assert moved_ms > 0
    # the same plans spread over more or fewer serving steps (planning itself depends on
    # them: a check's routing noise counts the model tokens a trace step stands for)
    opts = PlanOptions(step_choices=4 * 256 * TINY.top_k)
    planned = plan_scale(trace, TINY, 4, 24, 2, 2, LinkModel(gpus_per_node=2), opts=opts, serving_steps=10)
    again = scale_replay(trace, TINY, 4, 24, 256, 2, 2, compute_bound, LinkModel(gpus_per_node=2),
                         serving_steps=10, planned=planned, opts=opts).rows["default"]
    assert again.tokens_per_s == d.tokens_per_s  # the plans scale_replay made itself
    longer = scale_replay(trace, TINY, 4, 24, 256, 2, 2, compute_bound, LinkModel(gpus_per_node=2),
                          serving_steps=1000, planned=planned, opts=opts).rows["default"]
    assert longer.rebalance_ms_per_step == pytest.approx(d.rebalance_ms_per_step / 100)
    # the per-step figures carry the charge: same layers, only the spread of the moves differs
    short = scale_replay(trace, TINY, 4, 24, 256, 2, 2, compute_bound, LinkModel(gpus_per_node=2),
                         serving_steps=1, planned=planned, opts=opts).rows["default"]
    diff = np.array(short.step_ms) - np.array(longer.step_ms)  # [scored steps]
    assert diff.sum() == pytest.approx(len(diff) * (short.rebalance_ms_per_step - longer.rebalance_ms_per_step),
                                       abs=len(diff) * 1e-4)  # step_ms is rounded to 1e-4 ms
    assert diff.sum() > 10 * 1e-4 * len(diff)  # well above step_ms's rounding


def test_plan_scale_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown placement"):
        plan_scale(skewed_trace(), TINY, 4, 20, 2, 2, placements=("fancy",))
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        plan_scale(skewed_trace(), TINY, 4, 18, 2, 2)
    with pytest.raises(ValueError, match="nothing left to score"):
        plan_scale(skewed_trace(T=3), TINY, 4, 20, 2, 4)


# ---- the CLI -------------------------------------------------------------------------


def test_cli_cost_analytic_prints_and_writes_the_same_figures(tmp_path, capsys):
    trace = tmp_path / "t.npy"
    np.save(trace, skewed_trace(T=12, L=2, N=16))
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    code, stdout, err = run_main(cost_cli(trace, "2,4", "2", "64", "--json", str(out), "--plot", str(png)),
                                 capsys)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in stdout  # eplb.ops.plots
    doc = json.loads(out.read_text())
    assert [r["config"]["num_gpus"] for r in doc["results"]] == [2, 4]
    assert [r["config"]["num_slots"] for r in doc["results"]] == [18, 20]  # N + 1 spare per GPU
    for r in doc["results"]:
        for name, row in r["rows"].items():
            line = next(x for x in stdout.splitlines() if x.split()[:1] == [name]
                        and f"{row['tokens_per_s']:,.0f}" in x)
            assert f"{row['layer_ms']:.3f}" in line
            assert f"{100 * r['gain_over_static'][name]:+.1f}%" in line


def test_cli_cost_honours_the_runtime_settings_and_prints_ratios(tmp_path, capsys):
    """Issue 29, item 4: --move-tolerance, --weighted-replicas, --load-decay and
    --shift-threshold reach the replay (its JSON config and its plans) and the header;
    the /deepseek and /oracle columns are the rows' tokens/s over those rows' (recomputed
    from the JSON); one progress line for the whole run when stderr is not a terminal."""
    trace = tmp_path / "t.npy"
    np.save(trace, skewed_trace(T=12, L=2, N=16))
    base = cost_cli(trace, "2,4", "2", "64", "--min-gain", "0")
    docs, outs = [], []
    for extra in ([], ["--move-tolerance", "0.5", "--weighted-replicas", "--load-decay", "0.5",
                       "--shift-threshold", "0", "--steady-windows", "1", "--drift-trend", "off"]):
        out = tmp_path / f"s{len(docs)}.json"
        code, stdout, err = run_main(base + extra + ["--json", str(out)], capsys)
        assert code == 0, err
        docs.append(json.loads(out.read_text()))
        outs.append(stdout)
        assert len([ln for ln in err.splitlines() if "planning and scoring" in ln]) == 1, err
    header = outs[1].splitlines()[0]
    assert ("move tolerance 0.5, weighted replicas on, load decay 0.5, min gain 0, shift threshold 0 (off)"
            in header), header
    assert ("move tolerance 0.03, weighted replicas off, load decay 1, min gain 0, shift threshold 0.05 "
            "(checked every 10 model steps; steady windows 2, drift trend on)") in outs[0].splitlines()[0]
    opts = docs[1]["results"][0]["config"]["plan_options"]
    assert opts == {"move_tolerance": 0.5, "weighted": True, "decay": 0.5, "min_gain": 0.0,
                    "shift_threshold": 0.0, "read_tokens": 100.0, "step_choices": 2 * 64 * 2.0,
                    "dispatch_tokens": 40.0, "tile_rows": 128.0, "control_interval": 10,
                    "steady_windows": 1, "drift_trend": False}  # reads: EplbConfig's, set against EP 2's choices
    # the settings change what default does
    a, b = (d["results"][1]["rows"] for d in docs)
    assert a["default"]["tokens_per_s"] != b["default"]["tokens_per_s"]
    # each one reaches the plans: moves under tolerance 0 and 9, weighted shares, decay
    from eplb.core.scale import PlanOptions
    shape = ModelShape("c", 64, 32, 16, 2, 1, 10)

    def default_blocks(**kw):
        return plan_scale(skewed_trace(T=12, seed=1), shape, 4, 20, 4, 2, LinkModel(gpus_per_node=2),
                          ("default",), opts=PlanOptions(shift_threshold=0.0, **kw))[1]["default"]
    moved = [sum(b.record.experts_moved for b in default_blocks(move_tolerance=t)) for t in (0.0, 9.0)]
    assert moved[0] > moved[1], moved
    assert all(b.placement.shares is not None for b in default_blocks(weighted=True))
    assert [b.record.predicted for b in default_blocks(decay=0.1)] != \
        [b.record.predicted for b in default_blocks(decay=1.0)]
    for doc, stdout in zip(docs, outs):
        for r in doc["results"]:
            ds, orc = r["rows"]["deepseek"]["tokens_per_s"], r["rows"]["oracle"]["tokens_per_s"]
            for name, row in r["rows"].items():
                line = next(x for x in stdout.splitlines() if x.split()[:1] == [name]
                            and f"{row['tokens_per_s']:,.0f}" in x)
                cells = line.split()
                assert cells[3] == f"{row['tokens_per_s'] / ds:.3f}", (name, line)
                assert cells[4] == f"{row['tokens_per_s'] / orc:.3f}", (name, line)


def test_cli_cost_errors_are_one_line(tmp_path, capsys):
    trace = tmp_path / "t.npy"
    np.save(trace, skewed_trace(T=12, L=2, N=16))
    base = ["simulate", str(trace), "--window-size", "2", "--rebalance-interval", "2"]
    code, _, err = run_main(base + ["--num-gpus", "2,4", "--num-slots", "20"], capsys)
    assert code != 0 and "several EP sizes only with --cost" in err
    code, _, err = run_main(base + ["--num-gpus", "2"], capsys)
    assert code != 0 and "--num-slots is required" in err
    code, _, err = run_main(base + ["--num-gpus", "2", "--cost", "analytic", "--model", "custom"], capsys)
    assert code != 0 and "--model custom needs --hidden" in err
    code, _, err = run_main(base + ["--num-gpus", "2", "--cost", "analytic", "--tokens-per-gpu", "lots"],
                            capsys)
    assert code != 0 and "--tokens-per-gpu must be a number or one of decode, prefill" in err
    odd = tmp_path / "odd.npy"
    np.save(odd, skewed_trace(T=12, L=2, N=12))
    code, _, err = run_main(["simulate", str(odd), "--window-size", "2", "--rebalance-interval", "2",
                             "--num-gpus", "2", "--cost", "analytic"], capsys)  # deepseek-v3: 256 experts
    assert code != 0 and "the model has 256 experts and the trace 12" in err


def test_gpu_cost_mechanics_on_cpu():
    """The measured cost model's bookkeeping (the timing itself needs a GPU to mean much):
    identical work is measured once; each layer's largest estimate is measured."""
    from eplb.ops.gpu_cost import GpuGemmCost
    c = GpuGemmCost(TINY, max_slots=4, max_tokens=256, device="cpu", bucket=4, max_measured=2, reps=1,
                    margin=1.0)  # the two largest estimates of a layer are measured
    assert c.grid[0] >= 1 and len(c.grid) == len(c.single)
    runs = c.runs
    t1 = c.measure([5, 0, 9])
    assert c.runs == runs + 1
    assert c.measure([9, 6]) == t1 and c.runs == runs + 1  # sorted, rounded up to 4: (12, 8)
    counts = np.array([[[2, 0, 0, 0], [100, 90, 80, 0], [40, 30, 0, 0]]])  # [1, 3, 4]
    out = c(TINY, counts)
    est = c.estimate(counts)
    assert out.shape == (1, 3)
    first, second, third = np.argsort(-est[0]).tolist()  # CPU timings: the order is whatever they say
    assert out[0, first] == c.measure(counts[0, first])  # the two largest estimates are measured
    assert out[0, second] == c.measure(counts[0, second])
    ratio = (out[0, first] + out[0, second]) / (est[0, first] + est[0, second])
    assert out[0, third] == pytest.approx(est[0, third] * ratio)  # the others: estimates, rescaled
    audited = GpuGemmCost(TINY, max_slots=4, max_tokens=256, device="cpu", bucket=4, max_measured=1,
                          reps=1, audit_every=1)
    audited(TINY, counts)
    true_max = max(audited.measure(counts[0, g]) for g in range(3))
    picked = int(np.argmax(audited.estimate(counts)[0]))
    assert audited.audits == [audited.measure(counts[0, picked]) / true_max]
    assert audited.stats()["audited_layers"] == 1
    big = c.measure([300])  # more tokens than the buffer: it grows
    assert big > 0 and c.x.shape[0] >= 300
    with pytest.raises(ValueError, match="exceeds the 4 slots"):
        c.measure([1] * 5)


def test_gpu_cost_out_of_memory_says_what_was_timed_and_what_helps(monkeypatch):
    """A GEMM too large for the GPU's free memory fails with the work it timed and the
    allocator setting that let such a row run (the out-of-memory error is raised by hand:
    a CPU run cannot run out of CUDA memory)."""
    import torch
    from eplb.ops.gpu_cost import GpuGemmCost
    c = GpuGemmCost(TINY, max_slots=4, max_tokens=256, device="cpu", bucket=4, reps=1)

    def short(key, reps=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.56 GiB.")
    monkeypatch.setattr(c, "_time", short)
    with pytest.raises(torch.OutOfMemoryError) as err:
        c.measure([7, 30, 0, 2])
    msg = str(err.value)
    # 3 slots with tokens, rounded up to 4 each: 32 + 8 + 4 = 44 rows
    assert "3 slots with 44 tokens" in msg and "expandable_segments:True" in msg and "18.56 GiB" in msg
    assert (32, 8, 4) not in c.cache  # nothing cached for the work that failed


def _swiglu_fp32(c, key):
    """Each slot's down(silu(gate(x)) * up(x)) on its own token rows of `c.x`, written out in
    fp32 from `c`'s weights (independent of `GpuGemmCost.gemm`) -> [(slot rows [n, H])]."""
    import torch
    rows, start = [], 0
    for s, n in enumerate(key):
        h = c.x[start:start + n].float() @ c.experts.w13[s].float().T  # [n, 2I]: gate rows, then up
        g, u = h.chunk(2, dim=-1)
        rows.append((g * torch.sigmoid(g) * u) @ c.experts.w2[s].float().T)  # [n, H]
        start += n
    return rows


def test_gpu_cost_gemm_is_the_slots_expert_work_on_cpu():
    """`gemm(key)` (what `_time` times) computes each slot's SwiGLU on its own token rows,
    checked against the formula written out here."""
    import torch
    from eplb.ops.gpu_cost import GpuGemmCost
    c = GpuGemmCost(TINY, max_slots=4, max_tokens=64, device="cpu", bucket=1, reps=1)
    key = (5, 3, 1)
    got = c.gemm(key)()  # [9, H]
    want = torch.cat(_swiglu_fp32(c, key))  # [9, H]
    assert got.shape == (9, TINY.hidden) and want.abs().max() > 0
    assert ((got.float() - want).abs().max() / want.abs().max()) < 0.03  # bf16 rounding


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available() and hasattr(torch, "_grouped_mm")


def _queued_seconds(run, n: int) -> float:
    """Seconds of one `run()` on CUDA, timed independently of `GpuGemmCost`: a warm-up, then
    `n` runs queued back to back between two events."""
    import torch
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / n


@pytest.mark.skipif(not _cuda(), reason="times CUDA graphs: runs on the GPU machine")
def test_gpu_cost_graph_timing_on_cuda():
    """`_time_graph` against an independent timing of the same GEMM (50 launches queued
    back to back between two events, no graph), and its repeat spread, on a decode-sized key."""
    import torch
    from eplb.core.cost_model import MODEL_PRESETS
    from eplb.ops.gpu_cost import GpuGemmCost

    shape = MODEL_PRESETS["deepseek-v3"]
    c = GpuGemmCost(shape, max_slots=34, max_tokens=2048, device="cuda")
    key = tuple(range(60, 27, -1))  # 33 slots, 1,452 tokens
    graph = [c._time(key) for _ in range(5)]
    run = c.gemm(key)  # the same work, timed here without a graph
    got, start, err = run().float(), 0, 0.0  # [1452, H]: each slot's SwiGLU, checked per slot in fp32
    for n, want in zip(key, _swiglu_fp32(c, key)):
        err = max(err, float((got[start:start + n] - want).abs().max() / want.abs().max()))
        start += n
    assert err < 0.03, err  # bf16 rounding
    queued = _queued_seconds(run, 50)
    assert np.median(graph) == pytest.approx(queued, rel=0.1), (graph, queued)
    assert (max(graph) - min(graph)) / np.median(graph) < 0.03, graph
    # the activations are drawn on the GPU, and a hotter GPU than the buffer grows it there
    assert c.x.device.type == "cuda" and c.x.shape == (2048, shape.hidden)
    assert float(c.x.float().std()) == pytest.approx(0.1, rel=0.02)
    assert c.measure([3000, 8]) > 0 and c.x.device.type == "cuda" and c.x.shape[0] == 4096
    # the expert weights are drawn on the GPU too, N(0, 0.02^2), and differ between slots
    for w in (c.experts.w13, c.experts.w2):
        assert w.device.type == "cuda" and float(w[:2].float().std()) == pytest.approx(0.02, rel=0.02)
        assert not torch.equal(w[0], w[1])


@pytest.mark.skipif(not _cuda(), reason="times CUDA kernels: runs on the GPU machine")
def test_gpu_cost_times_a_long_gemm_from_queued_runs_without_a_graph(monkeypatch):
    """A prefill-sized GEMM (over 2 ms) is timed from runs queued back to back, with no
    graph (a capture would fail here), against an independent timing of the same work (10
    runs queued between two events after a warm-up); and its repeat spread."""
    import torch
    from eplb.core.cost_model import MODEL_PRESETS
    from eplb.ops.gpu_cost import GpuGemmCost, timing_runs

    shape = MODEL_PRESETS["deepseek-v3"]
    c = GpuGemmCost(shape, max_slots=9, max_tokens=65536, device="cuda")
    key = (30000, 20000, 10000, 4000)  # 64,000 rows on 4 slots
    monkeypatch.setattr(torch.cuda, "CUDAGraph", None)
    times = [c._time(key) for _ in range(3)]
    monkeypatch.undo()
    queued = _queued_seconds(c.gemm(key), 10)
    assert queued > 0.002 and timing_runs(queued, c.reps) == 1 + c.reps  # the path without a graph
    assert np.median(times) == pytest.approx(queued, rel=0.05), (times, queued)
    assert (max(times) - min(times)) / np.median(times) < 0.03, times


def test_bench_scale_plan_cache_round_trips(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import scale as bench
    finally:
        sys.path.pop(0)
    trace = skewed_trace(T=10, L=2, N=16)
    shape = TINY
    loads, blocks = plan_scale(trace, shape, 4, 20, 2, 2, LinkModel(gpus_per_node=2))
    f = tmp_path / "p.npz"
    bench.save_plans(f, loads, blocks)
    loads2, blocks2 = bench.load_plans(f, 4, 2)
    assert np.array_equal(loads, loads2) and list(blocks) == list(blocks2)
    a = scale_replay(trace, shape, 4, 20, 64, 2, 2, AnalyticCost(), LinkModel(gpus_per_node=2),
                     planned=(loads, blocks))
    b = scale_replay(trace, shape, 4, 20, 64, 2, 2, AnalyticCost(), LinkModel(gpus_per_node=2),
                     planned=(loads2, blocks2))
    assert a.to_dict() == b.to_dict()


def test_gpu_cost_switches_to_a_fitted_estimate():
    """After FIT_MIN measured GEMMs the estimate is the least-squares fit of the measured
    times on the features, recomputed here with numpy's lstsq."""
    from eplb.ops import gpu_cost
    c = gpu_cost.GpuGemmCost(TINY, max_slots=3, max_tokens=64, device="cpu", bucket=1, reps=1)
    assert c.coef is None
    for n in range(1, 2 * gpu_cost.FIT_MIN):  # bounded: the fit must come by FIT_MIN GEMMs
        c.measure([n, n % 7, 3])
        if c.coef is not None:
            break
    assert c.coef is not None and len(c._times) == gpu_cost.FIT_MIN
    keys = [tuple(sorted((v for v in k if v > 0), reverse=True)) for k in
            [[g] for g in c.grid] + [[i, i % 7, 3] for i in range(1, n + 1)]]
    X = np.array([[1, len(k), sum(k), sum(-(-v // 64) for v in k), sum(-(-v // 128) for v in k)] for k in keys],
                 dtype=float)
    y = np.array([c.cache[k] for k in keys])
    coef = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)[0]
    assert np.allclose(c.coef, coef)
    counts = np.array([[[5, 0, 2], [40, 30, 1]]])
    want = [1, 2, 7, 2, 2] @ coef, [1, 3, 71, 3, 3] @ coef
    assert np.allclose(c.estimate(counts)[0], want)
    fit = c.stats()["fit"]  # what users read: seconds per feature, the lstsq above
    assert list(fit) == ["launch", "slots_with_tokens", "tokens", "tiles64", "tiles128"]
    assert np.allclose(list(fit.values()), coef)
    table = dict((tuple(k), t) for k, t in c.measured())
    assert all(table[k] == c.cache[k] for k in keys) and len(table) == len(c.cache)


def test_gpu_cost_retime_times_in_shuffled_rounds_and_serves_the_median():
    """`retime`: every key timed once per round, each round in its own order; afterwards
    the cache serves each key's median over the rounds, `use_round(r)` round r's time, all
    from the timings recorded here as `_time` returned them. `freeze` stops refits."""
    from eplb.ops import gpu_cost
    c = gpu_cost.GpuGemmCost(TINY, max_slots=3, max_tokens=64, device="cpu", bucket=1, reps=1)
    keys = [(n, 2) for n in range(3, 11)]  # 8 two-slot GEMMs
    for k in keys:
        c.measure(list(k))
    seen: list[tuple[tuple[int, ...], float]] = []
    timed = c._time

    def record(key, reps=None):  # the real timing, written down
        t = timed(key, reps)
        seen.append((key, t))
        return t
    c._time = record
    runs = c.runs
    c.retime(keys, rounds=3, seed=1)
    assert c.runs == runs  # re-timing is not measuring new GEMMs
    assert len(seen) == 3 * len(keys)
    orders = [[k for k, _ in seen[i * 8:(i + 1) * 8]] for i in range(3)]
    assert all(sorted(o) == sorted(keys) for o in orders)  # each round: every key once
    assert len({tuple(o) for o in orders}) == 3  # in three different orders
    for k in keys:
        ts = [t for key, t in seen if key == k]
        assert c.measure(list(k)) == np.median(ts)
    c.use_round(2)
    assert all(c.cache[k] == t for k, t in seen[16:])
    c.use_round(None)
    with pytest.raises(ValueError, match="never measured"):
        c.retime([(63, 1)], rounds=1)
    with pytest.raises(ValueError, match="at least one round"):
        c.retime(keys, rounds=0)
    c._time = timed
    c.freeze()
    for n in range(1, 2 * gpu_cost.FIT_MIN):  # would fit at FIT_MIN GEMMs if not frozen
        c.measure([n, 1, 1])
    assert c.coef is None
    c.freeze(False)
    c.measure([64, 64, 64])
    assert c.coef is not None


def test_bench_issue29_side_by_side_scores_on_the_retimed_gemms(tmp_path):
    """benchmarks/issue29.py's `side_by_side` on a small replay with the measured cost (CPU
    path): the GEMMs it re-times are exactly those its final replay uses, a replay on one
    round's times is that round's row, and the row on the median times is the replay with
    every GEMM at the median of its rounds, recomputed here from `cost.rounds`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import issue29
    from eplb.ops.gpu_cost import GpuGemmCost

    trace = skewed_trace(T=8, L=2, N=16)
    link = LinkModel(gpus_per_node=2)
    planned = plan_scale(trace, TINY, 4, 20, 2, 2, link)
    cost = GpuGemmCost(TINY, max_slots=8, max_tokens=256, device="cpu", bucket=4, reps=1, max_measured=2)

    def replay() -> dict:
        return {"shift": scale_replay(trace, TINY, 4, 20, 16, 2, 2, cost, link, planned=planned),
                "noshift": scale_replay(trace, TINY, 4, 20, 16, 2, 2, cost, link, planned=planned)}
    replay()
    res, rounds = issue29.side_by_side(replay, cost, 3)
    assert len(rounds) == 3 and not cost.frozen and cost.touched is None
    assert rounds[0]["gemms"] == len(cost.rounds) > 0
    cost.freeze()
    cost.track()
    again = replay()  # the final replay once more: it asks for the re-timed GEMMs, no others
    assert cost.touched == set(cost.rounds)
    assert again["shift"].to_dict() == res["shift"].to_dict()
    for k, ts in cost.rounds.items():
        assert cost.cache[k] == np.median(ts) and len(ts) == 3
    cost.use_round(1)
    one = replay()
    assert {k: v.tokens_per_s for k, v in one["shift"].rows.items()} == \
        {k: v.tokens_per_s for k, v in rounds[1]["shift"].items()}
    assert issue29._ratio(rounds[1], "default/deepseek") == \
        one["shift"].rows["default"].tokens_per_s / one["shift"].rows["deepseek"].tokens_per_s


def test_bench_issue29_ratios_and_plan_cache(tmp_path):
    """benchmarks/issue29.py: its ratios are the replay's tokens/s over each other, the shift
    figures differ from the no-shift ones on a shifting family, and plans read back from its
    cache give the very same figures (what the GPU script relies on)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import issue29

    direct = issue29.run("analytic", tmp_path / "a", 0.05, [8], ["deepseek-v3"], ["shift-zipf"])
    assert [(r["ep"], r["preset"]) for r in direct["rows"]] == [(8, "decode"), (8, "prefill")]
    for r in direct["rows"]:
        t = r["tokens_per_s"]
        assert r["default/deepseek"] == pytest.approx(t["default"] / t["deepseek"], rel=1e-12)
        assert r["default/oracle"] == pytest.approx(t["default"] / t["oracle"], rel=1e-12)
        assert r["noshift/oracle"] == pytest.approx(r["default_noshift"] / t["oracle"], rel=1e-12)
        assert r["early_rebalances"] >= 1 and r["default/oracle"] > r["noshift/oracle"]
    for preset in ("decode", "prefill"):  # fills the cache: each preset has its own plans
        issue29._plans("deepseek-v3", "shift-zipf", 8, 0.05, tmp_path / "plans", preset)
    read_back = issue29._plans("deepseek-v3", "shift-zipf", 8, 0.05, tmp_path / "plans", "decode")
    assert any(b.lead > 0 for b in read_back["shift"][1]["default"])  # checks within a step, kept
    for label, key in (("shift", "moves_total"), ("noshift", "moves_total_noshift")):  # every rebalance's moves
        records = [b.record for b in read_back[label][1]["default"] if b.record is not None]
        assert direct["rows"][0][key] == sum(r.experts_moved for r in records) > 0
    executed = [r for r in records if not r.skipped]  # (no shift) the mean is over those that moved
    assert direct["rows"][0]["moves_per_rebalance_noshift"] == pytest.approx(
        sum(r.experts_moved for r in executed) / len(executed))
    cached = issue29.run("analytic", tmp_path / "b", 0.05, [8], ["deepseek-v3"], ["shift-zipf"],
                         plans=tmp_path / "plans")
    for a, b in zip(direct["rows"], cached["rows"]):
        for k in ("tokens_per_s", "default_noshift", "moves_per_rebalance", "moves_per_rebalance_noshift",
                  "early_rebalances", "shifted_plans"):
            assert a[k] == b[k], k
    decode = issue29.run("analytic", tmp_path / "c", 0.05, [8], ["deepseek-v3"], ["shift-zipf"],
                         plans=tmp_path / "plans", presets=("decode",))  # --presets decode
    assert [r["preset"] for r in decode["rows"]] == ["decode"]
    assert decode["rows"][0]["tokens_per_s"] == direct["rows"][0]["tokens_per_s"]


def test_bench_issue29_family_seed_draws_other_members(tmp_path, monkeypatch):
    """benchmarks/issue29.py --family-seed: other draws of every synthetic family (the same
    shapes and token totals), plan files of their own, and the default seed's files named
    as before (so existing plan caches stay valid)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import issue29

    base, other = issue29.synthetic(), issue29.synthetic(seed=30)
    assert set(base) == set(other) == set(issue29.SYNTHETIC)
    for name in issue29.SYNTHETIC:
        assert base[name].shape == other[name].shape == (40, 4, 256)
        assert np.all(base[name].sum(-1) == 2 ** 17) and np.all(other[name].sum(-1) == 2 ** 17)
        assert not np.array_equal(base[name], other[name])
    assert np.array_equal(base["drift"], issue29.synthetic(seed=issue29.FAMILY_SEED)["drift"])
    names = {}
    for seed in (issue29.FAMILY_SEED, 30):
        monkeypatch.setattr(issue29, "FAMILIES", [seed])
        names[seed] = [issue29._plan_file(tmp_path, "deepseek-v3", t, 8, 0.05, "decode").name
                       for t in ("shift-zipf", "esft")]
    assert names[issue29.FAMILY_SEED][0].startswith("deepseek-v3-shift-zipf-M8-decode-")
    assert names[30][0].startswith("deepseek-v3-shift-zipf-f30-M8-decode-")
    assert names[30][1] == names[issue29.FAMILY_SEED][1]  # a shared trace is no draw
    monkeypatch.setattr(issue29, "_LOADS", {})  # the loads are drawn again with the seed
    monkeypatch.setattr(issue29, "FAMILIES", [30])
    assert np.array_equal(issue29._all_loads()["shift-zipf"], other["shift-zipf"])


def test_bench_issue29_families_are_drawn_with_the_models_experts(monkeypatch):
    """benchmarks/issue29.py: Qwen3-235B (128 experts) replays the families drawn with 128
    experts (same shapes otherwise, 2**17 choices a step), DeepSeek-V3 the 256-expert draws
    as before; both models get every family, Qwen3 up to EP 128."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import issue29

    monkeypatch.setattr(issue29, "_LOADS", {})
    monkeypatch.setattr(issue29, "_DRAWN", {})
    monkeypatch.setattr(issue29, "SHARED_DIR", [ROOT / "no-such-dir"])  # the families alone
    small = issue29.synthetic(N=128)
    for name in issue29.SYNTHETIC:
        q = issue29._trace("qwen3-235b", name)
        assert q.shape == (40, 4, 128) and np.all(q.sum(-1) == 2 ** 17)
        assert np.array_equal(q, small[name])
        assert np.array_equal(issue29._trace("deepseek-v3", name), issue29.synthetic()[name])
    got = issue29.configs([8, 128, 256], ["deepseek-v3", "qwen3-235b"], list(issue29.SYNTHETIC))
    assert sorted({(m, M) for m, _, M in got}) == [("deepseek-v3", 8), ("deepseek-v3", 128), ("deepseek-v3", 256),
                                                    ("qwen3-235b", 8), ("qwen3-235b", 128)]
    assert len(got) == 5 * len(issue29.SYNTHETIC)


def test_cli_read_tokens_reaches_the_plans(tmp_path, capsys):
    """`--read-tokens` (decode-aware packing) is set against each EP size's token-expert
    choices per step, shown in the header, and changes the default's plans; without
    --cost it is refused (no token count)."""
    trace = tmp_path / "t.npy"
    rng = np.random.default_rng(7)
    t = rng.lognormal(0.0, 3.0, size=(12, 2, 32)) + 1e-3  # many cold experts
    np.save(trace, t)
    base = cost_cli(trace, "4,8", "8", "4", "--min-gain", "0", "--placements", "default")
    docs, outs = [], []
    for extra in (["--read-tokens", "0"], ["--read-tokens", "50"], []):
        out = tmp_path / f"r{len(docs)}.json"
        code, stdout, err = run_main(base + extra + ["--json", str(out)], capsys)
        assert code == 0, err
        docs.append(json.loads(out.read_text()))
        outs.append(stdout)
    assert "read tokens 0 (off)" in outs[0].splitlines()[0]
    assert "read tokens 50 (dispatch tokens 40, tile rows 128)" in outs[1].splitlines()[0]
    # without the flag: EplbConfig's, what the runtime plans with
    from eplb.core.config import EplbConfig
    assert (f"read tokens {EplbConfig.read_tokens:g} (dispatch tokens {EplbConfig.dispatch_tokens:g}, "
            f"tile rows {EplbConfig.tile_rows:g})" in outs[2].splitlines()[0])
    assert docs[2]["results"][0]["config"]["plan_options"]["read_tokens"] == EplbConfig.read_tokens
    for r, M in zip(docs[1]["results"], (4, 8)):
        assert r["config"]["plan_options"]["read_tokens"] == 50.0
        assert r["config"]["plan_options"]["step_choices"] == M * 4 * 2  # GPUs x tokens x top-k
    a = [r["rows"]["default"]["tokens_per_s"] for r in docs[0]["results"]]
    b = [r["rows"]["default"]["tokens_per_s"] for r in docs[1]["results"]]
    assert a != b
    for flag in ("--read-tokens", "--dispatch-tokens", "--tile-rows"):
        code, _, err = run_main(["simulate", str(trace), "--window-size", "2", "--rebalance-interval", "2",
                                 "--num-gpus", "4", "--num-slots", "36", flag, "50"], capsys)
        assert code != 0 and f"{flag} needs --cost" in err
    code, _, err = run_main(base + ["--read-tokens", "-1"], capsys)
    assert code != 0 and "--read-tokens must be a finite number >= 0" in err
    code, _, err = run_main(base + ["--read-tokens", "50", "--dispatch-tokens", "-1"], capsys)
    assert code != 0 and "--dispatch-tokens must be a number >= 0" in err
    code, _, err = run_main(base + ["--tile-rows", "-64"], capsys)
    assert code != 0 and "--tile-rows must be a finite number >= 0" in err
    out = tmp_path / "inf.json"
    code, stdout, err = run_main(base + ["--read-tokens", "50", "--dispatch-tokens", "inf", "--json", str(out)],
                                 capsys)
    assert code == 0, err
    assert "read tokens 50 (dispatch tokens inf, tile rows 128)" in stdout.splitlines()[0]
    assert json.loads(out.read_text())["results"][0]["config"]["plan_options"]["dispatch_tokens"] == float("inf")


def test_slot_counts_poisson_draws_have_the_expected_means_and_empty_steps():
    """`counts="poisson"`: each slot's count is a Poisson draw of its expected count
    (computed here by hand), so a slot expecting 0.3 tokens is empty in exp(-0.3) of the
    steps, where rounding would leave it empty in all of them."""
    M, N = 2, 4
    p2l = np.array([[0, 1, 0, 2, 3, 0]])  # expert 0 three times
    shares = np.array([[0.5, 0.2, 0.3 / 1200, 0.3 - 0.3 / 1200]])
    pl = Placement(p2l, N, M)
    lam = np.array([200.0, 240.0, 200.0, 0.3, 360.0 - 0.3, 200.0])  # share x 1200 / replicas
    assert slot_counts(shares, pl, 1200)[0].ravel()[3] == 0  # rounded: never a token
    rng = np.random.default_rng(5)
    draws = np.stack([slot_counts(shares, pl, 1200, rng)[0].ravel() for _ in range(4000)])  # [D, P]
    assert draws.dtype == np.int64
    sem = np.sqrt(lam / len(draws))  # Poisson: variance = mean
    assert (np.abs(draws.mean(0) - lam) < 5 * sem).all(), (draws.mean(0), lam)
    empty = (draws[:, 3] == 0).mean()
    p = np.exp(-0.3)
    assert abs(empty - p) < 5 * np.sqrt(p * (1 - p) / len(draws)), empty
    zero = slot_counts(np.array([[1.0, 0.0, 0.0, 0.0]]), pl, 1200, rng)[0].ravel()
    assert zero[[1, 3, 4]].tolist() == [0, 0, 0]  # no share, no token


def test_scale_replay_poisson_counts_are_seeded_and_recorded():
    shape = ModelShape("c", 64, 32, 16, 2, 1, 10)
    trace = skewed_trace(T=8, L=2, N=16)
    kw = dict(window=2, interval=2, cost=AnalyticCost(), link=LinkModel(gpus_per_node=2),
              placements=("static", "default"))
    runs = [scale_replay(trace, shape, 4, 20, 2, counts=c, seed=s, **kw)
            for c, s in (("poisson", 0), ("poisson", 0), ("poisson", 1), ("expected", 0))]
    ms = [r.rows["default"].step_ms for r in runs]
    assert ms[0] == ms[1] and ms[0] != ms[2] and ms[0] != ms[3]
    assert [r.config["counts"] for r in runs] == ["poisson"] * 3 + ["expected"]
    with pytest.raises(ValueError, match="counts must be one of expected, poisson"):
        scale_replay(trace, shape, 4, 20, 2, counts="mean", **kw)


def test_cli_counts_reaches_the_replay(tmp_path, capsys):
    trace = tmp_path / "t.npy"
    np.save(trace, skewed_trace(T=8, L=2, N=16))
    base = cost_cli(trace, "4", "2", "2", "--placements", "default")
    out = tmp_path / "p.json"
    code, stdout, err = run_main(base + ["--counts", "poisson", "--json", str(out)], capsys)
    assert code == 0, err
    assert "; poisson counts;" in stdout.splitlines()[0]
    assert json.loads(out.read_text())["results"][0]["config"]["counts"] == "poisson"
    code, stdout, err = run_main(base, capsys)
    assert code == 0 and "; expected counts;" in stdout.splitlines()[0], err
    code, _, err = run_main(["simulate", str(trace), "--window-size", "2", "--rebalance-interval", "2",
                             "--num-gpus", "4", "--num-slots", "20", "--counts", "poisson"], capsys)
    assert code != 0 and "--counts needs --cost" in err


def test_scale_replay_sets_reads_against_its_own_tokens_per_step():
    """`read_tokens` without `step_choices`: a replay that plans by itself sets the reads
    against its own choices per step (GPUs x tokens x top-k), the same plans as given them."""
    from eplb.core.scale import PlanOptions

    shape = ModelShape("c", 64, 32, 16, 2, 1, 10)
    rng = np.random.default_rng(7)
    trace = rng.lognormal(0.0, 3.0, size=(8, 2, 16)) + 1e-3  # many cold experts
    kw = dict(window=2, interval=2, cost=AnalyticCost(), link=LinkModel(gpus_per_node=4),
              placements=("static", "default"))
    auto = scale_replay(trace, shape, 4, 20, 2, opts=PlanOptions(read_tokens=50.0), **kw)
    given = scale_replay(trace, shape, 4, 20, 2, opts=PlanOptions(read_tokens=50.0, step_choices=4 * 2 * 2.0), **kw)
    assert auto.config["plan_options"]["step_choices"] == 16.0
    assert auto.rows["default"].step_ms == given.rows["default"].step_ms


# ---- shift checks within a trace step (issue 29, target 2) ---------------------------------
def test_check_every_is_the_control_interval_in_trace_steps():
    from eplb.core.scale import PlanOptions

    assert PlanOptions().control_interval == 10  # EplbConfig's
    assert PlanOptions(control_interval=10).check_every(4, 1000) == pytest.approx(0.04)
    assert PlanOptions(control_interval=300).check_every(4, 1000) == 1.0  # at most one per step
    assert PlanOptions(control_interval=0).check_every(4, 1000) is None  # no early rebalances


def test_scale_replay_mixes_a_step_a_rebalance_landed_in():
    """A block whose rebalance landed half way into its first step: that step costs half
    the previous placement's layer time and half the new one's (each replayed alone), the
    other steps the new one's; the move time is the same."""
    from eplb.core.replay import Block

    shape = ModelShape("c", 4096, 2048, 16, 2, 1, 10)  # experts of 50 MB: moves count
    trace = skewed_trace(T=6, L=2, N=16)
    a = Placement.initial(2, 16, 20, 4)
    b = Placement(np.roll(a.physical_to_logical, 3, axis=1), 16, 4)
    kw = dict(window=2, interval=2, cost=AnalyticCost(), link=LinkModel(gpus_per_node=2))

    def run(blocks):
        return scale_replay(trace, shape, 4, 20, 8, planned=(trace, blocks), **kw).rows

    rows = run({"static": [Block(2, 6, a, a)], "default": [Block(2, 6, b, a)],
                "default-weighted": [Block(2, 6, b, a, None, 0.5)]})
    move = rows["default"].rebalance_ms_per_step
    assert move > 0 and rows["default-weighted"].rebalance_ms_per_step == pytest.approx(move)
    old, new, mixed = (rows[k].step_ms for k in ("static", "default", "default-weighted"))
    assert mixed[0] == pytest.approx(0.5 * old[0] + 0.5 * (new[0] - move) + move, rel=1e-3)
    assert mixed[1:] == new[1:]
    # a block replaced within its first step (end == start): its move still counts, on the next
    c = Placement(np.roll(a.physical_to_logical, 5, axis=1), 16, 4)
    rows = run({"static": [Block(2, 6, a, a)],
                "default": [Block(2, 2, b, a), Block(2, 6, c, b, None, 0.5)]})
    r = rows["default"]
    n = len(r.step_ms)
    both = move_seconds(a, b, shape, LinkModel(gpus_per_node=2)) + move_seconds(b, c, shape, LinkModel(gpus_per_node=2))
    assert r.rebalances == 2
    assert 1e3 * both * shape.num_moe_layers / 2 * 2 / 1000 == pytest.approx(r.rebalance_ms_per_step * n)
    moves_in_steps = sum(r.step_ms) - n * r.layer_ms * shape.num_moe_layers  # step_ms are rounded to 1e-4
    assert moves_in_steps == pytest.approx(n * r.rebalance_ms_per_step, abs=n * 1e-4)
    assert n * r.rebalance_ms_per_step > 0.1  # the moves are visible above the rounding


def test_cli_control_interval_reaches_the_replay(tmp_path, capsys):
    trace = tmp_path / "t.npy"
    np.save(trace, skewed_trace(T=8, L=2, N=16))
    base = cost_cli(trace, "4", "2", "2", "--placements", "default")
    out = tmp_path / "c.json"
    code, stdout, err = run_main(base + ["--control-interval", "0", "--json", str(out)], capsys)
    assert code == 0, err
    assert ("shift threshold 0.05 (no early rebalances: control interval 0; steady windows 2, drift trend on)"
            in stdout.splitlines()[0])
    assert json.loads(out.read_text())["results"][0]["config"]["plan_options"]["control_interval"] == 0
    code, _, err = run_main(base + ["--control-interval", "-1"], capsys)
    assert code != 0 and "--control-interval must be >= 0" in err
    code, _, err = run_main(["simulate", str(trace), "--window-size", "2", "--rebalance-interval", "2",
                             "--num-gpus", "4", "--num-slots", "20", "--control-interval", "5"], capsys)
    assert code != 0 and "--control-interval needs --cost" in err


def test_plan_scale_checks_within_steps_and_sets_routing_noise_from_the_tokens():
    """On a load whose hot experts change at step 4: with the runtime's control interval
    the early rebalance lands within step 4 (lead > 0); with checks after whole steps only
    (control interval = model steps per trace step) at step 5; with none, never."""
    from eplb.core.scale import PlanOptions

    rng = np.random.default_rng(0)
    hot = [rng.permutation(16) for _ in range(2)]
    shares = lambda k: np.stack([1.0 / (np.argsort(hot[k]) + 1.0) ** 1.5 for _ in range(2)])  # noqa: E731
    trace = np.array([shares(0 if t < 4 else 1) * 1e5 for t in range(10)])  # [10, 2, 16]
    shape = ModelShape("c", 64, 32, 16, 2, 1, 10)

    def early(ci):
        opts = PlanOptions(control_interval=ci, step_choices=4 * 64 * 2.0)
        _, blocks = plan_scale(trace, shape, 4, 20, 2, 2, LinkModel(gpus_per_node=4), ("static", "default"),
                               opts=opts, serving_steps=1000)
        return [(b.start, b.lead) for b in blocks["default"] if b.record.early]

    assert early(10) == [(4, pytest.approx(0.02))]  # the first check, 10 of 500 model steps
    assert early(500) == [(5, 0.0)]
    assert early(0) == []
