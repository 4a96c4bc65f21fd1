"""The demo job as users run it: real rank processes on 127.0.0.1 (gloo), started by
`eplb demo` or by plain torchrun; results, JSON records, one-line errors, failing ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "eplb"
# the installed console script when there is one, else the same entry point by module
EPLB = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "eplb.ops.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SMALL = ["--layers", "2", "--experts", "8", "--tokens", "32", "--hidden", "32",
         "--intermediate", "32"]


def env(**extra: str) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    e.update(extra)
    return e


def run(cmd: list[str], timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout kill the whole group (every rank)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env(**extra_env), cwd=ROOT, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def check_records(path: Path, steps: int, layers: int) -> list[dict]:
    d = json.loads(path.read_text())
    records = d["steps"]
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        for key in ("balancedness", "balancedness_static"):
            assert len(r[key]) == layers
            assert all(0 < b <= 1 for b in r[key]), r
    return records


def test_demo_verify_json(tmp_path):
    out = tmp_path / "demo.json"
    r = run(EPLB + ["demo", "--nproc", "2", "--steps", "24", "--rebalance-interval", "8", "--verify",
                    "--json", str(out), "--layers", "2", "--experts", "8", "--tokens", "64"])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    records = check_records(out, steps=24, layers=2)
    events = [(rec["step"], rec["rebalance"]) for rec in records if rec["rebalance"]]
    assert [s for s, _ in events] == [7, 15, 23]
    for _, e in events:
        assert e["trigger"] == "interval"
        assert isinstance(e["experts_moved"], int) and e["experts_moved"] >= 0
        assert isinstance(e["bytes_moved"], int) and e["bytes_moved"] >= 0
        assert e["seconds"] >= 0
        assert len(e["balancedness_before"]) == 2 and len(e["balancedness_after_predicted"]) == 2
        assert e["verify_max_abs_diff"] <= 1e-4
        assert e["verify_bad_slots"] == 0
    moved = sum(e["experts_moved"] for _, e in events)
    assert moved > 0 and sum(e["bytes_moved"] for _, e in events) > 0
    # bytes are whole experts: SwiGLU w13 [2I, H] + w2 [H, I] in float32, H = I = 64 (defaults)
    for _, e in events:
        assert e["bytes_moved"] == e["experts_moved"] * 3 * 64 * 64 * 4
    d = json.loads(out.read_text())
    assert d["args"]["steps"] == 24 and d["args"]["verify"] is True

    # results on stdout: one line per rebalance with its verification, then the summary
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ") and " rebalance" in ln]
    assert len(lines) == 3, r.stdout
    # the figures of each line, from the per-GPU loads the JSON records step by step: the
    # measured balancedness of the window (the 8 steps up to the rebalance), and a line
    # that says so when nothing moved
    for (s, e), line in zip(events, lines):
        gpu = np.sum([records[i]["gpu_load"] for i in range(s - 7, s + 1)], axis=0)  # [L, M]
        before = float(np.mean(gpu.mean(1) / gpu.max(1)))
        assert abs(np.mean(e["balancedness_before"]) - before) < 1e-5
        assert line.startswith(f"step {s + 1:5d} rebalance")
        if e["skipped"]:
            assert f"balancedness {before:.4f}, nothing moved" in line and e["experts_moved"] == 0
        else:
            after = np.mean(e["balancedness_after_predicted"])
            assert f"balancedness {before:.3f} -> {after:.3f} (predicted)" in line, line
            assert after > before and " over " not in line
    assert all("verify" in ln and ln.rstrip().endswith("OK") for ln in lines), lines
    assert "2 ranks on cpu" in r.stdout
    assert "24 steps in" in r.stdout and "3 rebalances" in r.stdout
    assert f"{moved} experts moved" in r.stdout
    assert f"wrote {out}" in r.stdout


def test_demo_says_when_a_rebalance_is_skipped(tmp_path):
    out = tmp_path / "skip.json"
    r = run(EPLB + ["demo", "--nproc", "2", "--steps", "16", "--rebalance-interval", "8",
                    "--min-gain", "0.9", "--json", str(out), *SMALL])
    assert r.returncode == 0, r.stderr
    records = check_records(out, steps=16, layers=2)
    events = [(rec["step"], rec["rebalance"]) for rec in records if rec["rebalance"]]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ") and " rebalance" in ln]
    assert len(events) == len(lines) == 2, r.stdout
    for (s, e), line in zip(events, lines):
        assert e["skipped"] and e["experts_moved"] == 0
        assert 0 < e["predicted_gain"] < 0.9
        gpu = np.sum([records[i]["gpu_load"] for i in range(s - 7, s + 1)], axis=0)  # [L, M]
        before = float(np.mean(gpu.mean(1) / gpu.max(1)))
        # how it was planned (tests/test_shift.py checks the figures): the first plan has no
        # earlier window to add
        steady = f", earlier steady windows in {e['steady_layers']} of 2 layers" if e["steady_layers"] else ""
        assert e["steady_layers"] == 0 or (s, e) != events[0]
        assert line == (f"step {s + 1:5d} rebalance skipped: predicted gain {e['predicted_gain']:+.4f}"
                        f" < min gain 0.9000; balancedness {before:.4f}, nothing moved{steady}"), line
    assert "2 rebalances (2 skipped), 0 experts moved, 0.00 MB" in r.stdout


def test_demo_under_plain_torchrun(tmp_path):
    out = tmp_path / "torchrun.json"
    r = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", "-m", "eplb.ops.demo",
                        "--steps", "12", "--rebalance-interval", "6", "--layers", "2", "--experts", "8",
                        "--tokens", "32", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    records = check_records(out, steps=12, layers=2)
    assert [rec["step"] for rec in records if rec["rebalance"]] == [5, 11]
    assert "2 ranks on cpu" in r.stdout and "12 steps in" in r.stdout


def test_demo_trace_replay(tmp_path):
    out = tmp_path / "trace.json"
    r = run(EPLB + ["demo", "--trace", "esft", "--experts", "64", "--layers", "2", "--nproc", "2",
                    "--steps", "12", "--rebalance-interval", "6", "--tokens", "64", "--hidden", "32",
                    "--intermediate", "32", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    assert "workload=trace esft" in r.stdout and "(top-6)" in r.stdout
    records = check_records(out, steps=12, layers=2)
    assert sum(rec["rebalance"] is not None for rec in records) == 2


def test_demo_nproc_abbreviation_is_not_forwarded_to_ranks(tmp_path):
    """argparse accepts --np for --nproc; the launcher must not pass it on to the ranks."""
    r = run(EPLB + ["demo", "--np=2", "--steps", "2", "--rebalance-interval", "0", *SMALL])
    assert r.returncode == 0, r.stderr
    assert "2 ranks on cpu" in r.stdout and "usage" not in r.stderr


def test_demo_bad_input_exits_2_with_one_line(tmp_path):
    flat = tmp_path / "flat.npy"
    np.save(flat, np.ones((4, 8)))
    cases = [
        (["--num-redundant-experts", "1", "--nproc", "2", "--experts", "8"], {}, "num_redundant_experts"),
        (["--trace", "/no/such.npy", "--nproc", "2"], {}, "not found"),
        (["--trace", "esft", "--experts", "32", "--nproc", "2"], {}, "--experts 64"),
        (["--trace", str(flat), "--experts", "8", "--nproc", "2"], {}, "[T, L, N]"),
        # no CUDA device is visible, on this machine or (hidden) on a GPU machine
        (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, "no CUDA device"),
    ]
    for args, extra, needle in cases:
        t0 = time.monotonic()
        r = run(EPLB + ["demo", "--steps", "4", "--layers", "2", *args], timeout=120, **extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert len(lines) == 1, (args, r.stderr)
        assert lines[0].startswith("eplb demo: error: ") and needle in lines[0], (args, lines)
        assert "Traceback" not in r.stderr and r.stdout == "", (args, r.stdout)
        assert time.monotonic() - t0 < 60, args


def test_torchrun_bad_input_is_reported_once():
    """Under torchrun every rank sees the same bad input; only rank 0 reports it (torchrun adds
    its own failure summary, which is not ours to shape)."""
    for args, needle in [(["--steps", "0"], "--steps"),
                         (["--num-redundant-experts", "1", "--experts", "8"], "num_redundant_experts")]:
        r = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", "-m", "eplb.ops.demo",
                            "--layers", "2", *args], timeout=120)
        assert r.returncode != 0
        ours = [ln for ln in r.stderr.splitlines() if ln.startswith("eplb demo: error: ")]
        assert len(ours) == 1 and needle in ours[0], r.stderr


# Loaded at start-up of every Python process whose PYTHONPATH holds its directory: records
# each rank's pid, and makes the rank EPLB_TEST_FAIL_RANK exit with status 3 once rank 0 is up,
# before it joins the process group (so rank 0 waits for it in rendezvous indefinitely).
SITECUSTOMIZE = textwrap.dedent("""
    import os, time
    _rank, _dir = os.environ.get("RANK"), os.environ.get("EPLB_TEST_HOOK_DIR")
    if _rank is not None and _dir:
        _tmp = os.path.join(_dir, "rank%s.tmp" % _rank)
        with open(_tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(_tmp, os.path.join(_dir, "rank%s.pid" % _rank))
        if _rank == os.environ.get("EPLB_TEST_FAIL_RANK"):
            _deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(_dir, "rank0.pid")) and time.monotonic() < _deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            os.write(2, b"injected failure\\n")
            os._exit(3)
