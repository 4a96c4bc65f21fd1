"""README.md as a new user runs it: every bash block is run as written (or is on the short
list NOT_RUN below, with its reason, also stated next to the block in the README), and
every output block (`<!-- regen: ID -->`) matches what its command prints now, within the
tolerance docs/regen.py states per block (timings vary; seeded figures exact).

`eplb` and `torchrun` resolve to this checkout (docs/regen.py's shims); each block runs in
a fresh scratch directory; the metrics block runs on a free port shown as 9400."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_spec = importlib.util.spec_from_file_location("regen", ROOT / "docs" / "regen.py")
regen = importlib.util.module_from_spec(_spec)
sys.modules["regen"] = regen  # dataclasses look their module up there
_spec.loader.exec_module(regen)

BASH = re.compile(r"(?:^<!-- (run|not-run): ([\w-]+)(?: \([^\n]*\))? -->\n)?^```bash\n(.*?)^```\n",
                  re.S | re.M)

# Blocks no test here runs, and why (the README says the same next to each).
NOT_RUN = {
    "setup-demo": "creates a venv and installs torch and eplb from the package index; CI "
                  "(.ci/run) runs the same install in the test command, and the demo it ends "
                  "with is the `demo` output block",
    "setup-tests": "the test command itself: .ci/run runs it verbatim "
                   "(test_prometheus.py::test_ci_installs_prometheus_then_runs_the_readme_test_command)",
    "torchrun-cuda": "needs 2 CUDA GPUs (NCCL)",
    "install-hf": "installs from the package index; the dev extra the tests run with has "
                  "the same packages (EPLB_REQUIRE_HF in .ci/run)",
}
SLOW = {"metrics", "simulate-esft", "simulate-cost", "torchrun-cpu"}  # longer than ~20 s on 2 cores


def bash_blocks() -> dict[str, tuple[str, str]]:
    """id -> (run | not-run, code) for every bash block; raises on an unmarked block."""
    text = README.read_text()
    found = {}
    for m in BASH.finditer(text):
        line = text.count("\n", 0, m.start(3))
        if m.group(1) is None:
            raise AssertionError(f"README.md:{line}: bash block without <!-- run: ID --> or "
                                 "<!-- not-run: ID -->")
        assert m.group(2) not in found, f"README.md:{line}: block id {m.group(2)} used twice"
        found[m.group(2)] = (m.group(1), m.group(3))
    return found


def test_every_bash_block_is_run_or_listed_with_its_reason():
    blocks = bash_blocks()
    assert {k for k, (kind, _) in blocks.items() if kind == "not-run"} == set(NOT_RUN)
    # the first two blocks are the fresh-machine commands (test_prometheus reads the second)
    assert list(blocks)[:2] == ["setup-demo", "setup-tests"]
    for name, (kind, code) in blocks.items():
        if kind == "run":
            assert name in RUNNERS, f"no test runs README block {name!r}"


def _prepare_plan(tmp: Path):
    """The inputs the `plan` block names: load.npy [L, N], an SGLang-style dump.pt of 256
    experts, and old.json, the placement in force (made by `eplb plan`)."""
    rng = np.random.default_rng(0)
    np.save(tmp / "load.npy", rng.zipf(1.5, size=(4, 64)).clip(max=1000).astype(np.float64))
    torch.save({"logical_count": torch.from_numpy(rng.zipf(1.5, size=(3, 256)).clip(max=1000))},
               tmp / "dump.pt")
    subprocess.run(["eplb", "plan", "dump.pt", "--num-gpus", "32", "--num-slots", "288",
                    "--num-nodes", "4", "--num-groups", "8", "--out", "old.json"],
                   cwd=tmp, env=regen.shim_env(tmp), check=True, capture_output=True)


# every block run here -> what makes its inputs first (None: it needs none)
RUNNERS = {"plan": _prepare_plan, "torchrun-cpu": None, "simulate-esft": None,
           "simulate-cost": None, "metrics": None}


def _run_block(name: str, tmp_path: Path) -> str:
    kind, code = bash_blocks()[name]
    assert kind == "run"
    prepare = RUNNERS[name]
    if prepare is not None:
        regen.shim_env(tmp_path)  # the shims exist before prepare runs eplb
        prepare(tmp_path)
    return regen.run_session(code, tmp_path, timeout=600)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in RUNNERS if n != "metrics"])
def test_bash_block_runs_as_written(name, tmp_path):
    out = _run_block(name, tmp_path)
    if name == "plan":
        assert (tmp_path / "placement.json").is_file() and (tmp_path / "new.json").is_file()
    if name == "simulate-esft":
        assert (tmp_path / "sim.json").is_file() and (tmp_path / "sim.png").stat().st_size > 0
    if name == "simulate-cost":
        assert (tmp_path / "scale.json").is_file() and (tmp_path / "scale.png").stat().st_size > 0
    if name == "torchrun-cpu":
        assert "bad slots 0 OK" in out and "FAILED" not in out


def _output_block(block_id: str):
    return next(b for b in regen.find_blocks(README) if b.id == block_id)


def test_every_output_block_has_a_test():
    assert {b.id for b in regen.find_blocks(README)} == {"demo", "demo-qwen3", "metrics"}
    # the others are docs/operations.md's (tests/test_docs_ops.py)
    assert {k for k in regen.TOLERANCE if not k.startswith("ops-")} == {"demo", "demo-qwen3", "metrics"}


@pytest.mark.slow
def test_metrics_block_runs_as_written_and_prints_what_the_readme_shows(tmp_path):
    out = _run_block("metrics", tmp_path)
    block = _output_block("metrics")
    assert not regen.differences(block, out), "\n".join(regen.differences(block, out))
    assert np.load(tmp_path / "trace.npy").shape[0] == 10  # [T, L, N]: --count 10


@pytest.mark.slow
@pytest.mark.parametrize("block_id", ["demo", "demo-qwen3"])
def test_demo_output_block_is_what_the_demo_prints(block_id):
    if block_id == "demo-qwen3":
        from _hf import require_transformers

        require_transformers()
    block = _output_block(block_id)
    diff = regen.differences(block, regen.produce(block))
    assert not diff, "README output is stale (python docs/regen.py rewrites it):\n" + "\n".join(diff)


def test_masking_keeps_seeded_figures_and_drops_timings():
    """The comparison's tolerance: timings differ freely, a balancedness or a move count
    does not (the block would be stale)."""
    line = ("step    50 rebalance: balancedness 0.868 -> 0.996 (predicted), 27 experts moved, "
            "1.33 MB, 182.4 ms | verify: max |diff| 0.0e+00, bad slots 0 OK")
    block = regen.Block(README, "demo", False, "", "$ eplb demo\n" + line + "\n", 0, 0)
    same = line.replace("182.4 ms", "99.0 ms").replace("0.0e+00", "1.2e-07")
    assert regen.differences(block, "$ eplb demo\n" + same + "\n") == []
    for changed in (line.replace("0.996", "0.995"), line.replace("27 experts", "26 experts"),
                    line.replace("bad slots 0 OK", "bad slots 1 FAILED")):
        assert regen.differences(block, "$ eplb demo\n" + changed + "\n")
