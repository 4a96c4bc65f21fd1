"""Start N local ranks of a Python module the way `torchrun --standalone` does.

Each child gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT) on 127.0.0.1, so the module cannot tell the
difference; if one rank fails, the others are stopped and its exit code is returned. A
SIGTERM to the launcher (`kill`, `timeout`, a service manager) stops the ranks too, and the
launcher exits 143, as on Ctrl-C (130).
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

PORT_SPAN = 12000  # free_port picks among this many ports below the ephemeral range


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int | None:
    """The first port of Linux's ephemeral range (32768 by default), or None elsewhere."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, for a server this process starts next
    (a rendezvous store, a metrics endpoint).

    Picked at random below the ephemeral range, where the system never places the local
    end of an outgoing connection. A port picked by binding port 0 comes from that range,
    and a connection opened in between could take it before the server bound it: a job
    failed so with "Address already in use" (CI, 2026-12-05). Without such a range (not
    Linux, or one starting below 2048), or when no port there is free, the system picks
    one (port 0)."""
    low = ephemeral_low()
    if low is not None and low >= 2048:
        rng = random.Random()
        start = max(1024, low - PORT_SPAN)
        for _ in range(500):
            port = rng.randrange(start, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Terminated(Exception):
    """SIGTERM reached the launcher: stop the ranks before exiting (the default action
    would end the launcher at once and leave them running)."""


def _raise_terminated(signum, frame):
    raise _Terminated


def launch(module: str, args: list[str], nproc: int, timeout: float | None = None) -> int:
    """Run `python -m module *args` on `nproc` ranks; return 0 or the first failing code."""
    return launch_command([sys.executable, "-m", module, *args], nproc, timeout)


def launch_command(command: list[str], nproc: int, timeout: float | None = None) -> int:
    """Run `command` (e.g. `[python, script.py, *args]`) on `nproc` ranks with torchrun's
    variables; return 0 or the first failing code (the others are stopped)."""
    port = free_port()
    procs = []
    main = threading.current_thread() is threading.main_thread()  # handlers: main thread only
    old_handler = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
    code = 0
    try:
        for rank in range(nproc):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                       GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                       TORCHELASTIC_RUN_ID="eplb-demo", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            procs.append(subprocess.Popen(command, env=env))
        deadline = None if timeout is None else time.monotonic() + timeout
        while procs and code == 0:
            for p in list(procs):
                rc = p.poll()
                if rc is not None:
                    procs.remove(p)
                    if rc != 0:
                        code = rc if rc > 0 else 128 - rc
            if deadline is not None and time.monotonic() > deadline:
                print(f"eplb: error: ranks still running after {timeout:.0f} s, stopping them",
                      file=sys.stderr)
                code = 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130
    except _Terminated:
        code = 128 + signal.SIGTERM
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM: stop them still
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if main:
            signal.signal(signal.SIGTERM, old_handler)
    return code
