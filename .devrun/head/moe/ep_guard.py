"""Guards of the EP forward, shared by the reference `MoELayer` and `moe.hf`'s
`ExpertParallelExperts` (one call, `enter_forward(self)`, in each forward):

* forward counting: each layer counts its forwards (a Python int, no host sync); the
  first MoE layer tells the runtime's `eplb.protocol.ForwardCounter`, registered by
  `set_eplb_forward_counter`, which warns once when the runtime is never stepped and
  lets the runtime compare forward counts across ranks;
* `collective_error`: a failing all-to-all of `moe.dispatch` names the layer, this
  rank's forward number and the rule every EP rank must keep (same number of forwards).
"""
from __future__ import annotations

import torch.distributed as dist

COUNTER_ATTR = "eplb_forward_counter"  # a layer's ForwardCounter (only on the model's layers)
FORWARDS_ATTR = "_eplb_forwards"  # a layer's forwards so far

_current = None  # the EP layer whose forward runs now (the forward is single-threaded)


def enter_forward(layer) -> None:
    """Call at the start of an EP layer's forward (before its collectives)."""
    global _current
    state = layer.__dict__  # plain attributes, also on an nn.Module
    state[FORWARDS_ATTR] = state.get(FORWARDS_ATTR, 0) + 1
    _current = layer
    counter = state.get(COUNTER_ATTR)
    if counter is not None and layer.moe_layer_idx == 0:
        counter.forward(layer.record_load)


def set_forward_counter(layers, counter) -> None:
    """Register the runtime's `ForwardCounter` with every layer (`set_eplb_forward_counter`)."""
    for layer in layers:
        layer.__dict__[COUNTER_ATTR] = counter


def collective_error(error: BaseException) -> RuntimeError:
    """The error to raise (from `error`) when an all-to-all of the EP forward fails."""
    layer = _current
    name = getattr(layer, "name", None) or f"MoE layer {getattr(layer, 'layer_idx', '?')}"
    forward = layer.__dict__.get(FORWARDS_ATTR, "?") if layer is not None else "?"
    try:
        rank = f"rank {dist.get_rank()}"
    except Exception:  # noqa: BLE001 - only for the message
        rank = "this rank"
    return RuntimeError(
        f"{name}: the expert all-to-all failed in forward {forward} of this layer on {rank} "
        f"({type(error).__name__}: {error}); every rank of the EP group must run the same "
        "number of forwards (the same number of generate() steps, the same batches): a "
        "rank that runs an extra forward, or stops early, leaves its peers' collectives "
        "without a partner")
