"""`eplb plan` and `eplb demo` argument handling: results and one-line errors (exit 2)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _cli import run_main

DATA = Path(__file__).parent / "data"
README_LOAD = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_P2L = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
              [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_plan_readme_example(tmp_path, capsys):
    load = tmp_path / "load.npy"
    np.save(load, np.array(README_LOAD, dtype=np.float64))
    out = tmp_path / "plan.json"
    code, stdout, err = run_main([
        "plan", str(load), "--num-gpus", "8", "--num-slots", "16", "--num-nodes", "2",
        "--num-groups", "4", "--policy", "deepseek", "--out", str(out)], capsys)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert d["physical_to_logical"] == README_P2L
    assert d["num_gpus"] == 8 and d["num_nodes"] == 2 and d["policy"] == "deepseek"
    assert "wrote" in stdout


def test_plan_real_trace_json_and_previous(tmp_path, capsys):
    load = np.load(DATA / "esft_dsv2lite_alltasks.npy")  # [26, 64]
    src = tmp_path / "dump.json"
    src.write_text(json.dumps({"logical_count": [load.tolist()]}))  # [T=1, L, N]
    out = tmp_path / "p.json"
    code, _, err = run_main(["plan", str(src), "--num-gpus", "8", "--num-slots", "72",
                             "--out", str(out)], capsys)
    assert code == 0, err
    d = json.loads(out.read_text())
    assert np.array(d["physical_to_logical"]).shape == (26, 72)
    assert np.mean(d["balancedness"]) > 0.98
    out2 = tmp_path / "p2.json"
    code, _, err = run_main(["plan", str(src), "--num-gpus", "8", "--num-slots", "72",
                             "--previous", str(out), "--out", str(out2)], capsys)
    assert code == 0, err


@pytest.mark.parametrize("args,needle", [
    (["plan", "/no/such.npy", "--num-gpus", "8", "--num-slots", "16", "--out", "x.json"], "not found"),
    (["plan", "{load}", "--num-gpus", "3", "--num-slots", "16", "--out", "{out}"], "multiple of num_gpus"),
    (["plan", "{load}", "--num-gpus", "8", "--num-slots", "8", "--out", "{out}"], "num_slots"),
    (["plan", "{load}", "--num-gpus", "8", "--num-slots", "16", "--num-nodes", "3", "--out", "{out}"], "num_nodes"),
    (["plan", "{load}", "--num-gpus", "8", "--num-slots", "16", "--num-groups", "5", "--out", "{out}"], "num_groups"),
    (["plan", "{load}", "--num-gpus", "8", "--num-slots", "16", "--policy", "magic", "--out", "{out}"], "magic"),
    (["plan", "{load}", "--num-gpus", "0", "--num-slots", "16", "--out", "{out}"], "--num-gpus"),
    (["plan", "{load}", "--num-gpus", "x", "--num-slots", "16", "--out", "{out}"], "--num-gpus"),
    (["plan", "{load}", "--num-gpus", "8", "--num-slots", "16"], "--out"),
    (["plan", "{nan}", "--num-gpus", "8", "--num-slots", "16", "--out", "{out}"], "NaN"),
    (["plan", "{neg}", "--num-gpus", "8", "--num-slots", "16", "--out", "{out}"], "negative"),
    (["plan", "{bad3}", "--num-gpus", "8", "--num-slots", "16", "--out", "{out}"], "shape"),
    (["plan", "{load}", "--num-gpus", "8", "--num-slots", "16", "--out", "/no/dir/p.json"], "directory"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--device", "tpu"], "--device"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    files = {"load": tmp_path / "load.npy", "nan": tmp_path / "nan.npy", "neg": tmp_path / "neg.npy",
             "bad3": tmp_path / "bad.npy", "out": tmp_path / "out.json"}
    np.save(files["load"], np.array(README_LOAD, dtype=np.float64))
    np.save(files["nan"], np.array([[1.0, np.nan]] * 2))
    np.save(files["neg"], np.array([[1.0, -2.0]] * 2))
    np.save(files["bad3"], np.ones((2, 2, 2, 2)))
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_console_script_no_traceback(tmp_path):
    """The real process: exit status 2 and a single stderr line."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    r = subprocess.run([sys.executable, "-m", "eplb.ops.cli", "plan", str(tmp_path / "missing.npy"),
                        "--num-gpus", "2", "--num-slots", "4", "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "not found" in r.stderr


