"""`eplb record` against real servers on 127.0.0.1: a runtime stepping in a thread with a
load that changes every step (the test keeps its own record of every step's logical
counts), and small stub servers for the failure cases. One snapshot (.json, .npy), traces
(.npz, .npy, .json) whose every entry equals the load the test fed between two snapshots,
`eplb plan` / `eplb simulate` on the files, and one-line errors. Every loop is bounded."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from _cli import run_main
from eplb.ops.metrics import EplbMetrics
from eplb.core.planning import plan
from eplb.ops.server import EplbServer
from test_metrics import L, N, R, make_runtime, skewed_pass

ROOT = Path(__file__).resolve().parent.parent
P = N + R
DEADLINE = 20.0


def logical_of(load: np.ndarray, p2l: np.ndarray) -> np.ndarray:  # [L, P] -> [L, N]
    out = np.zeros((L, N), dtype=np.int64)
    for layer in range(L):
        np.add.at(out[layer], p2l[layer], load[layer])
    return out


class LoadJob:
    """A one-rank runtime stepping in a thread; step s routes skewed_pass() * (1 + s % 3), so
    successive windows differ. `logical[s - 1]` is the test's own record of step s."""

    def __init__(self, window: int = 4, interval: int = 2, **metrics_kw):
        self.runtime = make_runtime(window_size=window, control_interval=2)
        self.metrics = EplbMetrics(self.runtime, interval=interval, **metrics_kw)
        self.server = EplbServer(self.runtime, self.metrics, port=0).start()
        self.url = self.server.url
        self.logical: list[np.ndarray] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        rt = self.runtime
        while not self._stop.is_set():
            step = rt.steps + 1
            load = skewed_pass().numpy() * (1 + step % 3)  # [L, P]
            self.logical.append(logical_of(load, rt.placement.physical_to_logical))
            rt.expert_load_pass.copy_(skewed_pass() * (1 + step % 3))
            rt.step()
            time.sleep(0.002)

    def wait_steps(self, n: int) -> None:
        target, deadline = self.runtime.steps + n, time.monotonic() + DEADLINE
        while self.runtime.steps < target:
            assert time.monotonic() < deadline, "the step loop stalled"
            time.sleep(0.005)

    def window(self, step: int, w: int) -> np.ndarray:  # [L, N] the test's own window sum
        return sum(self.logical[s - 1] for s in range(max(1, step - w + 1), step + 1))

    def between(self, a: int, b: int) -> np.ndarray:  # [L, N] steps a+1 .. b
        return sum((self.logical[s - 1] for s in range(a + 1, b + 1)), np.zeros((L, N), np.int64))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.stop()


@pytest.fixture
def job():
    j = LoadJob()
    j.wait_steps(6)
    yield j
    j.close()


def test_one_snapshot_json_and_npy(job, tmp_path, capsys):
    out = tmp_path / "load.json"
    code, stdout, err = run_main(["record", job.url, "--out", str(out)], capsys)
    assert code == 0 and err == "", err
    d = json.loads(out.read_text())
    assert stdout == (f"wrote {out}: {L} layers x {N} experts, the window of {d['steps']} steps at "
                      f"step {d['step']}\n")
    assert d["steps"] == 4 and d["step"] % 2 == 0  # window full; taken at a metrics update
    assert d["logical_count"] == job.window(d["step"], 4).tolist()
    assert d["total_logical_count"] == job.between(0, d["step"]).tolist()
    assert d["gpu_load"] == [[int(x.sum())] for x in job.window(d["step"], 4)]  # one GPU
    # `eplb plan` reads it as is
    placed = tmp_path / "placement.json"
    code, stdout, err = run_main(["plan", str(out), "--num-gpus", "2", "--num-slots", str(P),
                                  "--out", str(placed)], capsys)
    assert code == 0, err
    expect = plan(job.window(d["step"], 4), 2, P)
    assert json.loads(placed.read_text())["physical_to_logical"] == expect.physical_to_logical.tolist()

    npy = tmp_path / "load.npy"
    code, stdout, err = run_main(["record", job.url + "/", "--out", str(npy)], capsys)
    assert code == 0 and err == ""
    step = int(re.search(r"at step (\d+)$", stdout.strip()).group(1))
    arr = np.load(npy)
    assert arr.dtype == np.int64 and arr.shape == (L, N)
    assert (arr == job.window(step, 4)).all()
    code, _, err = run_main(["plan", str(npy), "--num-gpus", "2", "--num-slots", str(P), "--out",
                             str(tmp_path / "p2.json")], capsys)
    assert code == 0, err


