"""Malformed input fails fast: the CLI exits 2 with one stderr line (no traceback), the
API raises ValueError (or TypeError). Sizes are checked before anything is allocated.
All-zero load is legitimate input: it plans a valid placement."""
import json

import numpy as np
import pytest
import torch

from _cli import run_main
from eplb import plan
from eplb.core.loadio import as_load, read_load
from eplb.core.placement import Placement
from eplb.core.simulate import simulate
from eplb.core.workload import load_trace


class _Payload:  # torch.save of this needs a full pickle: weights_only=True must refuse it
    pass


def _npy_header_only(path, shape):
    """An .npy whose header claims `shape` but whose body is 64 bytes: loading must not allocate."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": shape})
        f.write(b"\0" * 64)


@pytest.fixture
def files(tmp_path):
    f = {k: tmp_path / v for k, v in {
        "ok": "ok.npy", "zero": "zero.npy", "inf": "inf.npy", "empty_npy": "empty.npy",
        "empty_json": "empty.json", "trunc": "trunc.json", "evil": "evil.pt", "evil_dict": "evil2.pt",
        "big": "big.npy", "big3": "big3.npy", "bools": "bools.json", "boolnpy": "bool.npy",
        "objnpy": "obj.npy", "trace": "trace.npy", "ztrace": "ztrace.npy", "out": "out.json",
        "emptyarr": "emptyarr.npy"}.items()}
    np.save(f["ok"], np.arange(16, dtype=np.float64).reshape(2, 8))
    np.save(f["zero"], np.zeros((2, 8)))
    np.save(f["inf"], np.array([[1.0, np.inf]] * 2))
    np.save(f["emptyarr"], np.zeros((2, 0)))
    f["empty_npy"].write_bytes(b"")
    f["empty_json"].write_text("")
    f["trunc"].write_text('{"logical_count": [[1, 2], [3,')
    torch.save(_Payload(), f["evil"])
    torch.save({"logical_count": _Payload()}, f["evil_dict"])
    _npy_header_only(f["big"], (1, 10**9))
    _npy_header_only(f["big3"], (10, 1000, 10**6))
    f["bools"].write_text("[[true, false], [false, true]]")
    np.save(f["boolnpy"], np.ones((2, 8), dtype=bool))
    np.save(f["objnpy"], np.array([_Payload()], dtype=object), allow_pickle=True)
    np.save(f["trace"], np.ones((4, 2, 8)))
    np.save(f["ztrace"], np.zeros((4, 2, 8)))
    return {k: str(v) for k, v in f.items()}


def _one_line_exit_2(argv, capsys, needle=None):
    code, _, err = run_main(argv, capsys)
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    if needle:
        assert needle in lines[0], lines[0]
    return lines[0]


PLAN = ["plan", "--num-gpus", "2", "--num-slots", "8"]


@pytest.mark.parametrize("load,extra,needle", [
    ("ok", ["--num-slots", str(10**12)], "num_slots"),
    ("ok", ["--num-gpus", str(10**12)], "num_gpus"),
    ("ok", ["--num-gpus", "True"], "--num-gpus"),
    ("ok", ["--num-gpus", "2.0"], "--num-gpus"),
    ("ok", ["--num-slots", "-8"], "--num-slots"),
    ("inf", [], "inf"),
    ("empty_npy", [], "empty"),
    ("empty_json", [], "empty"),
    ("emptyarr", [], "empty"),
    ("trunc", [], "invalid JSON"),
    ("evil", [], "not a safely loadable .pt"),
    ("evil_dict", [], "not a safely loadable .pt"),
    ("big", [], "big.npy"),
    ("bools", [], "non-numeric"),
    ("boolnpy", [], "numeric"),
    ("objnpy", [], "obj.npy"),
    ("ok", ["--previous", "{evil}"], "evil.pt"),
    ("ok", ["--previous", "{trunc}"], "invalid JSON"),
    ("ok", ["--previous", "{big}"], "big.npy"),
    ("ok", ["--previous", "{empty_npy}"], "empty.npy"),
    ("ok", ["--previous", "{bools}"], "physical_to_logical"),
    ("ok", ["--out", "{dir}"], "directory"),
])
def test_plan_cli_bad_input(files, tmp_path, capsys, load, extra, needle):
    fmt = dict(files, dir=str(tmp_path))
    argv = PLAN + [files[load], "--out", files["out"]] + [x.format(**fmt) for x in extra]
    _one_line_exit_2(argv, capsys, needle)


SIM = ["--num-gpus", "2", "--num-slots", "8", "--window-size", "1", "--rebalance-interval", "1", "--no-oracle"]


@pytest.mark.parametrize("trace,extra,needle", [
    ("trace", ["--num-slots", str(10**12)], "num_slots"),
    ("trace", ["--window-size", "true"], "--window-size"),
    ("trace", ["--load-decay", "nan"], "decay"),
    ("trace", ["--load-decay", "2"], "--load-decay must be in (0, 1]"),
    ("trace", ["--load-decay", "0"], "--load-decay must be in (0, 1]"),
    ("trace", ["--move-tolerance", "inf"], "move_tolerance"),
    ("big", [], "big.npy"),
    ("big3", [], "big3.npy"),
    ("ok", [], "[T, L, N]"),
    ("empty_npy", [], "empty.npy"),
    ("evil", [], "evil.pt"),
    ("objnpy", [], "obj.npy"),
    ("boolnpy", [], "numbers"),
])
def test_simulate_cli_bad_input(files, capsys, trace, extra, needle):
    _one_line_exit_2(["simulate", files[trace]] + SIM + extra, capsys, needle)


# `eplb simulate --cost` on a tiny custom model, which runs in well under a second
COST = ["--num-gpus", "2", "--window-size", "1", "--rebalance-interval", "1", "--cost", "analytic",
        "--model", "custom", "--hidden", "64", "--intermediate", "32", "--top-k", "2", "--moe-layers", "2",
        "--placements", "default"]


@pytest.mark.parametrize("extra,needle", [
    (["--load-decay", "2"], "--load-decay must be in (0, 1]"),
    (["--start", "2"], "--start has no effect with --cost"),
    (["--policy", "deepseek"], "--policy has no effect with --cost"),
    (["--num-nodes", "2"], "--num-nodes has no effect with --cost"),
    (["--num-groups", "2"], "--num-groups has no effect with --cost"),
    (["--bytes-per-expert", "100"], "--bytes-per-expert has no effect with --cost"),
    (["--no-oracle"], "--no-oracle has no effect with --cost"),
])
def test_simulate_cost_refuses_what_it_would_ignore(files, capsys, extra, needle):
    """The cost replay reads neither the balancedness replay's options nor, before, a bad
    --load-decay: each is one line naming the flag, not a run that silently ignores it."""
    _one_line_exit_2(["simulate", files["trace"]] + COST + extra, capsys, needle)


def test_simulate_cost_accepts_those_options_at_their_defaults(files, capsys):
    code, _, err = run_main(["simulate", files["trace"]] + COST + ["--policy", "default", "--num-nodes", "1",
                                                                  "--num-groups", "1"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("args,needle", [
    (["--steps", str(10**24)], "--steps"),
    (["--experts", str(10**12)], "--experts"),
    (["--hidden", str(10**12)], "--hidden"),
    (["--tokens", str(10**12)], "--tokens"),
    (["--layers", str(10**12)], "--layers"),
    (["--num-redundant-experts", str(10**12)], "--num-redundant-experts"),
    (["--nproc", str(10**6)], "--nproc"),
    (["--drift-period", "0"], "--drift-period"),
    (["--skew", "nan"], "--skew"),
    (["--steps", "1.5"], "--steps"),
    (["--trace", "{big}"], "big.npy"),
    # 0 is not "the default", and the model's own checks would name MoEArgs fields
    (["--experts", "0"], "--experts: must be >= 1, got 0"),
    (["--top-k", "0"], "--top-k: must be >= 1, got 0"),
    (["--window-size", "0"], "--window-size: must be >= 1, got 0"),
    (["--experts", "-4"], "--experts: must be >= 1, got -4"),
    (["--top-k", "-1"], "--top-k: must be >= 1, got -1"),
    (["--top-k", "40"], "--top-k: 40 exceeds --experts (32)"),
    (["--groups", "3"], "--groups: --experts (32) must be divisible by --groups (3)"),
    (["--experts", "4", "--groups", "2", "--top-k", "4"], "fewer than --top-k (4)"),
    (["--json", "{missing}"], "--json: directory does not exist"),
    (["--json", "{dir}"], "is a directory"),
    (["--metrics-per-layer"], "--metrics-per-layer needs --metrics-port"),
])
def test_demo_cli_bad_arguments(files, tmp_path, capsys, monkeypatch, args, needle):
    import eplb.ops.launch

    monkeypatch.setattr(eplb.ops.launch, "launch", lambda *a, **k: pytest.fail("launched ranks"))
    fmt = dict(files, missing=str(tmp_path / "no" / "such.json"), dir=str(tmp_path))
    _one_line_exit_2(["demo"] + [x.format(**fmt) for x in args], capsys, needle)


@pytest.mark.parametrize("args,needle", [
    (["--drift-period", "0"], "--drift-period"),
    (["--skew", "-1"], "--skew"),
    (["--experts", "0"], "--experts"),
    (["--groups", "3"], "--groups"),
])
def test_demo_module_bad_arguments(capsys, monkeypatch, args, needle):
    """`torchrun -m eplb.ops.demo` has no `eplb demo` launcher to check its flags: each rank
    refuses them before joining the process group (rank 0 says why)."""
    import eplb.ops.demo

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(eplb.ops.demo.dist, "init_process_group", lambda *a, **k: pytest.fail("started a rank"))
    assert eplb.ops.demo.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eplb demo: error: ") and needle in lines[0], lines


@pytest.mark.parametrize("args,needle", [
    (["not a url", "--token", "x"], "URL"),
    (["ftp://host", "--token", "x"], "URL"),
    (["http://[::1", "--token", "x"], "IPv6"),
    (["http://127.0.0.1:1", "--token", "x", "--wait", "nan"], "--wait"),
    (["http://127.0.0.1:1", "--token", "x", "--wait", "inf"], "--wait"),
    (["http://127.0.0.1:1", "--token", "x", "--wait", "soon"], "--wait"),
    (["http://127.0.0.1:1", "--token", ""], "token"),
    (["http://127.0.0.1:1", "--token-file", "{dir}"], "token file"),
])
def test_trigger_cli_bad_arguments(tmp_path, capsys, args, needle):
    _one_line_exit_2(["trigger"] + [x.format(dir=str(tmp_path)) for x in args], capsys, needle)


# ---- API --------------------------------------------------------------------------------

OK = np.arange(16, dtype=np.float64).reshape(2, 8)


@pytest.mark.parametrize("kwargs", [
    dict(load=np.ones(8)), dict(load=np.ones((2, 2, 2, 2))), dict(load=np.zeros((2, 0))),
    dict(load=[[1.0, float("nan")]]), dict(load=[[1.0, float("inf")]]), dict(load=[[1.0, -1.0]]),
    dict(load="abc"), dict(load=None), dict(load=[[1, 2], [3]]), dict(load=np.ones((2, 8), bool)),
    dict(load=torch.ones(2, 8, dtype=torch.bool)), dict(load=np.ones((2, 8), complex)),
    dict(num_slots=10**12), dict(num_gpus=10**12), dict(num_slots=True), dict(num_gpus=2.0),
    dict(num_slots="8"), dict(num_nodes=0), dict(num_groups=3), dict(num_slots=4),
    dict(policy="magic"), dict(policy=3), dict(previous="x"), dict(move_tolerance=True),
    dict(move_tolerance=float("nan")), dict(move_tolerance="0.1"),
])
def test_plan_api_bad_input_raises_valueerror(kwargs):
    args = dict(load=OK, num_gpus=2, num_slots=8)
    args.update(kwargs)
    with pytest.raises(ValueError):
        plan(args.pop("load"), **args)


def test_huge_load_is_refused_before_conversion():
    # a [1, 10**9] load as a broadcast view: 8 bytes of memory; as_load must refuse it by shape
    # instead of converting it (8 GB)
    huge = np.broadcast_to(np.float64(1.0), (1, 10**9))
    with pytest.raises(ValueError, match="experts"):
        as_load(huge)
    with pytest.raises(ValueError, match="experts"):
        plan(huge, 8, 8)


def test_read_load_files(files):
    for key, needle in [("empty_npy", "empty"), ("trunc", "invalid JSON"), ("evil", ".pt"),
                        ("evil_dict", ".pt"), ("big", "big.npy"), ("bools", "non-numeric"),
                        ("objnpy", "obj.npy"), ("emptyarr", "empty"), ("inf", "inf")]:
        with pytest.raises(ValueError, match=needle):
            read_load(files[key])
    with pytest.raises(ValueError, match="not found"):
        read_load(files["ok"] + ".missing")
    with pytest.raises(ValueError):
        load_trace(files["big3"])


@pytest.mark.parametrize("args", [
    ("abc", 2, 2), (None, 2, 2), ([[0, 1], [0]], 2, 1), (np.zeros((1, 2), int), True, 1),
    (np.zeros((1, 2), int), 1.5, 1), (np.zeros((1, 2), int), "2", 1), (np.zeros((1, 2), int), 1, "1"),
    (np.zeros((1, 2), bool), 1, 1), (np.array([[object(), 0]]), 1, 1), (np.array([[np.nan, 0]]), 1, 1),
    (np.array([[1j, 0]]), 1, 1), (np.array([[0.5, 0]]), 1, 1), (np.zeros((1, 2, 1), int), 1, 1),
    (np.zeros((1, 2), int), 0, 1), (np.zeros((1, 2), int), 1, 0), (np.zeros((1, 3), int), 1, 2),
    (np.array([[0, 2]]), 2, 1), (np.array([[0, 0]]), 2, 1), (np.array([[-1, 0]]), 2, 1),
])
def test_placement_bad_input_raises_valueerror(args):
    with pytest.raises(ValueError):
        Placement(*args)


@pytest.mark.parametrize("kw", [dict(num_nodes=True), dict(num_nodes=0), dict(num_nodes=3),
                                dict(shares="ab"), dict(shares=[[1.0], [1.0, 2.0]]),
                                dict(shares=[[0.5, 0.5]]), dict(shares=[[np.nan, 1.0]])])
def test_placement_bad_keywords(kw):
    with pytest.raises(ValueError):
        Placement(np.array([[0, 1]]), 2, 2, **kw)


def test_placement_load_bad_files(files, tmp_path):
    for key in ("evil", "evil_dict", "trunc", "empty_npy", "big", "objnpy", "bools"):
        with pytest.raises(ValueError):
            Placement.load(files[key], 2, 2)
    (tmp_path / "strs.json").write_text(json.dumps(
        {"physical_to_logical": [[0, 1]], "num_logical_experts": "2", "num_gpus": 1}))
    with pytest.raises(ValueError, match="num_logical_experts"):
        Placement.load(tmp_path / "strs.json")


def test_torch_load_is_weights_only_everywhere():
    from pathlib import Path

    src = Path(__file__).parent.parent / "eplb"
    for f in src.rglob("*.py"):
        text = f.read_text()
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{f}: {line.strip()}"


@pytest.mark.parametrize("kwargs", [
    dict(trace=np.ones((4, 2))), dict(trace=[[[1.0], [1.0, 2.0]]]), dict(trace="abc"),
    dict(trace=np.full((4, 2, 8), np.nan)), dict(trace=-np.ones((4, 2, 8))),
    dict(num_slots=10**12), dict(window=True), dict(interval=0), dict(decay=float("nan")),
    dict(decay=0), dict(start=True), dict(policies=3), dict(policies=[]), dict(policies=["none"]),
    dict(bytes_per_expert=-1), dict(move_tolerance=True),
])
def test_simulate_api_bad_input(kwargs):
    args = dict(trace=np.ones((4, 2, 8)), num_gpus=2, num_slots=8, window=1, interval=1)
    args.update(kwargs)
    with pytest.raises(ValueError):
        simulate(args.pop("trace"), **args, oracle=False)


# ---- all-zero load: legitimate, gives a valid placement ----------------------------------

@pytest.mark.parametrize("policy", ["default", "deepseek", "balanced"])
@pytest.mark.parametrize("weighted", [False, True])
def test_all_zero_load_plans_a_valid_placement(policy, weighted):
    zero = np.zeros((3, 8))
    p = plan(zero, 4, 12, 2, 2, policy=policy, weighted=weighted)
    assert (p.replica_count() >= 1).all()
    assert p == plan(zero, 4, 12, 2, 2, policy=policy, weighted=weighted)  # deterministic
    np.testing.assert_array_equal(p.balancedness(zero), 1.0)  # no division by zero
    # with a previous placement: still valid, same shape
    prev = Placement.initial(3, 8, 12, 4, 2)
    q = plan(zero, 4, 12, 2, 2, policy=policy, previous=prev, weighted=weighted)
    assert (q.replica_count() >= 1).all() and q.num_slots == 12
    # one all-zero layer among loaded ones
    mixed = np.vstack([np.arange(1.0, 9.0), np.zeros(8)])
    assert (plan(mixed, 4, 12, policy=policy).replica_count() >= 1).all()


def test_all_zero_load_cli_and_simulate(files, capsys):
    code, out, err = run_main(PLAN + [files["zero"], "--out", files["out"]], capsys)
    assert code == 0, err
    assert json.loads(open(files["out"]).read())["balancedness"] == [1.0, 1.0]
    r = simulate(np.zeros((4, 2, 8)), 2, 8, 1, 1)
    assert r.policies["default"].summary()["mean"] == 1.0


def test_huge_values_plan_validly():
    load = np.array([[1e308, 1.0, 0.0, 1e300], [1e308, 1e308, 1e308, 1e308]])
    for policy in ("default", "deepseek", "balanced"):
        p = plan(load, 2, 6, policy=policy)
        assert (p.replica_count() >= 1).all()


# ---- a refused .pt file: one line on stderr, no third-party warning text (real processes) ----
class _RunsCode:
    """Unpickled with a full pickle this would run a shell command; weights_only must refuse."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _bad_pt_files(tmp_path):
    """name -> (path, what the one line must say): a malicious plain pickle (protocol 5, the
    kind that makes torch warn in several lines before refusing it), the same inside a
    torch.save archive, and a corrupted (truncated) torch.save archive."""
    import pickle

    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"logical_count": _RunsCode(marker)}, protocol=5))
    evil_zip = tmp_path / "evil_zip.pt"
    torch.save(_RunsCode(marker), evil_zip)
    good = tmp_path / "good.pt"
    torch.save({"logical_count": torch.ones(2, 8)}, good)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return marker, {
        "malicious_pickle": (evil, "UnpicklingError: refused by weights_only=True: unsupported "
                                   "pickle opcode 149; a plain pickle of protocol 5, not a "
                                   "torch.save file"),
        "malicious_torch_save": (evil_zip, "UnpicklingError: refused by weights_only=True: needs "
                                           "the global posix.system"),
        "corrupted": (corrupt, "RuntimeError: PytorchStreamReader failed reading zip archive"),
    }


