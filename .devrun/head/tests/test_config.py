"""EplbConfig.verify: invalid values name the field; adjustments are logged. The settings
table of docs/operations.md matches EplbConfig, the CLI and the metrics."""
import dataclasses
import logging
from pathlib import Path

import pytest

from eplb.core.config import EplbConfig, nodes_from_env


def test_valid_config_resolves_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = EplbConfig(num_redundant_experts=4).verify(num_logical_experts=12, num_gpus=4)
    assert c.num_nodes == 2  # 4 ranks, 2 per node


def test_slots_not_divisible_by_gpus_names_field_and_choices():
    # the case vLLM users keep hitting: 256 experts on 3 ranks
    with pytest.raises(ValueError) as e:
        EplbConfig(num_redundant_experts=0).verify(num_logical_experts=256, num_gpus=3)
    msg = str(e.value)
    assert "num_redundant_experts=0" in msg and "divisible" in msg
    assert "valid num_redundant_experts: 2, 5, 8" in msg


@pytest.mark.parametrize("field,value,needle", [
    ("num_redundant_experts", -1, "num_redundant_experts must be an int >= 0"),
    ("window_size", 0, "window_size must be an int >= 1"),
    ("rebalance_interval", -5, "rebalance_interval must be an int >= 0"),
    ("policy", "nope", "policy='nope' is unknown"),
    ("num_nodes", 0, "num_nodes must be an int >= 1"),
    ("initial_placement", "/no/such/file.json", "initial_placement: file not found"),
    ("weighted_replicas", "yes", "weighted_replicas must be a bool, got 'yes'"),
    ("weighted_replicas", 1, "weighted_replicas must be a bool, got 1"),
    ("weighted_replicas", None, "weighted_replicas must be a bool, got None"),
])
def test_invalid_values(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EplbConfig(**{field: value}).verify(num_logical_experts=8, num_gpus=2)


def test_model_slot_mismatch():
    with pytest.raises(ValueError, match="num_physical_experts=10"):
        EplbConfig(num_redundant_experts=0).verify(8, 2, num_physical_experts=10)


def test_nodes_not_dividing_gpus_is_adjusted_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="eplb.core.config"):
        c = EplbConfig(num_nodes=3).verify(num_logical_experts=8, num_gpus=4)
    assert c.num_nodes == 1
    assert "num_nodes=3 does not divide the 4 EP ranks" in caplog.text


def test_auto_nodes_logged(caplog, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="eplb.core.config"):
        c = EplbConfig().verify(num_logical_experts=8, num_gpus=4)
    assert c.num_nodes == 1
    assert "num_nodes not set: using 1" in caplog.text


@pytest.mark.parametrize("local,world,nodes", [("4", 8, 2), ("8", 8, 1), ("3", 8, 1), ("x", 8, 1)])
def test_nodes_from_env(monkeypatch, local, world, nodes):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert nodes_from_env(world) == nodes


def test_weighted_replicas_accepts_bools():
    for value in (False, True):
        assert EplbConfig(weighted_replicas=value).verify(8, 2).weighted_replicas is value


def test_move_tolerance_default_is_the_planners_constant():
    """One constant: EplbConfig's default is the very object eplb.core.policy defines (a
    second literal 0.03 here would be an equal but distinct float)."""
    from eplb.core.policy.base import DEFAULT_MOVE_TOLERANCE, PolicyOptions

    assert EplbConfig.move_tolerance is DEFAULT_MOVE_TOLERANCE
    assert PolicyOptions().move_tolerance is DEFAULT_MOVE_TOLERANCE


def test_transport_and_launch_values_match_the_runtime():
    """verify() spells the values out (the pure core does not import eplb.runtime): they
    must be exactly the runtime's TRANSPORTS and LAUNCH_MODES."""
    import ast

    from eplb.runtime.move_options import LAUNCH_MODES
    from eplb.runtime.transport_choice import TRANSPORTS

    for field, values in (("transport", TRANSPORTS), ("exchange_launch", LAUNCH_MODES)):
        for v in values:
            assert getattr(EplbConfig(**{field: v}).verify(8, 2), field) == v
        with pytest.raises(ValueError, match=f"{field}='bogus' is unknown") as e:
            EplbConfig(**{field: "bogus"}).verify(8, 2)
        listed = ast.literal_eval(str(e.value).split("choose one of ", 1)[1])
        assert sorted(listed) == sorted(values), field


# ---- docs/operations.md "Settings": the table of every setting's names -------------------------
OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
DEMO_PARSERS = ("eplb demo", "python -m eplb.ops.demo")


def _settings_table() -> list[list[str]]:
    text = OPERATIONS.read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]


def _parser_settings() -> dict[str, dict[str, set[str]]]:
    """{field: {flag: {parser names}}} of every CLI option whose dest is an EplbConfig field."""
    import argparse

    from eplb.ops.cli import build_parser
    from eplb.ops.demo import build_parser as demo_parser

    parsers = [(f"eplb {name}", sub) for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction) for name, sub in a.choices.items()]
    parsers.append(("python -m eplb.ops.demo", demo_parser()))
    fields = {f.name for f in dataclasses.fields(EplbConfig)}
    out: dict[str, dict[str, set[str]]] = {}
    for name, parser in parsers:
        for a in parser._actions:
            if a.dest in fields and a.option_strings:
                out.setdefault(a.dest, {}).setdefault(a.option_strings[0], set()).add(name)
    return out


