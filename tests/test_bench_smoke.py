"""The GPU benchmarks' CPU modes run end to end (tiny sizes, gloo ranks) and report
consistent figures. Correctness of what they print, not speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
