"""Old module paths, kept importable with a DeprecationWarning.

Until 0.2 the package was flat (`eplb.transfer`, `eplb.server`, ...). The modules now
live in `eplb.core`, `eplb.runtime` and `eplb.ops`; `import eplb.transfer` still works and
gives the very module object `eplb.runtime.transfer` (so patching one patches the other),
with a warning naming the new path. Public names imported from `eplb` itself are
unchanged.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    **{f"eplb.{m}": f"eplb.core.{m}" for m in (
        "config", "loadio", "placement", "planning", "policy", "transfer_plan", "simulate",
        "workload")},
    **{f"eplb.{m}": f"eplb.runtime.{m}" for m in (
        "placement_change", "transfer", "transports", "control", "recorder", "resize",
        "planner_process")},
    **{f"eplb.{m}": f"eplb.ops.{m}" for m in (
        "server", "metrics", "cli", "demo", "demo_hf", "launch", "progress")},
}


def new_name(old: str) -> str | None:
    """The current name of the module once called `old` (submodules of a moved package
    included, e.g. eplb.policy.deepseek), or None when `old` did not move."""
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:  # already executed under its new name
        pass

    def get_code(self, fullname):  # `python -m eplb.demo` runs eplb.ops.demo as __main__
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; import it from there (the old path goes "
                      f"away in a later release)", DeprecationWarning, stacklevel=3)
        spec = importlib.util.spec_from_loader(fullname, _Alias(new))
        return spec


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder: one module per file
