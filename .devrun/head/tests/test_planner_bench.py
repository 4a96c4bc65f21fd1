"""benchmarks/planner.py's drift section (section 7): the figures it prints agree with each
other (the paired difference with the two per-step columns, the ratio with the two copy
counts, the verdict with both), and a bad seed count is one clear error."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _num(cell: str) -> float:
    return float(cell.replace(",", "").replace("!", "").strip())


def test_drift_section_figures_agree():
    r = _run("--only", "drift", "--drift-seeds", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mean over 2 sampling seeds (0, 1)" in r.stdout
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in r.stdout.splitlines()
            if line.startswith("| ") and "EP16" in line]
    # the synthetic families need nothing outside the repository; the ESFT ones need ../shared
    assert any(row[0].startswith("synthetic N=128 Zipf") for row in rows), r.stdout
    for row in rows:
        moved_ds, moved_default, ratio = _num(row[2]), _num(row[3]), _num(row[4])
        imb_ds, imb_default = _num(row[5]), _num(row[6])
        m = re.fullmatch(r"([+-]\d\.\d{4}) ± (\d\.\d{4})", row[7])
        assert m, row[7]
        diff, se = float(m.group(1)), float(m.group(2))
        # mean of the per-seed differences = difference of the means (each printed to 4 decimals)
        assert abs(diff - (imb_default - imb_ds)) <= 1.01e-4, row
        assert se >= 0
        assert abs(ratio - moved_default / moved_ds) <= 5.01e-4, row
        wins, seeds = (int(x) for x in row[8].split(" / "))
        assert seeds == 2 and 0 <= wins <= 2
        if abs(diff) >= 1e-4:  # the sign is clear of the printing's rounding
            assert ("!" in row[6]) == (diff > 0), row  # `!`: default worse than deepseek
        if abs(imb_default - imb_ds) > 1e-4 and abs(ratio - 1 / 3) > 1e-3:  # clear of rounding
            assert row[9] == ("yes" if ratio <= 1 / 3 and imb_default <= imb_ds else "no"), row


def test_drift_paired_difference_and_its_standard_error(capsys):
    """The printed paired difference and standard error of one family, recomputed from the
    per-seed replays (the statistics by hand, not by the benchmark's code)."""
    # the benchmark pins itself to one thread when imported; the rest of this process keeps
    # its settings
    threads = torch.get_num_threads()
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import planner
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        torch.set_num_threads(threads)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    name, a, b, M, P = next(f for f in planner.drift_profiles() if "Zipf" in f[0])
    d, q = [], []
    for seed in (0, 1):
        T = planner.drift_trace(a, b, seed=seed)
        d.append(planner.drift_replay(T, "deepseek", M, P)[2])
        q.append(planner.drift_replay(T, "default", M, P)[2])
    x = [q[0] - d[0], q[1] - d[1]]
    mean = (x[0] + x[1]) / 2
    se = (((x[0] - mean) ** 2 + (x[1] - mean) ** 2) / (2 - 1)) ** 0.5 / 2 ** 0.5
    profiles = planner.drift_profiles
    planner.drift_profiles = lambda: [(name, a, b, M, P)]
    try:
        planner.section_drift(seeds=(0, 1))
    finally:
        planner.drift_profiles = profiles
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {name}"))
    assert f"{mean:+.4f} ± {se:.4f}" in row, (row, mean, se)
    wins = sum(v <= 0 for v in x)
    assert f"| {wins} / 2 " in row, row


def test_drift_seeds_must_be_positive():
    r = _run("--only", "drift", "--drift-seeds", "0")
    assert r.returncode == 2
    assert "--drift-seeds must be >= 1, got 0" in r.stderr
