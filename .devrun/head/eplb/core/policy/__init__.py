"""Placement policies: pure functions of (load, topology, previous) -> physical_to_logical.

- `base`: the `PolicyFn` signature every policy has, `PolicyOptions` (its knobs) and the
  default move tolerance; nothing else in the package is needed to name them;
- `registry`: `register_policy`, `get_policy`, `available_policies`; registers the
  built-in policies below;
- `deepseek`: DeepSeek EPLB as published (the baseline);
- `balanced/`: the default planner, one module per step (see its docstring).

The package itself imports nothing, so importing `base` does not load the planners.
"""