def _eplb(args, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "eplb"] + args, capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("kind", ["malicious_pickle", "malicious_torch_save", "corrupted"])
def test_refused_pt_file_is_one_line_on_stderr(tmp_path, kind):
    marker, bad = _bad_pt_files(tmp_path)
    path, reason = bad[kind]
    r = _eplb(["plan", str(path), "--num-gpus", "2", "--num-slots", "8", "--out",
               str(tmp_path / "o.json")], tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr  # exactly one line: ours
    assert r.stderr.startswith(f"eplb plan: error: {path}: not a safely loadable .pt file ({reason}")
    assert r.stderr.endswith(")\n") and "warn" not in r.stderr.lower(), r.stderr
    assert not marker.exists()  # and nothing ran


def test_refused_previous_placement_is_one_line_on_stderr(tmp_path):
    """`--previous` is read by Placement.load (its own torch.load): also one line."""
    marker, bad = _bad_pt_files(tmp_path)
    load = tmp_path / "load.npy"
    np.save(load, np.ones((2, 8)))
    r = _eplb(["plan", str(load), "--num-gpus", "2", "--num-slots", "8", "--out",
               str(tmp_path / "o.json"), "--previous", str(bad["malicious_pickle"][0])], tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("eplb plan: error: "), r.stderr
    assert "evil.pt" in r.stderr and "Warning" not in r.stderr
    assert not marker.exists()


def test_read_load_refuses_quietly(tmp_path):
    import warnings

    marker, bad = _bad_pt_files(tmp_path)
    for path, reason in bad.values():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError) as e:
                read_load(path)
        assert caught == [], [str(w.message) for w in caught]
        assert "\n" not in str(e.value) and reason in str(e.value)
    assert not marker.exists()
    assert read_load(tmp_path / "good.pt").tolist() == np.ones((2, 8)).tolist()


def test_shared_setting_checks_take_their_range_and_refuse_the_rest():
    """The four shared settings' checks: values in range come back as floats; bools,
    strings, NaN and values out of range raise one ValueError naming the setting."""
    from eplb.core.planning import (check_dispatch_tokens, check_min_gain, check_move_tolerance,
                                    check_read_tokens)
    inf, nan = float("inf"), float("nan")
    cases = [  # (check, name in the message, accepted, refused)
        (check_min_gain, "min_gain", [0, 0.5, 0.999], [1, 1.5, -0.01, inf]),
        (check_read_tokens, "read_tokens", [0, 100, 1e9], [-1, inf]),
        (check_dispatch_tokens, "dispatch_tokens", [0, 40, inf], [-0.5, -inf]),
        (check_move_tolerance, "move_tolerance", [0, 0.03, 9.99], [10, -0.1, inf]),
    ]
    for check, name, good, bad in cases:
        for v in good:
            out = check(v)
            assert type(out) is float and out == v
        for v in bad + [True, False, "1", None, nan]:
            with pytest.raises(ValueError) as e:
                check(v)
            assert str(e.value).startswith(f"{name} must be ") and str(e.value).endswith(f"got {v!r}"), str(e.value)