def test_settings_table_matches_the_config_the_parsers_and_the_metrics():
    import ast
    import re

    from eplb.ops.metrics import EplbMetrics
    from eplb.runtime.move_options import LAUNCH_MODES
    from eplb.runtime.transport_choice import TRANSPORTS
    from test_metrics import make_runtime, skewed_pass, step_with

    rows = _settings_table()
    fields = dataclasses.fields(EplbConfig)
    # one row per field, in the dataclass's order, with its default
    assert [r[0].strip("`") for r in rows] == [f.name for f in fields]
    for (_, _, _, default, meaning), f in zip(rows, fields):
        assert default.startswith("`") and default.endswith("`"), (f.name, default)
        value = ast.literal_eval(default.strip("`"))
        assert value == f.default and type(value) is type(f.default), (f.name, default, f.default)
        assert meaning, f.name
    # the flags: exactly the parsers' options, each the field name with dashes
    exposed = _parser_settings()
    for name, flag_cell, *_ in rows:
        field = name.strip("`")
        want = exposed.get(field, {})
        m = re.fullmatch(r"`(--[a-z-]+)` \(([a-z, ]+)\)", flag_cell)
        if not want:
            assert flag_cell == "", (field, flag_cell)
            continue
        assert m, (field, flag_cell)
        flag, where = m.group(1), [w.strip() for w in m.group(2).split(",")]
        assert flag == "--" + field.replace("_", "-") and list(want) == [flag], (field, flag, want)
        named = {p for w in where for p in (DEMO_PARSERS if w == "demo" else (f"eplb {w}",))}
        assert named == want[flag], (field, named, want[flag])
    # the metric labels / info keys: the field name, and really exported under it
    rt = make_runtime(window_size=4, load_decay=0.5)
    metrics = EplbMetrics(rt, interval=1)
    step_with(rt, skewed_pass())
    snapshot = metrics.load_snapshot()
    labels = _info_labels(metrics)
    listed = set()
    for name, _, metric_cell, *_ in rows:
        field = name.strip("`")
        keys = list(re.finditer(r"`eplb_info\{(\w+)\}`|`GET /load` `(\w+)`", metric_cell))
        assert bool(keys) == bool(metric_cell), (field, metric_cell)
        for m in keys:
            key = m.group(1) or m.group(2)
            assert key == field, (field, metric_cell)
            if m.group(1):
                assert labels[key] == str(getattr(rt.config, field)), (field, labels)
            else:
                assert snapshot[key] == getattr(rt.config, field), (field, snapshot[key])
            listed.add(field)
    # every setting the exports carry under a field name is in the table
    assert listed == {k for k in [*labels, *snapshot] if k in _field_names()}
    # the choices: the runtime's constants, in the parser and in the table
    for field, values in (("transport", TRANSPORTS), ("exchange_launch", LAUNCH_MODES)):
        meaning = next(r[4] for r in rows if r[0] == f"`{field}`")
        assert set(values) <= set(re.findall(r"`(\w+)`", meaning)), (field, meaning)
        (flag,) = exposed[field]
        action = _action(flag)
        assert tuple(action.choices) == tuple(values), (field, action.choices)


def _action(flag: str):
    from eplb.ops.demo import build_parser

    return next(a for a in build_parser()._actions if flag in a.option_strings)


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(EplbConfig)}


def _info_labels(metrics) -> dict:
    """The eplb_info labels as exported (read from the registry, not from the code)."""
    for fam in metrics.registry.collect():
        if fam.name == "eplb":
            return dict(fam.samples[0].labels)
    raise AssertionError("no eplb_info")


@pytest.mark.parametrize("bad", [True, False, -0.1, 10, float("nan"), float("inf"), "0.1", None])
def test_move_tolerance_is_checked_once_the_same_way_everywhere(bad):
    """EplbConfig.verify, plan() and simulate() share one check (issue 31: config accepted
    True, plan() refused it): the same bad value fails all three with the same message."""
    import numpy as np

    from eplb.core.planning import plan
    from eplb.core.simulate import simulate

    msgs = []
    with pytest.raises(ValueError) as e:
        EplbConfig(num_redundant_experts=4, move_tolerance=bad).verify(num_logical_experts=12, num_gpus=4)
    msgs.append(str(e.value))
    with pytest.raises(ValueError) as e:
        plan(np.ones((2, 12)), 4, 16, move_tolerance=bad)
    msgs.append(str(e.value))
    with pytest.raises(ValueError) as e:
        simulate(np.ones((4, 2, 12)), 4, 16, window=1, interval=1, move_tolerance=bad, oracle=False)
    msgs.append(str(e.value))
    assert len(set(msgs)) == 1 and "move_tolerance" in msgs[0], msgs


@pytest.mark.parametrize("bad", [True, -1, 1.5, "2", None])
def test_steady_windows_is_checked_once_the_same_way_everywhere(bad, capsys):
    """EplbConfig.verify and simulate() share one check; the CLI refuses a negative count
    in one line with exit 2."""
    import numpy as np

    from _cli import run_main
    from eplb.core.simulate import simulate

    msgs = []
    with pytest.raises(ValueError) as e:
        EplbConfig(num_redundant_experts=4, steady_windows=bad).verify(num_logical_experts=12, num_gpus=4)
    msgs.append(str(e.value))
    with pytest.raises(ValueError) as e:
        simulate(np.ones((4, 2, 12)), 4, 16, window=1, interval=1, steady_windows=bad, oracle=False)
    msgs.append(str(e.value))
    assert len(set(msgs)) == 1 and msgs[0].startswith("steady_windows must be an int >= 0"), msgs
    code, _, err = run_main(["simulate", "esft", "--num-gpus", "4", "--num-slots", "68", "--window-size", "1",
                             "--rebalance-interval", "1", "--steady-windows", "-1"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--steady-windows" in err, (code, err)
