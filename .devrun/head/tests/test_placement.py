"""Placement: derived maps, validation and file round trips."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.core.placement import Placement

# 2 layers, N=4 experts, P=6 slots on 3 GPUs (2 slots each)
P2L = np.array([[0, 1, 2, 3, 0, 0],
                [3, 2, 1, 0, 1, 2]])  # [L, P]


def make() -> Placement:
    return Placement(P2L, num_logical_experts=4, num_gpus=3, policy="test")


def test_sizes_and_counts():
    p = make()
    assert (p.num_layers, p.num_slots, p.slots_per_gpu, p.max_replicas) == (2, 6, 2, 3)
    assert p.replica_count().tolist() == [[3, 1, 1, 1], [1, 2, 2, 1]]
    assert p.gpu_of_slot().tolist() == [0, 0, 1, 1, 2, 2]
    assert not p.physical_to_logical.flags.writeable


def test_logical_to_physical():
    l2p = make().logical_to_physical()  # [L, N, 3]
    assert l2p[0].tolist() == [[0, 4, 5], [1, -1, -1], [2, -1, -1], [3, -1, -1]]
    assert l2p[1].tolist() == [[3, -1, -1], [2, 4, -1], [1, 5, -1], [0, -1, -1]]
    assert make().logical_to_physical(max_replicas=4).shape == (2, 4, 4)
    with pytest.raises(ValueError, match="more than max_replicas=2"):
        make().logical_to_physical(max_replicas=2)


def test_gpu_loads_and_balancedness():
    p = make()
    load = np.array([[6.0, 2, 2, 2], [1, 4, 4, 1]])  # [L, N]
    # layer 0: expert 0 split in 3 (2 each); layer 1: experts 1, 2 split in 2
    assert p.gpu_loads(load).tolist() == [[4, 4, 4], [3, 3, 4]]
    assert np.allclose(p.balancedness(load), [1.0, 10 / 3 / 4])
    assert p.num_duplicates_on_gpu() == 1  # layer 0 GPU 2 holds expert 0 twice
    assert np.array_equal(p.balancedness(np.zeros((2, 4))), [1.0, 1.0])


def test_initial():
    p = Placement.initial(num_layers=3, num_logical_experts=4, num_slots=8, num_gpus=2)
    assert p.physical_to_logical.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] * 3
    assert p.policy == "initial" and (p.replica_count() == 2).all()


@pytest.mark.parametrize(
    "p2l,n,m,nodes,match",
    [
        ([0, 1], 2, 1, 1, "must be 2-D"),
        ([[0, 1, 2, 3]], 4, 3, 1, r"num_slots \(4\) must be divisible by num_gpus \(3\)"),
        ([[0, 1]], 4, 1, 1, r"num_slots \(2\) must be >= num_logical_experts \(4\)"),
        ([[0, 1, 4, 3]], 4, 2, 1, r"ids outside \[0, 4\)"),
        ([[0, 1, -1, 3]], 4, 2, 1, r"ids outside"),
        ([[0, 1, 1, 3]], 4, 2, 1, "layer 0: expert 2 has no replica"),
        ([[0, 1, 2, 3]], 4, 4, 3, r"num_gpus \(4\) must be divisible by num_nodes \(3\)"),
        ([[0, 1, 2, 3]], 4, 0, 1, "num_gpus must be >= 1"),
        ([[0, 1, 2, 3]], 0, 2, 1, "num_logical_experts must be >= 1"),
        ([[0, 1.5, 2, 3]], 4, 2, 1, "integer expert ids"),
    ],
)
def test_validation_errors(p2l, n, m, nodes, match):
    with pytest.raises(ValueError, match=match):
        Placement(np.array(p2l), n, m, nodes)


@pytest.mark.parametrize("suffix", [".json", ".npy", ".pt"])
def test_round_trip(tmp_path, suffix):
    p = make()
    path = tmp_path / f"placement{suffix}"
    p.save(path)
    q = Placement.load(path, num_gpus=3) if suffix == ".npy" else Placement.load(path)
    assert q == p and q.physical_to_logical.dtype == np.int64
    if suffix != ".npy":
        assert q.policy == "test" and q.num_nodes == 1


def test_pt_holds_tensor(tmp_path):
    make().save(tmp_path / "p.pt")
    d = torch.load(tmp_path / "p.pt", weights_only=True)
    assert isinstance(d["physical_to_logical"], torch.Tensor)


def test_with_physical_to_logical_and_eq():
    p = make()
    q = p.with_physical_to_logical(P2L[:, ::-1], policy="flip")
    assert q != p and q.num_gpus == 3 and q.policy == "flip"
    assert p.with_physical_to_logical(P2L.copy()) == p


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("missing.json", None, "not found"),
        ("bad.json", b'{"physical_to_logical": [[0, 1', "invalid JSON"),
        ("nokey.json", b'{"foo": 1}', "physical_to_logical"),
        ("nogpus.json", b'{"physical_to_logical": [[0, 1]]}', "lacks 'num_gpus'"),
        ("ragged.json", b'{"physical_to_logical": [[0, 1], [0]], "num_gpus": 1}', "rectangular"),
        ("empty.npy", b"", "not a readable placement .npy"),
        ("bad.pt", b"junk", "not a safely loadable placement .pt file"),
    ],
)
def test_load_errors(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Placement.load(path, num_gpus=None if name.endswith(".json") else 2)


def test_refused_pt_placement_is_one_line_naming_the_reason(tmp_path):
    """A .pt placement whose pickle needs an arbitrary global is refused by weights_only
    (nothing runs) with one line that says why."""
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"physical_to_logical": Evil()}, protocol=2))
    with pytest.raises(ValueError) as info:
        Placement.load(path, num_gpus=2)
    msg = str(info.value)
    assert "\n" not in msg and "not a safely loadable placement .pt file" in msg
    assert "refused by weights_only=True" in msg, msg
    assert not marker.exists()
