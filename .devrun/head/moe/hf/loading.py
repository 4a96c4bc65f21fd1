"""`from_pretrained`: load a transformers MoE checkpoint expert-parallel, each rank
reading from the safetensors files only the experts of its own slots.

Non-expert weights load as usual. Expert weights come in one of two checkpoint layouts:
* per expert (`...experts.<e>.gate_proj.weight`, the Hugging Face hub format for Qwen,
  Mixtral, OLMoE, DeepSeek): a rank reads the keys of its slots' experts and renumbers
  them to its local slots 0..S-1, so transformers' own conversion stacks exactly S;
* stacked (`...experts.gate_up_proj [N, ...]`, e.g. GPT-OSS): a rank reads only its
  slots' rows of each tensor.
While transformers builds the model, each `*Experts` class cuts its stacked parameters to
S slots right after its own `__init__` (on the meta device, before any weight exists), so
no rank ever allocates the other ranks' experts.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import threading

import torch
import torch.distributed as dist

try:  # installed with transformers (the `hf` extra)
    from safetensors import safe_open
except ImportError:  # pragma: no cover - the error is raised in from_pretrained
    safe_open = None

from ..state import default_group
from .experts import find_experts_modules, keep_local_slots, slot_experts, stacked_names
from .model import ExpertParallelModel, expert_parallel

log = logging.getLogger("moe.hf")

PER_EXPERT_KEY = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")  # prefix, expert, suffix


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a local checkpoint directory (sharded or not)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json; "
                     "moe.hf.from_pretrained reads safetensors checkpoints")


def read_state_dict(files: list[str], experts: list[int], num_experts: int,
                    stacked_prefixes: set[str]) -> tuple[dict[str, torch.Tensor], int]:
    """The state dict this rank loads, and the bytes of expert weights it read.

    experts: the logical expert of each local slot (slot order). Per-expert keys of
    expert e become one key per local slot holding e (renumbered to the slot); stacked
    expert tensors (a key under one of `stacked_prefixes` with dim 0 = N) keep only the
    rows `experts`; every other key is read whole."""
    state: dict[str, torch.Tensor] = {}
    expert_bytes = 0
    slots_of: dict[int, list[int]] = {}
    for s, e in enumerate(experts):
        slots_of.setdefault(e, []).append(s)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                match = PER_EXPERT_KEY.match(key)
                if match:
                    slots = slots_of.get(int(match.group(2)))
                    if slots:
                        t = f.get_tensor(key)
                        expert_bytes += t.numel() * t.element_size()
                        for s in slots:
                            state[f"{match.group(1)}{s}{match.group(3)}"] = t
                    continue
                sliced = f.get_slice(key)
                shape = sliced.get_shape()
                if key.rsplit(".", 1)[0] in stacked_prefixes and shape and shape[0] == num_experts:
                    rows = {e: sliced[e] for e in slots_of}  # each [...] read once
                    expert_bytes += sum(r.numel() * r.element_size() for r in rows.values())
                    state[key] = torch.stack([rows[e] for e in experts])  # [S, ...]
                else:
                    state[key] = f.get_tensor(key)
    return state, expert_bytes


_CUT_LOCK = threading.Lock()  # the patch below is process-wide: one loading at a time


@contextlib.contextmanager
def cut_at_init(classes: set[type], experts: list[int]):
    """While active, every new instance of `classes` keeps only the rows `experts` of
    its stacked tensors, right after its own `__init__` (on the meta device). Patches the
    classes process-wide; a lock keeps two loadings in one process from overlapping."""
    with _CUT_LOCK:
        with _patched_inits(classes, experts):
            yield


@contextlib.contextmanager
def _patched_inits(classes: set[type], experts: list[int]):
    originals = {cls: cls.__init__ for cls in classes}

    def patched(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            keep_local_slots(self, stacked_names(type(self).__name__, self)[1], experts)
        return __init__

    for cls, original in originals.items():
        cls.__init__ = patched(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.__init__ = original


def from_pretrained(path: str, num_redundant_experts: int,
                    group: dist.ProcessGroup | None = None, *,
                    model_class: type | None = None, **hf_kwargs) -> ExpertParallelModel:
    """Load the checkpoint at `path` (a local directory) expert-parallel over `group`:
    every rank calls it; each reads only its own slots' experts (see the module doc).
    `model_class` defaults to the `AutoModelForCausalLM` class of the config;
    `hf_kwargs` go to transformers' `from_pretrained` (e.g. dtype=torch.bfloat16).
    Returns what `expert_parallel(model, num_redundant_experts, group)` returns, with
    `expert_bytes_read` set to the bytes of expert weights this rank read."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ImportError("moe.hf.from_pretrained needs transformers: "
                          "pip install -e '.[hf]'") from e
    if safe_open is None:
        raise ImportError("moe.hf.from_pretrained needs safetensors: pip install -e '.[hf]'")
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a local directory; download the checkpoint first "
                         "(huggingface-cli download) and pass its directory")
    config = hf_kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    cls = model_class or AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        skeleton = cls._from_config(config)  # shapes only, no memory: which modules, N
    found = [(n, m, *stacked_names(n, m)) for n, m in find_experts_modules(skeleton)]
    N = found[0][2]
    group = default_group(group)
    W = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    P = N + num_redundant_experts
    if P % W:
        raise ValueError(f"num_redundant_experts: {N} experts + {num_redundant_experts} "
                         f"redundant = {P} slots do not split over {W} ranks")
    experts = slot_experts(N, P, rank, P // W)
    state, expert_bytes = read_state_dict(checkpoint_files(path), experts, N,
                                          {name for name, *_ in found})
    del skeleton
    with cut_at_init({type(m) for _, m, *_ in found}, experts):
        model = cls.from_pretrained(None, config=config, state_dict=state, **hf_kwargs)
    del state
    ep = expert_parallel(model, num_redundant_experts, group)
    ep.expert_bytes_read = expert_bytes
    log.info("moe.hf: rank %d read %.1f MiB of expert weights (%d of %d experts)", rank,
             expert_bytes / 2**20, len(set(experts)), N)
    return ep
