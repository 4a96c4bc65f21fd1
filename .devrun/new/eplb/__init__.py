"""eplb: an expert-parallel load balancer runtime for Mixture-of-Experts models.

Three layers: `eplb.core` (pure planning), `eplb.runtime` (the distributed runtime) and
`eplb.ops` (CLI, HTTP, metrics, demos); `eplb.protocol` is the model's side of the
contract. docs/architecture.md draws the picture.
"""
from eplb.core.config import EplbConfig
from eplb.core.placement import Placement
from eplb.core.planning import plan
from eplb.core.policy.registry import available_policies, register_policy
from eplb.protocol import MixtureOfExperts, MoELayerProtocol
from eplb.runtime import EplbFatalError, EplbRuntime, RebalanceError, RebalanceEvent

__version__ = "0.1.0"
__all__ = ["EplbConfig", "EplbFatalError", "EplbRuntime", "MixtureOfExperts", "MoELayerProtocol", "Placement",
           "RebalanceError", "RebalanceEvent", "available_policies", "plan", "register_policy"]