@pytest.mark.parametrize("suffix", [".npz", ".npy", ".json"])
def test_trace_entries_are_the_load_between_snapshots(job, tmp_path, capsys, suffix):
    out = tmp_path / f"trace{suffix}"
    K = 4
    code, stdout, err = run_main(["record", job.url, "--out", str(out), "--every", "0.15",
                                  "--count", str(K)], capsys)
    assert code == 0, err
    lines = err.splitlines()  # progress: the start, then one line per snapshot
    assert len(lines) == K + 1, err
    start = int(re.fullmatch(rf"eplb record: {re.escape(job.url)} at step (\d+); {K} snapshots "
                             r"every 0\.15 s", lines[0]).group(1))
    steps_at = []
    for k, line in enumerate(lines[1:], 1):
        m = re.fullmatch(rf"eplb record: {k}/{K} at step (\d+): (\d+) steps, (\d+) token-expert "
                         r"assignments( \(no metrics update since the last snapshot\))?", line)
        assert m, line
        steps_at.append(int(m.group(1)))
        prev = start if k == 1 else steps_at[-2]
        assert int(m.group(2)) == steps_at[-1] - prev
        assert int(m.group(3)) == int(job.between(prev, steps_at[-1]).sum())
        # the note says exactly when the job's metrics did not move between two snapshots
        # (on a busy machine a 0.15 s gap can see no update: the job runs in this process)
        assert (m.group(4) is not None) == (int(m.group(2)) == 0), line
    expect = np.stack([job.between(a, b) for a, b in zip([start] + steps_at[:-1], steps_at)])
    assert expect.sum() > 0  # the job moved during the recording: the entries are not all empty
    assert stdout == (f"wrote {out}: {K} snapshots 0.15 s apart ([T, L, N] = [{K}, {L}, {N}]), "
                      f"steps {start}..{steps_at[-1]} ({steps_at[-1] - start} steps)\n")
    if suffix == ".npz":
        z = np.load(out)
        assert (z["counts"] == expect).all() and z["counts"].dtype == np.int64
        assert z["step"].tolist() == steps_at
        assert z["steps"].tolist() == np.diff([start] + steps_at).tolist()
        assert len(z["time"]) == K and (np.diff(z["time"]) >= 0).all()
    elif suffix == ".npy":
        assert (np.load(out) == expect).all()
    else:
        d = json.loads(out.read_text())
        assert d["logical_count"] == expect.tolist() and d["step"] == steps_at
        assert d["start_step"] == start and d["every"] == 0.15 and d["gpus"] == 1
        code, _, err2 = run_main(["plan", str(out), "--num-gpus", "2", "--num-slots", str(P),
                                  "--out", str(tmp_path / "p.json")], capsys)  # [T, L, N]: summed
        assert code == 0, err2
        return
    # the trace loads in `eplb simulate` as is
    code, stdout, err = run_main(["simulate", str(out), "--num-gpus", "2", "--num-slots", str(P),
                                  "--window", "1", "--interval", "1", "--no-oracle"], capsys)
    assert code == 0, err
    assert stdout.startswith(f"eplb simulate: {out}: {K} steps, {L} layers x {N} experts")


# ---- failures: one line on stderr, exit 2 -------------------------------------------------
class Stub:
    """An HTTP server on 127.0.0.1 answering GET with canned (status, content type, body)
    replies, one per request (the last one repeats)."""

    def __init__(self, replies):
        replies = list(replies)

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                status, ctype, body = replies.pop(0) if len(replies) > 1 else replies[0]
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _load_answer(total, steps, step):
    d = {"step": step, "steps": 2, "total_steps": steps, "gpus": 1,
         "logical_count": [[1, 2], [3, 4]], "total_logical_count": total}
    return 200, "application/json", json.dumps(d).encode()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(argv, capsys, needle, progress=0):
    """Exit 2, nothing on stdout, and on stderr `progress` progress lines then ONE error line."""
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == "", (code, out, err)
    lines = err.splitlines()
    assert err.endswith("\n") and len(lines) == progress + 1, err
    assert all(not ln.startswith("eplb record: error") for ln in lines[:-1]), err
    assert lines[-1].startswith("eplb record: error: ") and needle in lines[-1], err
    return lines[-1]


