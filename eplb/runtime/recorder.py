"""LoadRecorder: a sliding window of per-step expert load, kept on the device.

Each `record()` turns the forward pass's physical counts `[L, P]` into logical
counts `[L, N]` (with the placement in force while they were counted) and per-GPU
counts `[L, M]`, writes them into ring buffers and zeroes the pass, all as tensor
ops: no host synchronisation per step. `window_load()` sums the window (optionally
weighting older steps less, `decay`) and does the one all-reduce a rebalance needs.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from eplb.runtime.control import agree

log = logging.getLogger("eplb.runtime")


class LoadRecorder:
    def __init__(self, num_layers: int, num_logical: int, num_gpus: int, slots_per_gpu: int,
                 window_size: int, device: torch.device):
        L, N, M = num_layers, num_logical, num_gpus
        self.num_gpus, self.slots_per_gpu = M, slots_per_gpu
        self.window_size = window_size
        self.logical_ring = torch.zeros(window_size, L, N, dtype=torch.int64, device=device)  # [W, L, N]
        self.gpu_ring = torch.zeros(window_size, L, M, dtype=torch.int64, device=device)  # [W, L, M]
        self.steps_recorded = 0  # all steps ever recorded
        self.gpu_steps = 0  # steps in gpu_ring since the last placement change
        self.plan_steps = 0  # steps since the last plan (`on_plan`), applied or skipped

    @property
    def fill(self) -> int:
        """Steps currently in the window."""
        return min(self.steps_recorded, self.window_size)

    def record(self, load_pass: torch.Tensor, physical_to_logical: torch.Tensor) -> None:
        """Fold one step's counts `load_pass [L, P]` into the window, then zero it in place."""
        i = self.steps_recorded % self.window_size
        L, P = load_pass.shape
        logical = self.logical_ring[i]  # [L, N]
        logical.zero_()
        logical.scatter_add_(1, physical_to_logical, load_pass.to(torch.int64))
        torch.sum(load_pass.view(L, self.num_gpus, self.slots_per_gpu), dim=-1, out=self.gpu_ring[i])
        load_pass.zero_()
        self.steps_recorded += 1
        self.gpu_steps += 1
        self.plan_steps += 1

    @property
    def steps_since_plan(self) -> int:
        """Steps recorded since the last plan under the placement in force, at most the window:
        what shift detection measures (`window_load(since_plan=True)`)."""
        return min(self.plan_steps, self.gpu_steps, self.window_size)

    @property
    def window_is_new(self) -> bool:
        """Whether every step of the window was recorded since the last plan (it shares no
        step with the window that plan saw): `SteadyMemory` adds up such windows only."""
        return self.plan_steps >= self.fill

    def on_plan(self) -> None:
        """A rebalance planned (applied or skipped): shift detection measures from here."""
        self.plan_steps = 0

    def any_load(self) -> bool:
        """Whether this rank's window holds any load (one host read: not for every step)."""
        return bool(self.logical_ring.any())

    def warn_if_no_load(self, control_group, rank: int, steps: int) -> None:
        """Warn (rank 0) when no rank recorded any load so far: the model is not counting
        into `expert_load_view`. One host read and, with several ranks, one agreement on
        the control group: collective, call it at one step on every rank."""
        seen = self.any_load()
        if self.num_gpus > 1:  # the EP ranks
            seen = agree(seen, control_group)
        if not seen and rank == 0:
            log.warning("eplb: the model recorded no load in %d steps: expert_load_view is "
                        "still all zero; the model must add the tokens each slot receives into "
                        "the load view it was given (see docs/bring-your-own-model.md); "
                        "rebalancing is held off until it does", steps)

    def last_gpu_load(self) -> torch.Tensor:  # [L, M]
        """This rank's per-GPU counts of the most recent step (not reduced over ranks)."""
        return self.gpu_ring[(self.steps_recorded - 1) % self.window_size]

    def window_load(self, group: dist.ProcessGroup | None = None, decay: float = 1.0,
                    since_plan: bool = False, moment: bool = False) -> tuple[torch.Tensor, ...]:
        """Window sums over all ranks: logical `[L, N]` and measured per-GPU `[L, M]`; with
        `moment`, also the logical counts weighted by step age (`local_moment`, `[L, N]`
        int64, in the same all-reduce: what a drifting load's trend is fitted from).

        `decay` weights the logical counts of the step `k` steps older than the newest by
        `decay**k` (age 0 = the newest step); 1.0 is the plain window sum and returns int64,
        anything else float64 (weights and sums in float64 on the device). The per-GPU part
        is always a plain sum and covers only steps since the last placement change (older
        steps were counted under another placement). One all-reduce, nothing leaves the
        device. `since_plan`: both cover only the `steps_since_plan` last steps, logical
        counts as a plain sum (what shift detection measures and an early rebalance plans on).
        """
        logical, gpu = self.local_window(decay, since_plan)  # [L, N], [L, M]
        parts = [logical, gpu.to(logical.dtype)] + ([self.local_moment().to(logical.dtype)] if moment else [])
        both = torch.cat(parts, dim=1)  # [L, N + M (+ N)]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(both, group=group)
        N, M = logical.shape[1], gpu.shape[1]
        # per-GPU sums (and age-weighted counts) are integers below 2**53, exact in float64
        out = (both[:, :N], both[:, N:N + M].to(torch.int64))
        return out + (both[:, N + M:].to(torch.int64),) if moment else out

    def local_moment(self) -> torch.Tensor:  # [L, N] int64
        """This rank's logical counts of the window weighted by each step's age: 0 for the
        newest step, `fill - 1` for the oldest (`trend.trend_load`'s `moment`)."""
        W = self.window_size
        newest = (self.steps_recorded - 1) % W
        age = (newest - torch.arange(W, device=self.logical_ring.device)) % W  # [W] (unfilled entries are 0)
        # elementwise, not tensordot: CUDA has no int64 matmul
        return (age.view(W, 1, 1) * self.logical_ring).sum(0)  # [L, N]

    def local_window(self, decay: float = 1.0, since_plan: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of `window_load`: the same sums, on the device, before the
        all-reduce (`EplbMetrics` folds them into its own one all-reduce). Logical `[L, N]`
        (int64, or float64 weighted decay**age when decay < 1) and per-GPU `[L, M]` int64
        over the steps since the last placement change (at most the window)."""
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        W = self.window_size
        n_gpu = self.steps_since_plan if since_plan else min(self.gpu_steps, W)
        # ring entries of the last n_gpu steps, indexed on the device (no host-to-device copy,
        # which would wait for the work queued on the stream)
        idx = (self.steps_recorded - 1 - torch.arange(n_gpu, device=self.gpu_ring.device)) % W  # [n]
        if since_plan:
            logical = self.logical_ring.index_select(0, idx).sum(0)  # [L, N] int64
        elif decay == 1:
            logical = self.logical_ring.sum(0)  # [L, N] int64
        else:
            # ring entry i was written `age` steps before the newest one; unfilled entries are 0
            newest = (self.steps_recorded - 1) % W
            age = (newest - torch.arange(W, device=self.logical_ring.device)) % W  # [W]
            weight = torch.pow(torch.full((W,), float(decay), dtype=torch.float64,
                                          device=age.device), age)  # [W]
            logical = torch.tensordot(weight, self.logical_ring.to(torch.float64), dims=1)  # [L, N]
        gpu = self.gpu_ring.index_select(0, idx).sum(0)  # [L, M] (zeros when n_gpu == 0)
        return logical, gpu

    def window_steps(self, decay: float = 1.0, since_plan: bool = False) -> float:
        """How many steps `window_load` (same arguments) adds up, decay**age-weighted: its
        logical sum over this is one step's load (what decode-aware packing sets weight
        reads against: `EplbConfig.read_tokens`)."""
        if since_plan:
            return float(self.steps_since_plan)
        n = self.fill
        return float(n) if decay == 1 else float(sum(float(decay) ** k for k in range(n)))

    def warm_up(self, group: dist.ProcessGroup | None = None, decay: float = 1.0) -> None:
        """Run `window_load`'s kernels once and record nothing (collective like it). On a
        GPU each kernel's first launch loads its module, which should not happen inside the
        step that starts the first rebalance; with no step recorded yet the per-GPU part
        would launch nothing, so it is run over one (all-zero) ring entry."""
        saved = self.gpu_steps
        self.gpu_steps = max(1, saved)
        try:
            self.window_load(group, decay, moment=True)  # the drift trend's kernels too
        finally:
            self.gpu_steps = saved

    def on_placement_change(self) -> None:
        """Per-GPU counts from before a rebalance describe the old placement: drop them."""
        self.gpu_steps = 0
        self.gpu_ring.zero_()
