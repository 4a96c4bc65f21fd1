"""Two torchrun launchers ("nodes") on 127.0.0.1 joined by a c10d rendezvous into one
4-rank job, as on two machines: rebalances move experts across nodes, outputs stay equal
to the dense reference, and the policy plans for 2 nodes (LOCAL_WORLD_SIZE=2 of 4 ranks)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _dist import free_port

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--layers", "2", "--experts", "8", "--tokens", "32", "--hidden", "32",
         "--intermediate", "32"]
TIMEOUT = 120  # seconds for the whole job; it takes ~10 s on 2 cores


def launcher(node_rank: int, port: int, out: Path, log: Path) -> subprocess.Popen:
    # rank 0 goes to the node whose --local-addr sorts first (c10d ranks nodes by their
    # descriptor), the same way docker/docker-compose.yml pins rank 0 to node0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "2", "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"eplb-test-{port}",
           "--local-addr", f"127.0.0.{node_rank + 1}", "--max-restarts", "0",
           "-m", "eplb.ops.demo", "--steps", "24", "--rebalance-every", "8", "--verify",
           "--json", str(out), *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    """Kill the launcher's whole process group (the agent and its ranks)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def test_two_node_torchrun_job(tmp_path):
    port = free_port()
    out = [tmp_path / f"node{n}.json" for n in range(2)]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    nodes = [launcher(n, port, out[n], logs[n]) for n in range(2)]
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = [log.read_text() for log in logs]
        codes = [p.poll() for p in nodes]
        assert codes == [0, 0], f"exit codes {codes} (None = still running after {TIMEOUT} s)" \
            f"\n--- node0:\n{text[0][-3000:]}\n--- node1:\n{text[1][-3000:]}"
    finally:
        for p in nodes:
            stop(p)
    # rank 0 (which prints and writes --json) ran on node 0; node 1 wrote nothing
    assert "eplb demo: 4 ranks on cpu, 2 nodes," in text[0], text[0]
    assert "eplb demo:" not in text[1] and not out[1].exists()
    d = json.loads(out[0].read_text())
    assert d["run"] == {"world_size": 4, "num_nodes": 2}
    events = [r["rebalance"] for r in d["steps"] if r["rebalance"]]
    assert len(events) == 3
    assert sum(e["experts_moved"] for e in events) > 0
    for e in events:
        assert e["verify_max_abs_diff"] <= 1e-4, e
        assert e["verify_bad_slots"] == 0, e