""")


def test_failing_rank_stops_the_others(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    pythonpath = os.pathsep.join(p for p in (str(hook), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    r = run(EPLB + ["demo", "--nproc", "2", "--steps", "100000", *SMALL], timeout=180,
            PYTHONPATH=pythonpath, EPLB_TEST_HOOK_DIR=str(hook), EPLB_TEST_FAIL_RANK="1")
    elapsed = time.monotonic() - t0
    assert r.returncode == 3, (r.returncode, r.stderr)  # the failing rank's status
    assert "injected failure" in r.stderr
    assert "steps in" not in r.stdout  # the job did not run to the end
    assert elapsed < 90
    pid0 = int((hook / "rank0.pid").read_text())
    try:
        os.kill(pid0, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, f"rank 0 (pid {pid0}) is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_launcher_stops_its_ranks(tmp_path):
    """`kill` (SIGTERM) of `eplb demo`'s launcher, as `timeout`, a service manager or a shell
    ending its background job sends it: the ranks stop too (they used to keep running,
    orphaned, and kept the port) and the launcher exits 143."""
    rank = "import os, sys, time; open(sys.argv[1] + os.environ['RANK'], 'w').write(str(os.getpid())); time.sleep(120)"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from eplb.ops.launch import launch_command; "
         f"sys.exit(launch_command([sys.executable, '-c', {rank!r}, sys.argv[1]], 2))", str(tmp_path / "rank")],
        env=env())
    pidfiles = [tmp_path / "rank0", tmp_path / "rank1"]
    deadline = time.monotonic() + 60
    while not all(f.is_file() and f.read_text() for f in pidfiles) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in pidfiles]
    try:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 143
        time.sleep(0.2)  # reaped by the launcher already; nothing left to wait for
        assert not [p for p in pids if _alive(p)], "ranks still running after the launcher's SIGTERM"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_demo_line_names_the_trigger_and_how_the_plan_was_made():
    """The demo's line: a rebalance off the schedule names its trigger; move tolerance 0
    (only where the config's is above 0), steady windows and the drift trend are said at
    the end, with the counts the event carries; an ordinary one reads as before."""
    from eplb.core.placement import Placement
    from eplb.ops.demo import demo_line
    from eplb.runtime import RebalanceEvent

    def event(**kw):
        d = dict(step=9, trigger="interval", balancedness_before=np.full(4, 0.8),
                 balancedness_after=np.full(4, 0.95), experts_moved=12, local_copies=0, slots_changed=12,
                 bytes_moved=3_000_000, seconds_plan=0.01, seconds_transfer=0.02, seconds_commit=0.001,
                 placement=Placement.initial(4, 8, 12, 2), move_tolerance=0.03)
        d.update(kw)
        return RebalanceEvent(**d)

    plain = ("step    10 rebalance: balancedness 0.800 -> 0.950 (predicted), 12 experts moved, 3.00 MB, "
             "31.0 ms")
    assert demo_line(9, event(), 0.03) == plain
    assert demo_line(9, event(trigger="shift", move_tolerance=0.0), 0.03) == \
        plain.replace("rebalance:", "rebalance (shift):") + ", move tolerance 0"
    assert demo_line(9, event(move_tolerance=0.0), 0.0) == plain  # the config's own tolerance: nothing to say
    assert demo_line(9, event(steady_layers=3, trend_layers=1), 0.03) == \
        plain + ", earlier steady windows in 3 of 4 layers, drift trend in 1 of 4 layers"
