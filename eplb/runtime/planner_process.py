"""Planning in a child process, so that it never holds the serving process's GIL.

Why: a rebalance in the background plans in a thread of the serving process. Planning is
milliseconds of Python and small numpy calls that hold the GIL; meanwhile the step loop's
thread, which releases the GIL around every torch call (each kernel launch), must wait
for it again after each one, up to the interpreter's switch interval (5 ms) per wait.
On 2 x H200 this delayed the steps that ran while a rebalance was planned (the
measurements: benchmarks/README.md, "Transfers, recording, asynchronous rebalance ... 5.
Later the same day: the planner in a child process"). A child process has its own interpreter: the
step loop's thread only waits on a pipe, which releases the GIL.

`PlannerProcess.plan(...)` takes the arguments of `eplb.core.planning.plan` and returns the
same Placement (the child runs that very function). The child is a plain
`python -c` running `main()` below (no fork of the CUDA/NCCL process, no re-import of the
user's script); it reads requests from its stdin and exits when that closes, so it never
outlives the process that started it. Policies registered at run time
(`register_policy`) exist only in the parent: `can_plan(policy)` says whether the child
knows a policy.

The child keeps the heap memory it frees (`MALLOC_SETTINGS`, glibc): by default glibc hands
the free top of the heap back to the OS above 128 KiB, so every plan page-faults its
temporaries in again. At the DeepSeek-V3 shape that was about a third of a plan's time
(benchmarks/README.md, issue 29, 2026-12-04 (fifth)). What the child keeps is bounded by its
own peak: planning the DeepSeek-V3 shapes at EP 8 to 256 raised a process's RSS by 25 MB,
with these settings and without.

Wire format, both ways: 8-byte little-endian length, then a pickle. Request: a dict of
`plan()` arguments, or None to ask for the child's policy names. Reply: ("ok", result)
or ("error", exception type name, message).
"""
from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

import numpy as np

from eplb.core.policy.base import DEFAULT_DISPATCH_TOKENS, DEFAULT_MOVE_TOLERANCE, DEFAULT_TILE_ROWS

log = logging.getLogger("eplb.runtime.planner_process")

_HEADER = struct.Struct("<Q")
MAX_MESSAGE = 1 << 30  # bytes; a placement of any supported size is far below


_CHILD = "import sys; from eplb.runtime.planner_process import main; sys.exit(main())"

