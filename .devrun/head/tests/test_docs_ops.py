"""docs/operations.md, docs/reliability.md, docs/architecture.md (and README.md's Python
blocks) as written: every fenced block is run by a test here (`<!-- run: ID -->`), is
regenerated output (`<!-- regen: ID -->`, compared with what the code prints now within
docs/regen.py's per-block tolerance), is on the list NOT_RUN below with its reason (the
doc states it next to the block), or is a figure or config (```text with no command in
it, or ```yaml, which is parsed here).

Bash blocks run through docs/regen.py's sessions: a scratch directory that is also HOME,
`eplb` and `torchrun` resolving to this checkout, a free port shown as 9400; blocks marked
`(continues PREV)` run in PREV's shell, its demo job still serving."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
if "regen" not in sys.modules:  # tests/test_docs_readme.py loads the same module
    _spec = importlib.util.spec_from_file_location("regen", ROOT / "docs" / "regen.py")
    _regen = importlib.util.module_from_spec(_spec)
    sys.modules["regen"] = _regen  # dataclasses look their module up there
    _spec.loader.exec_module(_regen)
regen = sys.modules["regen"]

OPS = ROOT / "docs" / "operations.md"
DOCS = {p.name: p for p in (OPS, ROOT / "docs" / "reliability.md", ROOT / "docs" / "architecture.md",
                            ROOT / "README.md")}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARK = re.compile(r"^<!-- (run|not-run|regen): ([\w-]+)(?: (session|\([^\n]*\)))? -->\n\Z", re.M)
# a line of a figure that is really a command (an unmarked transcript or command block)
COMMAND = re.compile(r"^\s*(\$ |eplb |python|\.venv/|curl |torchrun |cd |docker |pytest |pip )")

# Blocks no test runs, and why (each doc says the same next to the block). README.md's bash
# blocks are tests/test_docs_readme.py's; its Python blocks are here.
NOT_RUN = {
    "ops-demo-cuda": "needs CUDA GPUs",
    "ops-torchrun-cuda": "needs 8 CUDA GPUs",
    "ops-multinode": "needs two nodes with 8 GPUs each (tests/test_multinode.py: the same shape on CPU)",
    "ops-slurm": "needs a Slurm cluster",
    "ops-compose": "needs Docker, downloads images and wheels (tests/test_docker.py checks the files)",
    "ops-render": "needs a Prometheus that scraped a job for minutes (tests/test_prometheus.py)",
    "ops-resize": "a fragment of a 4-rank job (tests/test_resize.py makes the call)",
    "rel-fuzz": "a dated record of test runs of 1 to 10 minutes",
    "rel-verify-cost": "a dated timing measurement",
    "rel-soak": "a dated record of a 3.5-minute test run",
    "rel-mutation-result": "a dated record of that check",
    "arch-replica-weights": "a fragment: the runtime's call on its model",
    "readme-hf": "needs NCCL GPUs under torchrun and a checkpoint (bring-your-own-model.md's hf blocks run the calls)",
    "readme-own-model": "a fragment around the reader's model (bring-your-own-model.md runs a complete one)",
    "readme-async": "a fragment of the same loop",
    "readme-metrics-api": "a fragment on the runtime above (README's metrics block runs it through eplb demo)",
    # README's bash blocks that test_docs_readme.py does not run (its NOT_RUN says why)
    "setup-demo": "test_docs_readme.py", "setup-tests": "test_docs_readme.py",
    "torchrun-cuda": "test_docs_readme.py", "install-hf": "test_docs_readme.py",
}
JOB = ["ops-job", "ops-load", "ops-record", "ops-trace"]  # one shell: the job of the Metrics section
SLOW = {"ops-demo", "ops-cost", *JOB, "ops-trigger"}  # longer than ~20 s on 2 cores
RUN = {"ops-demo", "ops-slots", "ops-cost", *JOB, "ops-trigger",  # run here
       "readme-plan", "rel-mutation-usage"}
README_BASH = {"plan", "torchrun-cpu", "simulate-esft", "simulate-cost", "metrics"}  # run there


def blocks(doc: Path) -> list[dict]:
    """Every fenced block: line, lang, code, and its marker (kind, id, note) or None."""
    text = doc.read_text()
    found = []
    for m in FENCE.finditer(text):
        mark = MARK.search(text, 0, m.start())
        found.append(dict(line=text.count("\n", 0, m.start()) + 1, lang=m.group(1), code=m.group(2),
                          kind=mark and mark.group(1), id=mark and mark.group(2),
                          note=mark and mark.group(3)))
    return found


@pytest.mark.parametrize("name", list(DOCS))
def test_every_block_is_run_regenerated_listed_or_a_figure(name):
    for b in blocks(DOCS[name]):
        where = f"{name}:{b['line']}"
        if b["kind"] is None:
            assert b["lang"] in ("text", "yaml"), \
                f"{where}: a ```{b['lang']} block without <!-- run/not-run/regen: ID --> (or tag a figure ```text)"
            cmds = [line for line in b["code"].splitlines() if COMMAND.match(line)]
            assert not cmds, f"{where}: a figure holding commands {cmds}: mark it run or not-run"
            if b["lang"] == "yaml":
                assert list(yaml.safe_load_all(b["code"])), f"{where}: empty YAML"
        elif b["kind"] == "not-run":
            assert b["id"] in NOT_RUN, f"{where}: {b['id']} is not in NOT_RUN"
            assert b["note"] and len(b["note"]) > 10, f"{where}: say why it is not run, next to the block"
        elif b["kind"] == "run":
            assert b["id"] in RUN | README_BASH, f"{where}: no test runs {b['id']}"
        else:  # regen: docs/regen.py rewrites it, a test here or in test_docs_readme.py compares
            assert DOCS[name] in regen.DOCS and b["lang"] in ("", "text"), where


def test_the_lists_match_the_docs():
    ids: dict[str, set] = {}
    for doc in DOCS.values():
        for b in blocks(doc):
            ids.setdefault(b["kind"], set()).add(b["id"])
    assert ids["not-run"] == set(NOT_RUN)
    assert ids["run"] == RUN | README_BASH
    assert [d for d in regen.DOCS if d.name in DOCS] == [ROOT / "README.md", OPS]  # regen covers them
    assert {b.id for b in regen.find_blocks(OPS)} == {"ops-slots", *JOB, "ops-trigger"}  # compared below
    # every tolerance belongs to an output block (README's are test_docs_readme.py's)
    assert set(regen.TOLERANCE) <= {b.id for d in regen.DOCS for b in regen.find_blocks(d)}


def _within(shown, real) -> bool:
    """`shown` is `real` with some mapping keys left out."""
    if isinstance(shown, dict):
        return isinstance(real, dict) and all(k in real and _within(v, real[k]) for k, v in shown.items())
    if isinstance(shown, list):
        return isinstance(real, list) and len(shown) == len(real) and all(map(_within, shown, real))
    return shown == real


def test_configs_are_the_files_the_tests_run():
    """The scrape config shown is docker/prometheus/prometheus.yml's, less what the file
    says more (metrics_path, a label); the Kubernetes job starts the demo module."""
    ops = [b["code"] for b in blocks(OPS) if b["lang"] == "yaml"]
    shown = next(yaml.safe_load(c) for c in ops if "scrape_configs" in c)
    real = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    assert _within(shown, real), (shown, real)
    assert not _within({"scrape_configs": [{"scrape_interval": "15s"}]}, real)  # the check can fail
    job = [d for c in ops if "kind: Job" in c for d in yaml.safe_load_all(c) if d["kind"] == "Job"][0]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "-m eplb.ops.demo" in args and "--rdzv-endpoint eplb-0.eplb:29400" in args


def _code(block_id: str, doc: Path = OPS) -> str:
    return regen.run_blocks(doc)[block_id]


def _output(block_id: str) -> "regen.Block":
    return next(b for b in regen.find_blocks(OPS) if b.id == block_id)


def _same(block_id: str, out: str):
    diff = regen.differences(_output(block_id), out)
    assert not diff, "docs/operations.md output is stale (python docs/regen.py rewrites it):\n" + "\n".join(diff)


def test_sizing_sweep_prints_what_the_doc_shows(tmp_path):
    """Seeded replays of the packaged trace: every figure exact but the planning time."""
    _same("ops-slots", regen.run_session(_code("ops-slots"), tmp_path))


@pytest.mark.slow
def test_demo_block_runs_and_verifies(tmp_path):
    out = regen.run_session(_code("ops-demo"), tmp_path)
    # the demo's own lines: every rebalance verified against the dense reference
    assert out.count("bad slots 0 OK") == 6 and "FAILED" not in out  # 300 steps, every 50


@pytest.mark.slow
def test_cost_sweep_runs_and_writes_every_ep_size(tmp_path):
    regen.run_session(_code("ops-cost"), tmp_path)
    for r in (0, 1, 2, 4):
        results = json.loads((tmp_path / f"r{r}.json").read_text())["results"]
        assert [x["config"]["num_gpus"] for x in results] == [32, 128]
        assert [x["config"]["num_slots"] for x in results] == [256 + 32 * r, 256 + 128 * r]


@pytest.fixture(scope="module")
def job_session(tmp_path_factory):
    """The Metrics section's demo job and the blocks that continue it, run once."""
    tmp = tmp_path_factory.mktemp("ops-job")
    return tmp, regen.run_chain(OPS, "ops-job", tmp)


