"""Decode-aware packing in the runtime (issue 29, target 3): the planner gets the config's
`read_tokens` and `dispatch_tokens` and the tokens per step of the recorded window (its
load over the steps it covers, decay-weighted), computed here from the counts the test
recorded; `read_tokens` 0 turns it off."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _dist import device_for, run_distributed
from eplb.runtime.recorder import LoadRecorder

L, N, R = 2, 8, 2
OPTIONS: list = []  # the PolicyOptions rank 0's planner was called with


def _recording_policy(load, num_slots, num_gpus, num_nodes, num_groups, previous, options=None):
    from eplb.core.policy.registry import get_policy

    OPTIONS.append(options)
    return get_policy("default")(load, num_slots, num_gpus, num_nodes, num_groups, previous, options)


def _body(rank, world, read_tokens, decay):
    from eplb.core.config import EplbConfig
    from eplb.core.policy.registry import available_policies, register_policy
    from eplb.runtime import EplbRuntime
    from moe import MoEArgs, MoEModel
    import torch.distributed as dist

    if "test-reads-recording" not in available_policies():
        register_policy("test-reads-recording")(_recording_policy)
    device = device_for(rank)
    args = MoEArgs(hidden_size=16, intermediate_size=8, num_layers=L, num_experts=N, top_k=2,
                   num_redundant_experts=R)
    cfg = EplbConfig(num_redundant_experts=R, window_size=4, rebalance_interval=6, control_interval=0,
                     min_gain=0.0, shift_threshold=0.0, load_decay=decay, read_tokens=read_tokens,
                     dispatch_tokens=12.5, tile_rows=64.0, policy="test-reads-recording")
    rt = EplbRuntime(MoEModel(args, group=dist.group.WORLD, device=device), cfg, group=dist.group.WORLD)
    P = N + R
    totals = []  # [steps] token-expert choices per step and layer, summed over the ranks
    for step in range(1, 7):
        counts = torch.zeros(L, P, dtype=torch.int64)
        counts[:, :N] = torch.arange(1, N + 1) * step  # a different load every step
        counts[1] *= 3  # and per layer
        totals.append(counts.sum(1).numpy() * world)  # [L]: every rank counts the same
        rt.expert_load_pass.copy_(counts.to(device))
        rt.step()
    rt.close()
    if rank == 0:
        assert len(OPTIONS) == 1, OPTIONS
        opt = OPTIONS[0]
        # the window is the last 4 steps (3..6), the newest weighted decay**0
        w = np.array([decay ** k for k in range(4)])  # ages 0..3 = steps 6, 5, 4, 3
        per_step = np.array(totals[2:][::-1])  # [4, L] newest first
        want = float((w[:, None] * per_step).sum(0).mean() / w.sum())
        # the tokens per step go to the planner whether or not decode-aware packing is on
        # (its heavy-replica check uses them too)
        assert opt.step_choices == pytest.approx(want, rel=1e-12), (opt.step_choices, want)
        if read_tokens:
            assert opt.read_tokens == read_tokens and opt.dispatch_tokens == 12.5 and opt.tile_rows == 64.0
        else:
            assert opt.read_tokens == 0.0


@pytest.mark.parametrize("read_tokens, decay", [(100.0, 1.0), (250.0, 0.5), (0.0, 1.0)])
def test_runtime_plans_with_the_windows_tokens_per_step(read_tokens, decay):
    run_distributed(_body, 2, read_tokens, decay)


def test_window_steps_counts_the_steps_the_window_adds_up():
    rec = LoadRecorder(1, 4, 1, 4, window_size=5, device=torch.device("cpu"))
    assert rec.window_steps() == 0.0
    for _ in range(3):
        rec.record(torch.ones(1, 4, dtype=torch.int64), torch.arange(4).view(1, 4))
    assert rec.window_steps() == 3.0
    assert rec.window_steps(0.5) == pytest.approx(1 + 0.5 + 0.25)
    for _ in range(4):  # the window is full: its 5 newest steps
        rec.record(torch.ones(1, 4, dtype=torch.int64), torch.arange(4).view(1, 4))
    assert rec.window_steps() == 5.0
    assert rec.window_steps(0.5) == pytest.approx(sum(0.5 ** k for k in range(5)))
    rec.on_plan()
    rec.record(torch.ones(1, 4, dtype=torch.int64), torch.arange(4).view(1, 4))
    assert rec.window_steps(since_plan=True) == 1.0
    # what window_load sums over these steps is window_steps times one step's load
    logical, _ = rec.window_load(decay=0.5)
    assert float(logical.sum()) == pytest.approx(4 * rec.window_steps(0.5))