# glibc's malloc, read at the child's start (other C libraries ignore them): keep up to
# 256 MiB of freed heap instead of trimming the heap top above 128 KiB, and serve arrays up
# to 64 MiB from the heap instead of mapping them afresh (and faulting their pages in) each
# time. An environment variable already set wins.
MALLOC_SETTINGS = {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_MMAP_THRESHOLD_": str(64 << 20)}

# Linux pipes hold 64 KiB; a DeepSeek-V3-shape request (load and previous placement) is
# about 250 KiB, so the writer blocked until the reader drained each 64 KiB. Grown to 1 MiB
# (the default /proc/sys/fs/pipe-max-size), a call took 0.1-0.3 ms less when parent and
# child ran on different cores, the same on one core (benchmarks/diag/planner_pipe_size.py).
PIPE_BYTES = 1 << 20


class PlannerProcessError(RuntimeError):
    """The planner process died or answered something unreadable."""


def _grow_pipe(fd: int) -> None:
    """Ask for a PIPE_BYTES buffer on pipe `fd`; where the OS has no such call (not Linux)
    or refuses (a lower pipe-max-size), the pipe keeps its size and only the speed differs."""
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError) as e:
        log.debug("planner process: pipe buffer left as it is (%s)", e)


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    """One message, or EOFError when the other side closed the pipe."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    (n,) = _HEADER.unpack(head)
    if n > MAX_MESSAGE:
        raise PlannerProcessError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)  # only ever from our own child or parent


class PlannerProcess:
    """A child process that runs `eplb.core.planning.plan` on request (one request at a time).

    Started at construction; the child imports the planner in the background while the
    caller goes on, and the first `plan()` waits for that. If the child dies, `plan()`
    raises PlannerProcessError and the next call starts a new child."""

    def __init__(self, malloc_settings: dict[str, str] | None = None) -> None:
        """malloc_settings: glibc variables the child starts with unless the environment
        sets them (default `MALLOC_SETTINGS`; {} leaves glibc's defaults)."""
        self._malloc = dict(MALLOC_SETTINGS if malloc_settings is None else malloc_settings)
        self._lock = threading.Lock()  # one request in flight; requests from any thread
        self._proc: subprocess.Popen | None = None
        self._policies: list[str] | None = None
        self._start()

    def _start(self) -> None:
        env = dict(os.environ)
        # the planner is small and single-threaded work: leave the cores to the serving process
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        for name, value in self._malloc.items():  # plans without page faults (see the docstring)
            env.setdefault(name, value)
        # the child imports this very eplb, even when it was put on sys.path by hand
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, close_fds=True)
        for pipe in (self._proc.stdin, self._proc.stdout):
            _grow_pipe(pipe.fileno())

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _call(self, request: Any) -> Any:
        with self._lock:
            if not self.alive:
                self._start()
            proc = self._proc
            try:
                _send(proc.stdin, request)
                reply = _receive(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError) as e:
                self._kill()
                raise PlannerProcessError(
                    f"the planner process exited or broke the pipe ({type(e).__name__}); "
                    f"exit code {proc.poll()}, see its stderr") from None
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        if kind == "ValueError":  # bad input: the same error plan() raises in-process
            raise ValueError(message)
        raise PlannerProcessError(f"planning failed in the planner process: {kind}: {message}")

    def policies(self) -> list[str]:
        """Policy names the child knows (the built-in ones)."""
        if self._policies is None:
            self._policies = list(self._call(None))
        return self._policies

    def can_plan(self, policy: str) -> bool:
        return policy in self.policies()

    def plan(self, load, num_gpus: int, num_slots: int, num_nodes: int = 1, num_groups: int = 1,
             policy: str = "default", previous=None, *,
             move_tolerance: float = DEFAULT_MOVE_TOLERANCE, weighted: bool = False,
             read_tokens: float = 0.0, step_choices: float = 0.0,
             dispatch_tokens: float = DEFAULT_DISPATCH_TOKENS, tile_rows: float = DEFAULT_TILE_ROWS):
        """`eplb.core.planning.plan(...)`, computed in the child; returns a Placement."""
        return self._call(dict(load=np.asarray(load), num_gpus=num_gpus, num_slots=num_slots,
                               num_nodes=num_nodes, num_groups=num_groups, policy=policy,
                               previous=previous, move_tolerance=move_tolerance,
                               weighted=weighted, read_tokens=read_tokens,
                               step_choices=step_choices, dispatch_tokens=dispatch_tokens,
                               tile_rows=tile_rows))

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Close the child's stdin (it exits); kill it if it has not after `timeout` s."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            try:
                proc.stdin.close()
                proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._kill()

    def __del__(self) -> None:  # best effort; close() is the documented way
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _serve(requests: BinaryIO, replies: BinaryIO) -> int:
    """The child's loop: answer requests until stdin closes."""
    from eplb.core.planning import plan
    from eplb.core.policy.registry import available_policies

    while True:
        try:
            request = _receive(requests)
        except EOFError:
            return 0
        try:
            result = available_policies() if request is None else plan(**request)
            reply = ("ok", result)
        except Exception as e:  # noqa: BLE001 - every error goes back to the parent
            reply = ("error", type(e).__name__, str(e))
        _send(replies, reply)


def main() -> int:
    # the protocol owns the real stdout; anything printed goes to stderr instead
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return _serve(sys.stdin.buffer, replies)
