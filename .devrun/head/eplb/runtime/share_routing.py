"""How the model splits an expert's tokens over its replicas, as the runtime drives it.
`ShareRouting` registers the runtime's `logical_replica_cdf` with a model that has the
optional weighted-replicas extension (`eplb.protocol.SupportsReplicaWeights`) only while
routing may need it, says which placement the model really routes (`realised`: the even
split without the extension), and warns once when a placement's uneven shares are
ignored."""
from __future__ import annotations

import logging

import numpy as np
import torch

from eplb.core.placement import Placement
from eplb.protocol import supports_replica_weights

log = logging.getLogger("eplb.runtime")

__all__ = ["ShareRouting", "has_uneven_shares"]


class ShareRouting:
    """The model's replica split under one runtime. `cdf`: the runtime's
    `logical_replica_cdf [L, N, R]` (rewritten in place only); `rank`: who logs.
    `weighted` (`EplbConfig.weighted_replicas`, as the runtime's config says then) is
    passed to each call."""

    def __init__(self, model, cdf: torch.Tensor, rank: int) -> None:
        self.model = model
        self.cdf = cdf  # [L, N, R]
        self.rank = rank
        self.supported = supports_replica_weights(model)
        self._registered = False  # whether the model routes by the cdf now
        self._warned = False

    def update(self, current: Placement, weighted: bool, coming: Placement | None = None) -> None:
        """Register the cdf with the model only while routing may need it: when `weighted`
        (the config plans weighted replicas), or `current` (or `coming`, about to be applied) has uneven
        shares. Otherwise register None: the model then takes its even-split path, which
        picks bitwise the replicas the cdf path picks for even rows
        (`moe.dispatch.weighted_replica`) in a few kernels instead of ~20, a large part of
        a decode step's host time."""
        if not self.supported:
            return
        want = (weighted or has_uneven_shares(current)
                or (coming is not None and has_uneven_shares(coming)))
        if want != self._registered:
            self.model.set_eplb_replica_weights(self.cdf if want else None)
            self._registered = want

    def adopted(self, new: Placement, weighted: bool) -> None:
        """`new` is now in force: warn once if the model ignores its uneven shares, and
        register or drop the cdf for it."""
        if not self.supported and has_uneven_shares(new):
            self._warn_even_split()
        self.update(new, weighted)

    def realised(self, placement: Placement) -> Placement:
        """The placement as the model routes it: without the weighted-replicas extension
        every expert's tokens split evenly, whatever shares the placement carries."""
        if self.supported or placement.shares is None:
            return placement
        return placement.with_physical_to_logical(placement.physical_to_logical, placement.policy)

    def _warn_even_split(self) -> None:
        if self._warned:
            return
        self._warned = True
        if self.rank == 0:
            log.warning("%s has no set_eplb_replica_weights (the optional weighted-replicas "
                        "extension of the protocol): it splits every expert's tokens evenly over "
                        "its replicas, so the placement's uneven replica shares are ignored and the "
                        "realised balance is the even-split one, not the planned one",
                        type(self.model).__name__)


def has_uneven_shares(placement: Placement) -> bool:
    """True when the placement's shares differ from an even split over each expert's replicas."""
    if placement.shares is None:
        return False
    even = 1.0 / np.take_along_axis(placement.replica_count(), placement.physical_to_logical, 1)
    return not np.allclose(placement.shares, even, rtol=0, atol=1e-6)
