"""eplb: an expert-parallel load balancer runtime for Mixture-of-Experts models."""
from eplb.config import EplbConfig
from eplb.placement import Placement
from eplb.planning import plan
from eplb.policy import available_policies, register_policy
from eplb.protocol import MixtureOfExperts, MoELayerProtocol
from eplb.runtime import EplbFatalError, EplbRuntime, RebalanceError, RebalanceEvent

__version__ = "0.1.0"
__all__ = ["EplbConfig", "EplbFatalError", "EplbRuntime", "MixtureOfExperts", "MoELayerProtocol", "Placement",
           "RebalanceError", "RebalanceEvent", "available_policies", "plan", "register_policy"]
