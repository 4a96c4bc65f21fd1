"""What every placement policy shares: its signature (`PolicyFn`), its knobs (`PolicyOptions`)
and the default move tolerance. Depends on nothing else in the package, so that
`eplb.core.config` and the runtime can name these without loading a planner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union

import numpy as np

from eplb.core.placement import Placement


DEFAULT_MOVE_TOLERANCE = 0.03  # the same default as EplbConfig.move_tolerance (see there)
# decode-aware packing: what one more token on the busiest GPU costs in its dispatch and
# combine, in tokens of expert work (see eplb.core.policy.balanced.reads; measured in
# benchmarks/README.md, issue 29, "Target 3")
DEFAULT_DISPATCH_TOKENS = 40.0
# decode-aware packing in the runtime (EplbConfig.read_tokens): a weight read costs this
# many tokens of expert work (same section of benchmarks/README.md)
DEFAULT_READ_TOKENS = 100.0
# decode-aware packing: a grouped GEMM reads an expert's weights once per tile of this many
# of its tokens (the 128-row tiles measured on an H200, benchmarks/README.md, issue 29)
DEFAULT_TILE_ROWS = 128.0


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs every policy receives (a policy may ignore what it does not support)."""

    move_tolerance: float = DEFAULT_MOVE_TOLERANCE  # extra relative imbalance accepted to keep experts in place
    weighted: bool = False  # return (physical_to_logical, shares) with per-slot shares
    read_tokens: float = 0.0  # decode-aware packing: a weight read costs this many tokens (0 = off)
    step_choices: float = 0.0  # token-expert choices per step and layer (what read_tokens is set against)
    dispatch_tokens: float = DEFAULT_DISPATCH_TOKENS  # decode-aware packing: a token more on the busiest GPU's all-to-all
    tile_rows: float = DEFAULT_TILE_ROWS  # decode-aware packing: tokens per weight read of a slot (0: one read per slot)


class PolicyFn(Protocol):
    def __call__(
        self,
        load: np.ndarray,  # [L, N] float64, finite, >= 0
        num_slots: int,  # P, a multiple of num_gpus, >= N
        num_gpus: int,  # M, a multiple of num_nodes
        num_nodes: int,
        num_groups: int,  # N % num_groups == 0
        previous: Optional[Placement],  # current placement, same L, N, P, M; or None
        options: PolicyOptions,
    ) -> Union[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        # [L, P] int64 physical_to_logical, or (that, shares [L, P] float64)
        ...
