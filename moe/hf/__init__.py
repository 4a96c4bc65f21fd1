"""Hugging Face transformers MoE models, expert-parallel under the EPLB runtime.

    model = AutoModelForCausalLM.from_pretrained(path)      # or moe.hf.from_pretrained
    ep = moe.hf.expert_parallel(model, num_redundant_experts=2)  # group: the default one
    runtime = eplb.EplbRuntime(ep, eplb.EplbConfig())             # R taken from ep
    out = ep(input_ids); runtime.step()                       # ep.generate(...) works too

Needs the optional extra `transformers` (`pip install -e '.[hf]'`); the core packages
never import it, and this package imports it only where it is used: in
`from_pretrained` and in `moe.hf.configs` (the tiny test models).
"""
from .experts import ExpertParallelExperts, find_experts_modules, slot_experts
from .loading import from_pretrained
from .model import ExpertParallelModel, expert_parallel

__all__ = ["expert_parallel", "from_pretrained", "ExpertParallelModel", "ExpertParallelExperts",
           "find_experts_modules", "slot_experts"]
