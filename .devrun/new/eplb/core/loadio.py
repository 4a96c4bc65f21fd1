"""Expert-load input: turn an array or a file into a clean `[L, N]` float64 load matrix.

A load is tokens routed to each logical expert, `[L, N]`, or a time series `[T, L, N]`
that is summed over T. Files: `.npy`, `.json` (`{"logical_count": ...}` or a bare nested
list) and `.pt` (SGLang's expert-distribution dump `{"logical_count": tensor, ...}` or a
bare tensor). Every problem is one `ValueError` line that names the source.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

# Size limits, checked before anything is allocated (a file header can claim any shape).
MAX_EXPERTS = 1 << 16  # N: logical experts per layer (real models: 8 .. 512)
MAX_SLOTS = 1 << 16  # P: physical slots per layer
MAX_LOAD_ELEMENTS = 1 << 27  # T * L * N of one load file (1 GiB of float64)


def as_load(x: Any, source: str = "load") -> np.ndarray:  # -> [L, N] float64
    """Check and convert a numpy array, torch tensor or nested list to `[L, N]` float64."""
    if hasattr(x, "detach") and hasattr(x, "dtype"):  # torch tensor, without importing torch
        if x.dtype.is_complex or not (x.dtype.is_floating_point or _is_torch_int(x.dtype)):
            raise ValueError(f"{source}: load must be numeric, got tensor of {x.dtype}")
        x = x.detach().cpu().double().numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: load is not a rectangular numeric array ({e})".replace("\n", " ")) from None
    if arr.ndim in (2, 3) and arr.shape[-1] > MAX_EXPERTS:
        raise ValueError(f"{source}: load has {arr.shape[-1]} experts per layer, more than {MAX_EXPERTS}")
    if arr.dtype == object:
        raise ValueError(f"{source}: load is not a rectangular numeric array")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{source}: load must be numeric, got dtype {arr.dtype}")
    if arr.ndim not in (2, 3):
        raise ValueError(f"{source}: load must be [L, N] or [T, L, N], got {arr.ndim}-D shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{source}: load is empty, shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"{source}: load contains NaN or inf")
    if (arr < 0).any():
        raise ValueError(f"{source}: load contains negative values (min {arr.min():g})")
    if arr.ndim == 3:
        arr = arr.sum(0)
    return np.ascontiguousarray(arr)  # [L, N]


def _is_torch_int(dtype: Any) -> bool:
    import torch

    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def read_load(path: str | Path) -> np.ndarray:  # -> [L, N] float64
    """Read a load file (`.npy`, `.json` or `.pt`) into `[L, N]` float64."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: load file not found")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: load file is empty")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        raw = _read_npy(path)
    elif suffix == ".json":
        raw = _read_json(path)
    elif suffix == ".pt":
        raw = _read_pt(path)
    else:
        raise ValueError(f"{path}: unknown load file type {suffix!r}; use .npy, .json or .pt")
    return as_load(raw, str(path))


def _read_npy(path: Path) -> np.ndarray:
    try:
        arr = load_npy_checked(path)
    except Exception as e:  # truncated header, pickled objects, not an npy file at all
        raise ValueError(f"{path}: not a readable .npy array ({_one_line(e)})") from None
    return arr


def load_npy_checked(path: Path, max_elements: int = MAX_LOAD_ELEMENTS) -> np.ndarray:
    """`np.load` without pickles that maps the file first, so a header claiming a huge
    shape (or a truncated body) fails before any allocation; ValueError if over the limit."""
    arr = np.load(path, mmap_mode="r", allow_pickle=False)
    if arr.size > max_elements:
        raise ValueError(f"array of shape {tuple(arr.shape)} is too large "
                         f"({arr.size} elements, limit {max_elements})")
    return np.array(arr)


def _read_json(path: Path) -> Any:
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({_one_line(e)})") from None
    if isinstance(doc, dict):
        if "logical_count" not in doc:
            raise ValueError(f"{path}: JSON object lacks 'logical_count'")
        doc = doc["logical_count"]
    if not isinstance(doc, list):
        raise ValueError(f"{path}: expected nested lists of counts, got {type(doc).__name__}")
    if not _all_numbers(doc):
        raise ValueError(f"{path}: load holds non-numeric entries")
    return doc


def _all_numbers(x: Any) -> bool:
    """True if a nested list holds only ints/floats (bools and strings are rejected)."""
    if isinstance(x, list):
        return all(_all_numbers(v) for v in x)
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def torch_load_weights_only(path: str | Path, what: str = ".pt") -> Any:
    """`torch.load(path, weights_only=True)` on the CPU, quietly: the warnings torch emits
    while unpickling (e.g. its multi-line "Detected pickle protocol" text) are captured, and
    a file it refuses or cannot read raises one `ValueError` line that names the file and
    folds in the reason, e.g. `x.pt: not a safely loadable .pt file (UnpicklingError:
    refused by weights_only=True: needs the global os.system)`."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # unsafe pickles, truncated zip archives, random bytes
            reason = _torch_load_reason(e, [str(w.message) for w in caught])
            raise ValueError(f"{path}: not a safely loadable {what} file ({reason})") from None


def _torch_load_reason(e: Exception, warned: list[str]) -> str:
    """One short line from torch.load's (long, multi-line) error and captured warnings."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split())
    name = e.__class__.__name__
    found = (re.search(r"unsupported global:? (?:GLOBAL )?(\S+)", text, re.I)
             or re.search(r"unsupported operand (\d+)", text, re.I))
    if found and found.re.pattern.startswith("unsupported global"):
        reason = f"{name}: refused by weights_only=True: needs the global {found.group(1)}"
    elif found:
        reason = f"{name}: refused by weights_only=True: unsupported pickle opcode {found.group(1)}"
    elif "weights only load failed" in text.lower():
        reason = f"{name}: refused by weights_only=True"
    else:
        first = re.split(r"(?<=[.;?!])\s", text, maxsplit=1)[0].strip(" .;")
        reason = f"{name}: {first[:120]}" if first else name
    for w in warned:
        m = re.search(r"pickle protocol (\d+)", w)
        if m:
            reason += f"; a plain pickle of protocol {m.group(1)}, not a torch.save file"
            break
    return reason


def _read_pt(path: Path) -> Any:
    import torch

    obj = torch_load_weights_only(path)
    if isinstance(obj, dict):
        if "logical_count" not in obj:
            raise ValueError(f"{path}: .pt dict lacks 'logical_count' (keys: {sorted(map(str, obj))})")
        obj = obj["logical_count"]
    if isinstance(obj, list):
        if not _all_numbers(obj):
            raise ValueError(f"{path}: load holds non-numeric entries")
    elif not isinstance(obj, torch.Tensor):
        raise ValueError(f"{path}: expected a tensor or {{'logical_count': tensor}}, got {type(obj).__name__}")
    return obj


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or e.__class__.__name__
