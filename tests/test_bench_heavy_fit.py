"""benchmarks/diag/issue29_heavy_fit.py: the fit with the largest group recovers a known
cost, and the script reports the measured row and the fits' errors of a real H100 run."""
from __future__ import annotations

import re
import sys
import tarfile
from pathlib import Path

import numpy as np
from test_bench_row_time import diag_module

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "2026-12-05-issue29-h100" / "s6-r1" / "rows.tgz"


def test_heavy_fit_recovers_a_cost_with_a_largest_group_term():
    heavy_fit = diag_module("issue29_heavy_fit")
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 9000, size=(300, 6)).astype(np.float64)  # [K, S]
    counts[:, 1:] *= rng.random((300, 5)) < 0.6  # slots without tokens: 0-5 per GEMM
    counts[:, 0] = rng.integers(1, 20000, size=300)
    coef = np.array([3e-5, 1e-6, 2e-8, 1e-6, 7e-6, 2e-7])  # launch .. tiles128, largest group
    nz = counts > 0
    seconds = (coef[0] + coef[1] * nz.sum(1) + coef[2] * counts.sum(1) + coef[3] * np.ceil(counts / 64).sum(1)
               + coef[4] * np.ceil(counts / 128).sum(1) + coef[5] * counts.max(1))  # [K], written out
    fit = heavy_fit.HeavyFit(counts, seconds, heavy=True)
    assert np.allclose(fit.coef, coef, rtol=1e-6)
    assert fit.error[1] < 1e-9
    plain = heavy_fit.HeavyFit(counts, seconds, heavy=False)
    assert plain.error[1] > 0.05  # without the term the fit misses it
    per_gpu = counts.reshape(50, 6, 6)[:, :2]  # [L, M, S]
    assert np.allclose(fit(None, per_gpu), seconds.reshape(50, 6)[:, :2])


def test_reports_the_measured_row_and_the_fit_errors(tmp_path, monkeypatch, capsys):
    heavy_fit = diag_module("issue29_heavy_fit")
    with tarfile.open(RUN) as t:
        t.extractall(tmp_path, filter="data")
    run = tmp_path / "ep8-prefill-steady-lognormal"
    import issue29  # benchmarks/ is on the path once diag_module imported the script
    plans = tmp_path / "plans"
    issue29._plans("qwen3-235b", "steady-lognormal", 8, 0.05, plans, "prefill")  # this planner's plans
    monkeypatch.setattr(sys, "argv", ["heavy_fit", "--run", str(run), "--plans", str(plans), "--ep", "8"])
    heavy_fit.main()
    out = capsys.readouterr().out
    assert "measured default/deepseek 0.9900" in out  # the H100 row (s6-r1/rows.log)
    counts, seconds = heavy_fit.gemms(run, "qwen3-235b", "prefill")
    assert len(seconds) == 2518
    for heavy, name in ((False, "features:"), (True, "features + largest group:")):
        x = heavy_fit.design(counts, heavy)
        coef, *_ = np.linalg.lstsq(x / seconds[:, None], np.ones(len(seconds)), rcond=None)
        med = 100 * np.median(np.abs(x @ coef / seconds - 1))
        line = next(line for line in out.splitlines() if name in line)
        assert f"median {med:.2f}%" in line
        if not heavy:  # the residual of the GEMMs whose largest group holds 14,000 tokens or more
            sel = ((counts > 0).sum(1) >= 2) & (counts.max(1) >= 14000)
            r = np.median(seconds[sel] / (x[sel] @ coef) - 1)
            assert f"14000-: {100 * r:+.2f}% ({sel.sum()})" in out
    ratios = [float(x) for x in re.findall(r"default/deepseek (\d\.\d+), default/oracle", out)]
    assert len(ratios) == 2 and all(0.9 < r < 1.1 for r in ratios)