def test_errors_are_one_line(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "x.json")
    _one_line(["record", f"http://127.0.0.1:{_dead_port()}", "--out", out], capsys,
              "/load: cannot connect (Connection refused)")
    stub = Stub([(200, "text/plain", b"hello, not json")])
    try:
        _one_line(["record", stub.url, "--out", out], capsys,
                  "the answer is not JSON (is this an eplb server?)")
    finally:
        stub.close()
    stub = Stub([(200, "application/json", b'{"status": "ok"}')])
    try:
        _one_line(["record", stub.url, "--out", out], capsys, "the answer has no logical_count")
    finally:
        stub.close()
    # a job restarting between the snapshots of a trace (its totals went down)
    stub = Stub([_load_answer([[5, 5], [5, 5]], 10, 10), _load_answer([[1, 1], [1, 1]], 2, 2)])
    try:
        _one_line(["record", stub.url, "--out", str(tmp_path / "t.npy"), "--every", "0.05",
                   "--count", "2"], capsys, "the job restarted between snapshots (step 10 -> 2, "
                  "counts went down)", progress=1)
    finally:
        stub.close()
    stub = Stub([_load_answer([[5, 5], [5, 5]], 10, 10), _load_answer([[5, 5, 5]] * 2, 12, 12)])
    try:
        _one_line(["record", stub.url, "--out", str(tmp_path / "t.npy"), "--every", "0.05",
                   "--count", "2"], capsys, "the job changed between snapshots (2 x 2 -> 2 x 3 "
                  "experts)", progress=1)
    finally:
        stub.close()
    assert not list(tmp_path.iterdir())  # nothing written on failure

    # a real eplb server: without GET /load (an older eplb), with it turned off, too early
    import eplb.ops.server

    rt = make_runtime()
    monkeypatch.setattr(eplb.ops.server, "_ROUTES", {k: v for k, v in eplb.ops.server._ROUTES.items()
                                                 if k != "/load"})
    with EplbServer(rt, EplbMetrics(rt)) as srv:
        _one_line(["record", srv.url, "--out", out], capsys,
                  "404 Not Found: no such endpoint: /load (this server has no GET /load")
    monkeypatch.undo()
    with EplbServer(rt, EplbMetrics(rt, export_load=False)) as srv:
        _one_line(["record", srv.url, "--out", out], capsys, "404 Not Found: load export is not enabled")
    with EplbServer(rt, EplbMetrics(rt, interval=7)) as srv:  # nobody stepped yet
        _one_line(["record", srv.url, "--out", out], capsys,
                  "503 Service Unavailable: no load recorded yet: the first snapshot is taken at step 7")


@pytest.mark.parametrize("args,needle", [
    (["--every", "1"], "--every and --count go together"),
    (["--count", "3"], "--every and --count go together"),
    (["--every", "0", "--count", "2"], "--every must be in (0, 86400]"),
    (["--every", "nan", "--count", "2"], "--every must be in (0, 86400]"),
    (["--every", "1", "--count", "0"], "--count must be >= 1"),
    (["--every", "1", "--count", str(10**7)], "--count: 10000000 is more than"),
    (["--timeout", "0"], "--timeout must be in (0, 3600]"),
    (["--out", "{tmp}/x.txt"], "x.txt must end in .json, .npy (.npz with --every/--count)"),
    (["--out", "{tmp}/x.npz"], "x.npz must end in .json, .npy"),
    (["--out", "{tmp}/missing/x.json"], "directory does not exist"),
])
def test_bad_arguments(tmp_path, capsys, args, needle):
    argv = ["record", "http://127.0.0.1:9", "--out", str(tmp_path / "x.json")]
    argv += [a.format(tmp=tmp_path) for a in args]
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


def test_real_process_progress_and_errors(job, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "t.npy"
    r = subprocess.run([sys.executable, "-m", "eplb", "record", job.url, "--out", str(out),
                        "--every", "0.1", "--count", "2"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [ln.split(":")[0] for ln in r.stderr.splitlines()] == ["eplb record"] * 3
    assert r.stdout.startswith(f"wrote {out}: 2 snapshots") and np.load(out).shape == (2, L, N)
    r = subprocess.run([sys.executable, "-m", "eplb", "record", f"http://127.0.0.1:{_dead_port()}",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "cannot connect" in r.stderr


def test_interrupted_trace_keeps_what_it_recorded(job, tmp_path):
    """Ctrl-C during a long recording: the snapshots taken so far are written, exit 130."""
    import signal

    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    out = tmp_path / "t.npz"
    # Ctrl-C at a terminal: SIGINT at its default disposition in the child. A test run
    # started in the background by a non-interactive shell (`pytest &`) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: restore it.
    p = subprocess.Popen([sys.executable, "-m", "eplb", "record", job.url, "--out", str(out),
                          "--every", "0.1", "--count", "1000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        deadline = time.monotonic() + 60
        while len(lines) < 3:  # the start line and two snapshots
            assert time.monotonic() < deadline and p.poll() is None, lines
            lines.append(p.stderr.readline())
        p.send_signal(signal.SIGINT)
        stdout, rest = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, rest
    tail = rest.splitlines()
    assert tail[-1].startswith("eplb record: interrupted after ") and tail[-1].endswith(
        " of 1000 snapshots"), rest
    kept = int(tail[-1].split()[4])
    assert kept >= 2
    z = np.load(out)
    assert z["counts"].shape == (kept, L, N)
    steps = [int(re.search(r"at step (\d+)", ln).group(1)) for ln in lines + tail[:-1]]
    assert z["step"].tolist() == steps[1:kept + 1]  # every snapshot it announced, in order
    assert (z["counts"] == np.stack([job.between(a, b) for a, b in zip(steps[:kept], steps[1:kept + 1])])).all()
    assert stdout.startswith(f"wrote {out}: {kept} snapshots")