@pytest.mark.slow
@pytest.mark.parametrize("block_id", JOB)
def test_job_blocks_print_what_the_doc_shows(block_id, job_session):
    tmp, out = job_session
    assert regen.chain(OPS, block_id) == JOB
    _same(block_id, out[block_id])
    if block_id == "ops-job":  # it waits for a skipped rebalance, so one is counted
        assert re.search(r'outcome="skipped",trigger="interval"\} [1-9]', out[block_id])
    if block_id == "ops-record":
        assert json.loads((tmp / "placement.json").read_text())["num_gpus"] == 2
    if block_id == "ops-trace":
        with np.load(tmp / "trace.npz") as z:
            assert z["counts"].shape == (10, 4, 32)  # [T, L, N]: --count 10


@pytest.mark.slow
def test_trigger_block_prints_what_the_doc_shows(tmp_path):
    out = regen.run_session(_code("ops-trigger"), tmp_path)
    _same("ops-trigger", out)
    assert (tmp_path / ".eplb" / "token").stat().st_mode & 0o077 == 0  # private, as the doc says
    assert '"state": "done"' in out.splitlines()[-1]


@pytest.mark.slow
def test_mutation_check_block_runs_as_written():
    """reliability.md's release check, its three commands as written, from the repository
    root with the repository's .venv (README's setup; .ci/run makes it): every planted bug
    caught, the --only run too. About 5 minutes on 2 cores."""
    import subprocess

    b = next(b for b in blocks(ROOT / "docs" / "reliability.md") if b["id"] == "rel-mutation-usage")
    assert (ROOT / ".venv" / "bin" / "python").exists(), "the block runs .venv/bin/python: README's setup makes it"
    r = subprocess.run(["bash", "-ec", b["code"]], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    caught = re.findall(r"^(\d+) of (\d+) mutations caught", r.stdout, re.M)
    assert len(caught) == 2 and all(a == b and int(a) > 0 for a, b in caught), r.stdout[-4000:]
    assert caught[1] == ("1", "1")  # --only watchdog_disabled
    assert "watchdog_disabled" in r.stdout and "baseline" in r.stdout.lower()


def test_readme_plan_python_block_runs():
    """README's `eplb.plan` block, with the `load` it names ([L, N] tokens per expert)."""
    b = next(b for b in blocks(ROOT / "README.md") if b["id"] == "readme-plan")
    load = np.random.default_rng(0).zipf(1.5, size=(4, 64)).clip(max=1000).astype(np.float64)
    ns = {"load": load}
    exec(compile("\n" * (b["line"]) + b["code"], "README.md", "exec"), ns)
    placement = ns["placement"]
    assert placement.physical_to_logical.shape == (4, 72)  # [L, P]
    assert placement.balancedness(load).shape == (4,)
