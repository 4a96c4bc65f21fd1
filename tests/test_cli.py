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
