"""read_load / as_load: every supported format round-trips, every bad input is a ValueError."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.core.loadio import as_load, read_load

DATA = Path(__file__).parent / "data"
LOAD = np.array([[3, 0, 7, 1], [2, 2, 5, 9], [0, 1, 1, 4]], dtype=np.float64)  # [L=3, N=4]
SERIES = np.stack([LOAD, 2 * LOAD])  # [T=2, L, N], sums to 3 * LOAD


def _check(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float64 and got.shape == want.shape
    assert np.array_equal(got, want)


# ---- round trips --------------------------------------------------------------------
@pytest.mark.parametrize("arr,want", [(LOAD, LOAD), (SERIES, 3 * LOAD), (LOAD.astype(np.int32), LOAD)])
def test_npy(tmp_path, arr, want):
    np.save(tmp_path / "l.npy", arr)
    _check(read_load(tmp_path / "l.npy"), want)


@pytest.mark.parametrize("arr,want", [(LOAD, LOAD), (SERIES, 3 * LOAD)])
def test_json_object_and_bare_list(tmp_path, arr, want):
    (tmp_path / "a.json").write_text(json.dumps({"logical_count": arr.tolist(), "rank": 0}))
    (tmp_path / "b.json").write_text(json.dumps(arr.astype(int).tolist()))
    _check(read_load(tmp_path / "a.json"), want)
    _check(read_load(str(tmp_path / "b.json")), want)


def test_pt_sglang_dump_and_bare_tensor(tmp_path):
    dump = {  # what SGLang's recorder writes in `stat` mode
        "rank": 0,
        "logical_count": torch.from_numpy(SERIES).to(torch.int32),  # [T, L, N]
        "average_utilization_rate_over_window": 0.5,
    }
    torch.save(dump, tmp_path / "dump.pt")
    torch.save(torch.from_numpy(LOAD).float(), tmp_path / "bare.pt")
    _check(read_load(tmp_path / "dump.pt"), 3 * LOAD)
    _check(read_load(tmp_path / "bare.pt"), LOAD)


def test_repo_traces_load():
    esft = read_load(DATA / "esft_dsv2lite_alltasks.npy")
    olmoe = read_load(DATA / "olmoe_olmoe_arxiv_L0-7-15.npy")
    assert esft.shape == (26, 64) and olmoe.shape == (3, 64)
    # every row is top_k * tokens: all layers of one trace sum to the same value
    assert np.allclose(esft.sum(1), esft.sum(1)[0]) and np.allclose(olmoe.sum(1), olmoe.sum(1)[0])


def test_as_load_inputs():
    _check(as_load(torch.from_numpy(SERIES)), 3 * LOAD)
    _check(as_load(LOAD.tolist()), LOAD)
    src = LOAD.copy()
    as_load(src)[0, 0] = 99  # a copy, never a view of the caller's array
    assert src[0, 0] == 3


# ---- bad inputs ---------------------------------------------------------------------
def _write(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif path.suffix == ".pt":
        torch.save(content, path)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        np.save(path, content)
    return path


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


BAD = [
    ("missing.npy", None, "not found"),
    ("empty.npy", b"", "empty"),
    ("empty.json", b"", "empty"),
    ("empty.pt", b"", "empty"),
    ("garbage.npy", b"not an npy file", "not a readable .npy"),
    ("trunc.npy", None, "not a readable .npy"),
    ("objects.npy", None, "not a readable .npy"),
    ("strings.npy", np.array([["a", "b"], ["c", "d"]]), "numeric"),
    ("bools.npy", np.ones((2, 2), dtype=bool), "numeric"),
    ("1d.npy", np.ones(4), r"got 1-D shape \(4,\)"),
    ("4d.npy", np.ones((1, 1, 2, 2)), "got 4-D"),
    ("zero.npy", np.ones((0, 4)), "empty"),
    ("nan.npy", np.array([[1.0, np.nan]]), "NaN or inf"),
    ("inf.npy", np.array([[1.0, np.inf]]), "NaN or inf"),
    ("neg.npy", np.array([[1.0, -2.0]]), "negative"),
    ("trunc.json", '{"logical_count": [[1, 2], [3', "invalid JSON"),
    ("nokey.json", '{"counts": [[1, 2]]}', "lacks 'logical_count'"),
    ("scalar.json", "3", "nested lists"),
    ("str.json", '{"logical_count": [[1, "2"]]}', "non-numeric"),
    ("bool.json", "[[true, false]]", "non-numeric"),
    ("ragged.json", "[[1, 2], [3]]", "rectangular"),
    ("neg.json", "[[1, -1]]", "negative"),
    ("1d.json", "[1, 2]", "got 1-D"),
    ("garbage.pt", b"\x00\x01 random bytes", "not a safely loadable .pt"),
    ("evil.pt", None, "not a safely loadable .pt"),
    ("nokey.pt", {"counts": torch.ones(2, 2)}, "lacks 'logical_count'"),
    ("str.pt", "just a string", "expected a tensor"),
    ("booltensor.pt", torch.ones(2, 2, dtype=torch.bool), "numeric"),
    ("nan.pt", {"logical_count": torch.tensor([[1.0, float("nan")]])}, "NaN or inf"),
    ("1d.pt", torch.ones(4), "got 1-D"),
    ("load.csv", "1,2\n3,4\n", "unknown load file type"),
]


@pytest.mark.parametrize("name,content,match", BAD, ids=[b[0] for b in BAD])
def test_bad_files(tmp_path, name, content, match):
    path = tmp_path / name
    if name == "trunc.npy":
        np.save(path, np.ones((50, 50)))
        path.write_bytes(path.read_bytes()[:200])
    elif name == "objects.npy":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif name == "evil.pt":
        torch.save({"logical_count": _Evil()}, path)  # a pickle that would run code
    elif content is not None:
        _write(path, content)
    with pytest.raises(ValueError, match=match) as info:
        read_load(path)
    msg = str(info.value)
    assert "\n" not in msg and name in msg  # one line, names the file
