"""Run a function on W real processes joined by torch.distributed on 127.0.0.1.

Backend: gloo on CPU by default; set EPLB_TEST_BACKEND=nccl to run the same tests
with one CUDA device per rank (used on the GPU machine).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eplb.ops.launch import free_port  # noqa: F401 - the tests' free port, below the ephemeral range

BACKEND = os.environ.get("EPLB_TEST_BACKEND", "gloo")
# Ranks start from a fork server that has imported torch, numpy and the packages once
# (a fresh interpreter per rank, as with "spawn", without paying the imports each time:
# on 2 cores they were most of a small multi-rank test's time). Under NCCL: "spawn".
START_METHOD = "spawn" if BACKEND == "nccl" else "forkserver"
if START_METHOD == "forkserver":
    mp.set_forkserver_preload([
        "torch", "torch.distributed", "numpy", "eplb", "moe", "_dist", "_hf_preload"])


def device_for(rank: int) -> torch.device:
    """The device a test rank computes on: cuda:rank under NCCL, else CPU."""
    return torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")


def _entry(rank, world_size, port, fn, args):
    watchdog = float(os.environ.get("EPLB_TEST_WATCHDOG", "0"))
    if watchdog > 0:  # debugging a hang: every thread's stack after that many seconds
        import faulthandler

        faulthandler.dump_traceback_later(watchdog, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size,
                            device_id=device_for(rank) if BACKEND == "nccl" else None)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> None:
    """Spawn `world_size` ranks running `fn(rank, world_size, *args)`; re-raise the first
    failure in the parent and kill every rank if the whole run exceeds `timeout` seconds.
    Under NCCL a run needing more GPUs than the machine has is skipped (gloo never is)."""
    if BACKEND == "nccl" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"needs {world_size} GPUs for NCCL, {torch.cuda.device_count()} visible")
    ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args),
                             nprocs=world_size, join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test exceeded {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def assert_same_on_every_rank(tensor: torch.Tensor, group=None) -> None:
    """Every rank of `group` (default: the world) holds a tensor equal to `tensor`
    (collective: all_gather)."""
    mine = tensor.clone()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    assert all(torch.equal(g, mine) for g in gathered)