# ---- the entry points: `eplb --version`, `python -m eplb` (real processes) -------------------
ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "eplb"


def _run(cmd, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_version_from_the_script_and_python_m():
    import eplb

    expected = f"eplb {eplb.__version__}\n"
    r = _run([sys.executable, "-m", "eplb", "--version"])
    assert (r.returncode, r.stdout, r.stderr) == (0, expected, "")
    if _SCRIPT.is_file():  # the installed console script (pip install -e .)
        r = _run([str(_SCRIPT), "--version"])
        assert (r.returncode, r.stdout, r.stderr) == (0, expected, "")


def test_python_m_eplb_is_the_same_cli(tmp_path):
    load = tmp_path / "load.npy"
    np.save(load, np.array(README_LOAD, dtype=np.float64))
    args = ["plan", str(load), "--num-gpus", "8", "--num-slots", "16", "--num-nodes", "2",
            "--num-groups", "4", "--policy", "deepseek"]
    r = _run([sys.executable, "-m", "eplb"] + args + ["--out", str(tmp_path / "a.json")])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads((tmp_path / "a.json").read_text())["physical_to_logical"] == README_P2L
    assert r.stdout.startswith("planned 2 layers x 16 slots on 8 GPUs")
    # errors: the same exit status 2 and one line as the console script
    r = _run([sys.executable, "-m", "eplb", "plan", str(tmp_path / "missing.npy"), "--num-gpus", "2",
              "--num-slots", "4", "--out", str(tmp_path / "o.json")])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("eplb plan: error: ") and "not found" in r.stderr
    r = _run([sys.executable, "-m", "eplb"])  # no subcommand: usage error
    assert r.returncode == 2 and "required" in r.stderr


def test_every_plan_flag_has_help():
    from eplb.ops.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    plan = sub.choices["plan"]
    actions = [a for a in plan._actions if a.dest != "help"]
    assert {a.dest for a in actions} >= {"load", "num_gpus", "num_slots", "num_nodes", "num_groups",
                                         "policy", "previous", "out"}
    for a in actions:
        assert a.help and a.help.strip() and a.help != "==SUPPRESS==", a.dest
    # and the real `-h` shows each flag with its text
    r = _run([sys.executable, "-m", "eplb", "plan", "-h"])
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for a in actions:
        if a.dest == "policy":  # in this process other tests may have registered policies
            continue
        assert " ".join(a.help.split()) in text, a.dest
    assert "planning policy, one of balanced, deepseek, default (default: default)" in text


# ---- one name per setting: a CLI flag is its EplbConfig field name with dashes ---------------
# the spellings the flags had before, each a deprecated alias of the canonical flag now
OLD_SPELLINGS = {"--window": "window_size", "--rebalance-every": "rebalance_interval",
                 "--interval": "rebalance_interval", "--decay": "load_decay",
                 "--weighted": "weighted_replicas", "--async": "async_rebalance",
                 "--redundant": "num_redundant_experts"}


def _config_fields() -> set[str]:
    import dataclasses

    from eplb.core.config import EplbConfig

    return {f.name for f in dataclasses.fields(EplbConfig)}


def _all_parsers():
    """(name, parser) of every `eplb` subcommand and of `python -m eplb.ops.demo`, found by
    walking the parsers themselves."""
    import argparse

    from eplb.ops.cli import build_parser
    from eplb.ops.demo import build_parser as demo_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"eplb {name}", sub
    yield "python -m eplb.ops.demo", demo_parser()


def _setting_actions():
    """(parser name, action, field) of every option that sets an EplbConfig field."""
    fields = _config_fields()
    for name, parser in _all_parsers():
        for action in parser._actions:
            if action.dest in fields and action.option_strings:
                yield name, action, action.dest


def test_setting_flags_are_the_config_field_names():
    from eplb.ops.settings_args import Setting

    fields = _config_fields()
    exposed = set()
    for name, parser in _all_parsers():
        for action in parser._actions:
            opts = action.option_strings
            named = {o[2:].replace("-", "_") for o in opts if o.startswith("--")} & fields
            if action.dest not in fields:  # not a setting: no spelling may look like one
                assert not named and not set(opts) & OLD_SPELLINGS.keys(), (name, opts, action.dest)
                continue
            field = action.dest
            exposed.add(field)
            assert opts[0] == "--" + field.replace("_", "-"), (name, field, opts)
            for old in opts[1:]:  # only known old spellings, warned about and hidden
                assert OLD_SPELLINGS.get(old) == field, (name, field, old)
                assert isinstance(action, Setting), (name, field, old)
    assert exposed >= {"window_size", "rebalance_interval", "load_decay", "move_tolerance",
                       "min_gain", "weighted_replicas", "async_rebalance", "verify_transfers",
                       "num_redundant_experts", "policy", "num_nodes", "transport",
                       "exchange_launch"}
    # every old spelling is still accepted somewhere
    aliases = {old for _, a, _ in _setting_actions() for old in a.option_strings[1:]}
    assert aliases == set(OLD_SPELLINGS)


_DEMO_VALUES = {"window_size": 7, "rebalance_interval": 9, "num_redundant_experts": 4,
                "policy": "deepseek", "min_gain": 0.2, "load_decay": 0.5, "move_tolerance": 0.1,
                "weighted_replicas": True, "verify_transfers": True, "async_rebalance": True,
                "transport": "ipc", "exchange_launch": "step", "shift_threshold": 0.2, "steady_windows": 3,
                "drift_trend": False, "control_interval": 5}


def test_demo_settings_reach_the_config():
    """Each setting flag of the demo sets the EplbConfig field of its name (a flag wired to
    the wrong field fails here)."""
    from eplb.ops.demo import build_parser, setup
    from eplb.ops.demo_args import check_demo_arguments

    demo = [(a, f) for n, a, f in _setting_actions() if n == "python -m eplb.ops.demo"]
    assert {f for _, f in demo} == set(_DEMO_VALUES)
    argv = ["--experts", "8"]
    for action, field in demo:
        value = _DEMO_VALUES[field]
        argv += ([action.option_strings[0]] if value is True else [action.option_strings[0], "off"] if value is False
                 else [action.option_strings[0], str(value)])
    a = build_parser().parse_args(argv)
    check_demo_arguments(a)
    config = setup(a, 2)[0]
    for field, value in _DEMO_VALUES.items():
        assert getattr(config, field) == value, field


def test_simulate_settings_reach_the_simulator(capsys, monkeypatch, tmp_path):
    import inspect

    import eplb.core.simulate
    import eplb.ops.simulate_report

    seen = {}
    real = eplb.core.simulate.simulate

    def capture(*args, **kwargs):
        seen.update(inspect.signature(real).bind(*args, **kwargs).arguments)
        raise ValueError("captured")

    monkeypatch.setattr(eplb.ops.simulate_report, "simulate", capture)  # the name `eplb simulate` calls
    trace = tmp_path / "t.npy"
    np.save(trace, np.ones((4, 1, 4)))
    code, _, err = run_main(["simulate", str(trace), "--num-gpus", "2", "--num-slots", "6",
                             "--window-size", "3", "--rebalance-interval", "2", "--load-decay", "0.5",
                             "--move-tolerance", "0.25", "--min-gain", "0.125", "--weighted-replicas",
                             "--num-nodes", "2", "--policy", "deepseek"], capsys)
    assert code == 2 and "captured" in err, err
    assert seen["window"] == 3 and seen["interval"] == 2 and seen["decay"] == 0.5
    assert seen["move_tolerance"] == 0.25 and seen["min_gain"] == 0.125 and seen["weighted"] is True
    assert seen["num_nodes"] == 2 and seen["policies"] == ["deepseek"]


def test_old_spellings_still_parse_with_one_warning(capsys, monkeypatch):
    from eplb.ops.cli import build_parser
    from eplb.ops.settings_args import canonical_argv
    from eplb.ops.demo import build_parser as demo_parser

    monkeypatch.delenv("RANK", raising=False)
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    old = ["--num-gpus", "2", "--num-slots", "6", "--window", "3", "--interval=2", "--decay", "0.5",
           "--weighted"]
    a = sub["simulate"].parse_args(["t.npy", *old])
    assert (a.window_size, a.rebalance_interval, a.load_decay, a.weighted_replicas) == (3, 2, 0.5, True)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"eplb simulate: warning: {o} is deprecated, use {n}" for o, n in [
        ("--window", "--window-size"), ("--interval", "--rebalance-interval"),
        ("--decay", "--load-decay"), ("--weighted", "--weighted-replicas")]]
    new = sub["simulate"].parse_args(["t.npy", "--num-gpus", "2", "--num-slots", "6", "--window-size", "3",
                                      "--rebalance-interval", "2", "--load-decay", "0.5",
                                      "--weighted-replicas"])
    assert vars(new) == vars(a) and capsys.readouterr().err == ""  # canonical flags: silent

    demo_old = ["--rebalance-every", "5", "--window=4", "--async", "--redundant", "2"]
    for parser in (sub["demo"], demo_parser()):
        a = parser.parse_args(demo_old)
        assert (a.rebalance_interval, a.window_size, a.async_rebalance, a.num_redundant_experts) == (5, 4, True, 2)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 4 and all(" is deprecated, use --" in ln for ln in err), err
    # `eplb demo` forwards the canonical spellings to its ranks (no second warning there)
    assert canonical_argv(demo_parser(), demo_old + ["--steps", "3"]) == [
        "--rebalance-interval", "5", "--window-size=4", "--async-rebalance",
        "--num-redundant-experts", "2", "--steps", "3"]
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 warns
    assert demo_parser().parse_args(demo_old).window_size == 4
    assert capsys.readouterr().err == ""


