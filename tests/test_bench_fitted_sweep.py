"""benchmarks/diag/issue29_fitted_sweep.py: `--preset` replays the preset it names, and
`--fit` replaces the default GEMM fit."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from test_bench_row_time import diag_module

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "benchmarks" / "results" / "2026-12-05-issue29-heavy" / "steady-lognormal_shift-lognormal_drift.json"


def _sweep(monkeypatch, capsys, *args: str) -> tuple[str, list[float]]:
    """(header, [fit expected, fit Poisson, analytic]) of the sweep over draw 29 of the
    steady family, Qwen3-235B at EP 8."""
    sweep = diag_module("issue29_fitted_sweep")
    monkeypatch.setattr(sys, "argv", ["sweep", "--model", "qwen3-235b", "--ep", "8", "--trace", "steady-lognormal",
                                      "--family-seeds", "29", *args])
    sweep.main()
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if re.match(r"\| 29 \|", line))
    return out[0], [float(x) for x in row.split("|")[2:5]]


def _grid(preset: str) -> float:
    """default/deepseek of the same configuration (family seed 29) in the analytic grid that
    benchmarks/issue29.py wrote (results/2026-12-05-issue29-heavy: the planner as it is)."""
    doc = json.loads(GRID.read_text())
    assert doc["family_seed"] == 29 and doc["counts"] == "expected" and doc["cost"] == "analytic"
    return next(r["default/deepseek"] for r in doc["rows"] if (r["model"], r["trace"], r["ep"], r["preset"])
                == ("qwen3-235b", "steady-lognormal", 8, preset))


@pytest.mark.parametrize("preset", ["decode", "prefill"])
def test_the_preset_replayed_is_the_one_named(monkeypatch, capsys, preset):
    head, (_, _, analytic) = _sweep(monkeypatch, capsys, "--preset", preset)
    assert f"EP 8 {preset} steady-lognormal" in head
    assert analytic == pytest.approx(_grid(preset), abs=6e-5)  # printed to 4 decimals


def test_a_fit_given_replaces_the_default_one(monkeypatch, capsys, tmp_path):
    from eplb.ops.gpu_cost import FEATURES
    coef, _ = diag_module("issue29_row_time").fit_for("qwen3-235b", "decode", {})  # the default fit, written to a file of our own
    same, dear = tmp_path / "same.json", tmp_path / "dear.json"
    for path, c in ((same, coef), (dear, coef * [1, 1, 1, 1, 40])):  # dear: a 128-row tile costs 40x
        path.write_text(json.dumps({"gpu": {"qwen3-235b": {"decode": {"fit": dict(zip(FEATURES, c.tolist()))}}}}))
    head0, base = _sweep(monkeypatch, capsys)
    head1, same_r = _sweep(monkeypatch, capsys, "--fit", str(same))
    head2, dear_r = _sweep(monkeypatch, capsys, "--fit", str(dear))
    assert "fit: 2026-12-04-issue29-gpu" in head0 and f"fit: {same}" in head1 and f"fit: {dear}" in head2
    assert same_r == base
    assert dear_r[2] == base[2] and dear_r[:2] != base[:2]  # the analytic column takes no fit
