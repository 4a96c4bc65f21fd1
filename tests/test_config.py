"""EplbConfig.verify: invalid values name the field; adjustments are logged."""
import logging

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
    from eplb.core.policy import DEFAULT_MOVE_TOLERANCE, PolicyOptions

    assert EplbConfig.move_tolerance is DEFAULT_MOVE_TOLERANCE
    assert PolicyOptions().move_tolerance is DEFAULT_MOVE_TOLERANCE


def test_transport_and_launch_values_match_the_runtime():
    """verify() spells the values out (the pure core does not import eplb.runtime): they
    must be exactly the runtime's TRANSPORTS and LAUNCH_MODES."""
    import ast

    from eplb.runtime.placement_change import LAUNCH_MODES
    from eplb.runtime.transports import TRANSPORTS

    for field, values in (("transport", TRANSPORTS), ("exchange_launch", LAUNCH_MODES)):
        for v in values:
            assert getattr(EplbConfig(**{field: v}).verify(8, 2), field) == v
        with pytest.raises(ValueError, match=f"{field}='bogus' is unknown") as e:
            EplbConfig(**{field: "bogus"}).verify(8, 2)
        listed = ast.literal_eval(str(e.value).split("choose one of ", 1)[1])
        assert sorted(listed) == sorted(values), field

