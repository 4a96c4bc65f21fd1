"""Faults injected through objects the runtime is given, never by patching modules.

* `FaultyTransport(real, rank, faults)`: wraps a real transport (from
  `eplb.runtime.transport_choice.make_transport`) and is passed as
  `EplbRuntime(..., transport=FaultyTransport(...))`. The mover calls its `exchange`
  (fills staging rows, only reads weights) and, where the runtime supports it, its
  `write` (writes the changed slots of a layer from staging). Each `Fault` fires at one
  call of one of them on chosen ranks: raise, corrupt the staged experts, stall, die or
  freeze.
* `PolicySwitch`: a planner registered with `eplb.register_policy` that plans like a
  built-in one until armed, then raises (a failing plan on rank 0).

Call counts are per rank and per method and count only the calls that reach the
transport (a layer whose plan is a no-op on a rank never does: pick transitions that
change every rank's slots in every layer when a fault must fire at the same layer on
every rank; `every_rank_moves` checks that).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from eplb.runtime.transport_base import Transport, TransportBase

ACTIONS = ("raise", "corrupt", "corrupt_w2", "stall", "kill", "freeze", "sleep_then_kill")


class InjectedFault(RuntimeError):
    """What an injected `raise` raises (its message names the method and call)."""


@dataclass
class Fault:
    """One fault: at call `call` (1-based, on this rank; None: every call) of `method`
    ("exchange" or "write"), on the ranks in `ranks` (None: every rank), do `action`:

    * "raise": raise InjectedFault (message `message` if given) before touching anything;
    * "corrupt": after the real exchange, flip one bit at a random flat offset of *every*
      weight tensor of one random staged row (seeded by `seed`, rank and call);
    * "corrupt_w2": the same, only in the second weight tensor (w2 of the reference model);
    * "stall": block on an Event for `seconds` before touching any group, then carry on
      normally (no group timeout can see it: every wait is local);
    * "kill": `os._exit(17)`; "sleep_then_kill": sleep `seconds` (peers are now waiting in
      this layer's transfer), then `os._exit(17)`;
    * "freeze": sleep `seconds` (default 600: the test's parent kills the process).
    """

    method: str
    call: int | None
    action: str
    ranks: Sequence[int] | None = None
    seconds: float = 600.0
    seed: int = 0
    message: str | None = None
    fired: list = field(default_factory=list)  # what it did, per firing (for assertions)

    def __post_init__(self) -> None:
        if self.method not in ("exchange", "write"):
            raise ValueError(f"method must be 'exchange' or 'write', got {self.method!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if self.action.startswith("corrupt") and self.method != "exchange":
            raise ValueError("corruption is injected into staging, i.e. into 'exchange'")


def flip_bits(staging: Sequence[torch.Tensor], row: int, tensors: Sequence[int],
              rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """Flip one random bit at one random byte offset of row `row` of each tensor in
    `tensors`; returns [(tensor, byte offset, bit)]."""
    done = []
    for i in tensors:
        flat = staging[i][row].reshape(-1).view(torch.uint8)  # a view: staging is contiguous
        off, bit = int(rng.integers(flat.numel())), int(rng.integers(8))
        flat[off] ^= 1 << bit
        done.append((i, off, bit))
    return done


class FaultyTransport(TransportBase):
    """A transport that delegates to `real` and injects `faults` (see `Fault`).

    Every member of `Transport` is spelled out: `exchange` and `write` (the mover's write
    of a layer from staging) inject faults and then call the real transport's; `settle`,
    `can_move`, `move`, `close`, `name`, `exchange_launches_no_kernels` and `hold` are the
    real transport's. `calls`: per method, the calls so far on this rank; `stall_event`:
    what a stall waits on (set it to release a stall early)."""

    def __init__(self, real: Transport, rank: int, faults: Sequence[Fault] = ()) -> None:
        self.real = real
        self.rank = rank
        self.faults = list(faults)
        self.calls = {"exchange": 0, "write": 0}
        self.stall_event = threading.Event()
        self.stalls: list[float] = []  # seconds each stall actually blocked

    @property
    def name(self) -> str:
        return self.real.name

    @property
    def exchange_launches_no_kernels(self) -> bool:
        return self.real.exchange_launches_no_kernels

    @property
    def hold(self):
        return self.real.hold

    def __repr__(self) -> str:
        return f"FaultyTransport({self.real!r}, faults={len(self.faults)})"

    def _due(self, method: str) -> list[Fault]:
        self.calls[method] += 1
        n = self.calls[method]
        return [f for f in self.faults if f.method == method and f.call in (None, n)
                and (f.ranks is None or self.rank in f.ranks)]

    def _before(self, fault: Fault) -> None:
        a = fault.action
        if a == "raise":
            fault.fired.append("raise")
            raise InjectedFault(fault.message or f"injected {fault.method} failure "
                                                 f"(call {self.calls[fault.method]}, rank {self.rank})")
        if a == "stall":
            t0 = time.monotonic()
            self.stall_event.wait(fault.seconds)
            self.stalls.append(time.monotonic() - t0)
            fault.fired.append("stall")
        elif a == "kill":
            os._exit(17)
        elif a == "sleep_then_kill":
            time.sleep(fault.seconds)
            os._exit(17)
        elif a == "freeze":
            time.sleep(fault.seconds)

    def exchange(self, plan, weights, group, staging) -> int:
        due = self._due("exchange")
        for f in due:
            if not f.action.startswith("corrupt"):
                self._before(f)
        got = self.real.exchange(plan, weights, group, staging)
        for f in due:
            if f.action.startswith("corrupt"):
                if plan.num_staged == 0:
                    raise AssertionError("a corruption fault fired on a layer with nothing staged")
                rng = np.random.default_rng([f.seed, self.rank, self.calls["exchange"]])
                row = int(rng.integers(plan.num_staged))
                tensors = [1] if f.action == "corrupt_w2" else list(range(len(staging)))
                f.fired.append((row, flip_bits(staging, row, tensors, rng)))
        return got

    def settle(self, plan, group) -> None:
        self.real.settle(plan, group)

    def write(self, plan, weights, staging) -> None:
        for f in self._due("write"):
            self._before(f)
        self.real.write(plan, weights, staging)

    def can_move(self, weights) -> bool:
        return self.real.can_move(weights)

    def move(self, plan, weights, group) -> int:
        return self.real.move(plan, weights, group)

    def close(self) -> None:
        self.real.close()


def p2p_transport(faults: Sequence[Fault] = (), rank: int = 0) -> FaultyTransport:
    """A FaultyTransport around the point-to-point transport ("nccl": gloo on CPU)."""
    from eplb.runtime.transport_choice import make_transport

    return FaultyTransport(make_transport("nccl"), rank, faults)


def every_rank_moves(old_p2l: np.ndarray, new_p2l: np.ndarray, num_ranks: int) -> bool:
    """Every rank has a non-empty transfer plan in every layer of old -> new (so every
    rank calls its transport once per layer, and call counts mean the same layer)."""
    from eplb.core.transfer_plan import plan_layer_transfer

    return all(not plan_layer_transfer(o, n, num_ranks, r).is_noop
               for o, n in zip(old_p2l, new_p2l) for r in range(num_ranks))


def moving_target(old_p2l: np.ndarray, num_ranks: int, N: int, seed: int) -> np.ndarray:
    """A random target [L, P] (same on every rank for the same seed) in which every rank's
    slots change in every layer; each layer keeps exactly the multiset of experts."""
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        new = np.stack([np.roll(rng.permutation(row), 1) for row in old_p2l])
        if every_rank_moves(old_p2l, new, num_ranks):
            return new
    raise AssertionError("no target found that changes every rank in every layer")


class PolicySwitch:
    """A policy registered under `name` that plans like `base` until `arm(error)`, then
    raises `error` on every call (rank 0 plans: every rank fails through the broadcast's
    status flag). Registered once per process; `get(name, base)` returns it."""

    _made: dict[str, "PolicySwitch"] = {}

    def __init__(self, name: str, base: str) -> None:
        from eplb.core.policy.registry import register_policy

        self.name, self.base = name, base
        self.error: BaseException | None = None
        self.calls = 0
        register_policy(name)(self)

    @classmethod
    def get(cls, name: str, base: str = "default") -> "PolicySwitch":
        made = cls._made.get(name)
        if made is None:
            made = cls._made[name] = cls(name, base)
        assert made.base == base, (name, made.base, base)
        return made

    def arm(self, error: BaseException) -> None:
        self.error = error

    def disarm(self) -> None:
        self.error = None

    def __call__(self, *args, **kwargs):
        from eplb.core.policy.registry import get_policy

        self.calls += 1
        if self.error is not None:
            raise self.error
        return get_policy(self.base)(*args, **kwargs)