def test_help_and_errors_show_only_the_canonical_flag(capsys):
    from eplb.ops.demo import build_parser as demo_parser

    text = demo_parser().format_help()
    assert "--rebalance-interval" in text and "--window-size" in text and "--async-rebalance" in text
    for old in ("--rebalance-every", "--window ", "--window,", "--async ", "--async,", "--redundant"):
        assert old not in text, old
    code, _, err = run_main(["simulate", "t.npy", "--num-gpus", "2", "--num-slots", "6",
                             "--window", "0", "--rebalance-interval", "1"], capsys)
    assert code == 2 and err.strip() == ("eplb simulate: error: argument --window-size: "
                                         "--window-size must be >= 1, got 0"), err


def test_demo_defaults_fit_every_rank_count_from_1_to_8():
    """`eplb demo --nproc N` with its defaults: the EPLB config and the model arguments are
    valid for every N from 1 to 8 (32 experts + one spare per rank gave 35 slots on 3)."""
    from eplb.ops.demo import build_parser, setup
    from eplb.ops.demo_args import check_demo_arguments

    a = build_parser().parse_args([])
    check_demo_arguments(a)
    for world in range(1, 9):
        config, args, _ = setup(a, world)
        R = config.num_redundant_experts
        assert world <= R < 2 * world, (world, R)  # at least one spare per rank
        assert (a.experts + R) % world == 0, (world, R)
        assert args.num_physical_experts == a.experts + R
