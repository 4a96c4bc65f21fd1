"""The GPU benchmarks' CPU modes run end to end (tiny sizes, gloo ranks) and report
consistent figures. Correctness of what they print, not speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _hf import require_transformers

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_e2e_cpu_mode_runs_three_placements(tmp_path):
    out = tmp_path / "e2e.json"
    r = _run("e2e.py", "--cpu", "--steps", "4", "--interval", "2", "--tokens", "64",
             "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    res = rec["results"]
    assert list(res) == ["static", "oracle", "eplb"]
    assert res["static"]["rebalances"] == 0 and res["eplb"]["rebalances"] >= 1
    assert res["oracle"]["rebalances"] >= 1
    for mode in res.values():
        assert mode["tokens_per_s"] > 0 and 0 < mode["balancedness"] <= 1
    # the oracle plans on the very load it then serves: never worse balanced than static
    assert res["oracle"]["balancedness"] >= res["static"]["balancedness"]
    assert abs(rec["eplb_over_oracle"] - res["eplb"]["tokens_per_s"]
               / res["oracle"]["tokens_per_s"]) < 1e-12
    assert "EPLB / oracle tokens/s" in r.stdout and "E2E_JSON " in r.stdout


def test_e2e_rejects_bad_arguments():
    r = _run("e2e.py", "--cpu", "--modes", "oracle,eplb")
    assert r.returncode != 0 and "oracle plans on the load the static run measures" in r.stderr
    r = _run("e2e.py", "--cpu", "--interval", "0")
    assert r.returncode != 0 and "--interval must be >= 1" in r.stderr


def test_recording_cpu_mode_reports_overhead(tmp_path):
    out = tmp_path / "rec.json"
    r = _run("recording.py", "--cpu", "--iters", "2", "--tokens", "64", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    eager = rec["results"]["eager"]
    assert set(eager) >= {"off", "on", "on + step", "separate", "overhead_on_pct"}
    assert all(eager[k] > 0 for k in ("off", "on", "on + step", "separate"))
    assert rec["sync_check"] is None  # the sync check needs CUDA


def test_hf_throughput_cpu_mode_matches_the_original(tmp_path):
    """benchmarks/hf_throughput.py on 2 gloo ranks (tiny qwen3_moe, fp32): the EP model's
    logits and greedy tokens equal the original's before and after the rebalance, and the
    rebalance moves experts and raises the measured per-GPU balancedness."""
    require_transformers()
    out = tmp_path / "hf.json"
    r = _run("hf_throughput.py", "--device", "cpu", "--nproc", "2", "--layers", "1", "--reps", "2",
             "--no-decode", "--hf-ep", "", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    res = rec["results"]
    assert rec["world"] == 2 and rec["cross_rank_weight_spread"] == 0.0
    assert [m for m in res if not m.startswith("_")] == ["original", "ep-static", "ep-eplb"]
    for mode in ("ep-static", "ep-eplb"):
        check = res[mode]["check"]
        assert check["logits_max_abs_diff"] <= 1e-5, (mode, check)
        assert check["argmax_agree"] == 1.0 and check["generate_all_equal"], (mode, check)
        assert res[mode]["tokens_per_s"] > 0 and 0 < res[mode]["balancedness"] <= 1
    event = res["ep-eplb"]["rebalance"]["event"]
    assert event["outcome"] == "success" and event["experts_moved"] > 0, event
    assert res["ep-eplb"]["balancedness"] > res["ep-static"]["balancedness"]
    assert "HF_JSON " in r.stdout


def test_every_diagnostic_script_is_in_the_diag_index():
    """benchmarks/diag/README.md says what question each one-off script answered and where its
    record is: a script missing there is a script nobody can place."""
    diag = ROOT / "benchmarks" / "diag"
    index = (diag / "README.md").read_text()
    missing = sorted(p.name for p in diag.glob("*.py") if f"| `{p.name}` |" not in index)
    assert not missing, f"add a row for these to benchmarks/diag/README.md: {missing}"
