#!/usr/bin/env python3
"""Mutation check (a release check; `.ci/run` does not run it): do the tests catch
deliberate bugs?

For each mutation below (module, exact source snippet, replacement, pytest arguments that
select the tests meant to catch it) the script copies the working tree (the files git
tracks or would track: `git ls-files --cached --others --exclude-standard`; no .git, no
.venv) into a temporary directory, applies that one mutation there, and runs pytest there
with this interpreter, PYTHONPATH pointing at the copy (checked: the child must import
the copy's `eplb` and `moe`, not the editable install's). A mutation is *caught* when
pytest fails (exit status other than 0 and 5, "no tests collected"); a snippet that is not
found exactly once is an error of the list (exit status 2). Prints a table
mutation | caught? | seconds and exits 1 if any mutation survived.

    .venv/bin/python .ci/mutation_check.py              # all mutations (about 3 min on 2 cores)
    .venv/bin/python .ci/mutation_check.py --list       # names, files (snippets checked)
    .venv/bin/python .ci/mutation_check.py --only watchdog_disabled --baseline

`--baseline` first runs every selected mutation's tests on an unmutated copy (they must
pass, else "caught" would mean nothing). Modules are located by name without importing
`eplb` (`eplb.runtime.verify` -> eplb/runtime/verify.py); a mutation may list several
candidate modules (code that moves between modules): the first one whose file contains
the snippet is used.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    modules: tuple[str, ...]  # candidate module names, first match wins
    snippet: str  # must occur exactly once in the module's file
    replacement: str
    pytest_args: tuple[str, ...]
    why: str = ""
    limit_s: float = 600.0  # a run longer than this counts as not caught (hung)


MUTATIONS = [
    Mutation(
        "checksum_first_tensor_only", ("eplb.runtime.verify", "eplb.runtime.transfer"),
        "    for i, w in enumerate(weights):\n",
        "    for i, w in enumerate(weights[:1]):\n",
        ("tests/test_transfer_fuzz.py", "-k", "caught_before and corrupt_w2"),
        "slot_checksums covers only the first weight tensor: a corrupted w2 passes"),
    Mutation(
        "switch_on_own_readiness", ("eplb.runtime.placement_change",),
        "        if min_ready > self.committed:\n",
        "        if self.ready > self.committed:\n",
        ("tests/test_transfer_fuzz.py::test_fuzz_transitions_4_ranks",),
        "a rank switches a layer when it has staged it, not at the agreed minimum"),
    Mutation(
        "watchdog_disabled", ("eplb.runtime.placement_change",),
        "        if ok and time.monotonic() - self._last_progress > timeout:\n",
        "        if False:\n",
        ("tests/test_faults.py::test_stall_no_group_timeout_sees_is_aborted_by_the_watchdog",),
        "no-progress watchdog off: a stall no group timeout sees is not aborted"),
    Mutation(
        "switch_copies_first_map_only", ("eplb.runtime.layer_switch",),
        "    for dst, src in zip(maps, new_maps):\n",
        "    for dst, src in zip(maps[:1], new_maps[:1]):\n",
        ("tests/test_transfer_fuzz.py::test_fuzz_transitions_4_ranks",),
        "a switch copies physical_to_logical but not logical_to_physical_map (and the rest)"),
    Mutation(
        "copy_runs_off_by_one", ("eplb.runtime.staging",),
        "            d[d0:d0 + n].copy_(t[s0:s0 + n])\n",
        "            d[d0:d0 + n - 1].copy_(t[s0:s0 + n - 1])\n",
        ("tests/test_transfer_fuzz.py::test_fuzz_transitions_4_ranks",),
        "the last slot of every run of consecutive slots is not written"),
    Mutation(
        "local_sources_not_staged", ("eplb.runtime.transports",),
        "    copy_runs(staging, rows, weights, plan.stage_src_slot[rows])\n",
        "    pass\n",
        ("tests/test_transfer_fuzz.py::test_fuzz_transitions_4_ranks",),
        "experts copied locally from a slot that is overwritten are never staged"),
    Mutation(
        "wrong_sender", ("eplb.core.senders", "eplb.core.transfer_plan"),
        "        sender[i] = h\n",
        "        sender[i] = (h + 1) % ring\n",
        ("tests/test_transfer_plan.py",),
        "the transfer plan names the next rank, not the chosen holder, as sender"),
    Mutation(
        "verification_never_fails", ("eplb.runtime.verify",),
        "    bad_rows = np.flatnonzero(got != want)\n",
        "    bad_rows = np.flatnonzero(got != got)\n",
        ("tests/test_transfer_fuzz.py", "-k", "caught_before"),
        "staged checksums are compared with themselves: corruption goes through"),
    Mutation(
        "move_tolerance_ignored", ("eplb.core.policy.balanced",),
        "    tol = DEFAULT_MOVE_TOLERANCE if options is None else float(options.move_tolerance)\n",
        "    tol = DEFAULT_MOVE_TOLERANCE\n",
        ("tests/test_planner.py", "-k", "previous"),
        "the planner ignores the configured move tolerance"),
    Mutation(
        "recorder_drops_steps", ("eplb.runtime.recorder",),
        "        i = self.steps_recorded % self.window_size\n",
        "        i = (self.steps_recorded // 2 * 2) % self.window_size\n",
        ("tests/test_recorder.py",),
        "every second step overwrites the previous one's window entry"),
    Mutation(
        "failed_change_forgets_switched_layers", ("eplb.core.placement",),
        "        p2l[layers] = other.physical_to_logical[layers]\n",
        "        pass\n",
        ("tests/test_runtime.py::test_failure_mid_transfer_leaves_every_layer_old_or_new",),
        "after an abort the placement forgets the layers that did switch"),
    Mutation(
        "finish_without_agreed_planning", ("eplb.runtime.placement_change",),
        "        return self._all_planned and self.layers is not None and self.committed == len(self.layers)\n",
        "        return self.layers is not None and self.committed == len(self.layers)\n",
        ("tests/test_mover_empty_change.py",),
        "a change with no changed layer finishes on this rank's own planning (not agreed)"),
    Mutation(
        "abort_only_where_it_failed", ("eplb.runtime.placement_change",),
        "        if not all_ok:\n",
        "        if not all_ok and self.error is not None:\n",
        ("tests/test_async.py", "-k", "failed_exchange"),
        "ranks that did not fail themselves ignore the agreed abort"),
]


def module_file(root: Path, module: str) -> Path | None:
    """The source file of `module` under `root`, found by name (nothing is imported)."""
    base = root.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def locate(root: Path, m: Mutation) -> Path:
    """The file the mutation applies to; raises SystemExit(2) unless the snippet occurs
    exactly once in the first candidate module that contains it."""
    tried = []
    for module in m.modules:
        path = module_file(root, module)
        if path is None:
            tried.append(f"{module}: no such module")
            continue
        n = path.read_text().count(m.snippet)
        if n == 1:
            return path
        tried.append(f"{module}: snippet found {n} times")
        if n > 1:
            break
    sys.exit(f"mutation {m.name}: snippet {m.snippet.strip()!r} not found exactly once "
             f"({'; '.join(tried)})")


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (not .git, .venv)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def child_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "tests")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports(copy: Path) -> None:
    """The child imports the copy's packages, not the editable install's."""
    got = subprocess.run([sys.executable, "-c", "import eplb, moe; print(eplb.__file__); print(moe.__file__)"],
                         cwd=copy, env=child_env(copy), capture_output=True, text=True)
    if got.returncode != 0:
        sys.exit(f"importing eplb and moe from the copy failed:\n{got.stderr[-2000:]}")
    for line in got.stdout.split():
        if not Path(line).resolve().is_relative_to(copy.resolve()):
            sys.exit(f"the child imports {line}, not the copy in {copy}: fix PYTHONPATH")


def run_pytest(copy: Path, args: tuple[str, ...], limit_s: float) -> tuple[int | None, float, str]:
    """(exit status or None on timeout, seconds, last lines of output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=child_env(copy), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # pytest and the ranks it started (its own session)
        out, _ = proc.communicate()
        rc = None
    tail = "\n".join(line for line in out.splitlines()[-3:])
    return rc, time.monotonic() - t0, tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", nargs="*", help="run only these mutations (names)")
    ap.add_argument("--baseline", action="store_true",
                    help="first check that the selected tests pass without mutation")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ns = ap.parse_args()
    chosen = [m for m in MUTATIONS if not ns.only or m.name in ns.only]
    if ns.only and len(chosen) != len(set(ns.only)):
        sys.exit(f"unknown mutation in {ns.only}; known: {[m.name for m in MUTATIONS]}")
    if ns.list:  # also checks every snippet
        for m in MUTATIONS:
            print(f"{m.name:38s} {locate(ROOT, m).relative_to(ROOT)}: {m.why}")
        return 0
    for m in chosen:  # every snippet, before any test runs
        locate(ROOT, m)

    rows, survived = [], 0
    if ns.baseline:
        with tempfile.TemporaryDirectory(prefix="eplb-baseline-") as tmp:
            copy = Path(tmp)
            copy_tree(copy)
            check_imports(copy)
            for args in dict.fromkeys(m.pytest_args for m in chosen):
                rc, sec, tail = run_pytest(copy, args, 900)
                print(f"baseline {' '.join(args)}: exit {rc} in {sec:.0f} s", flush=True)
                if rc != 0:
                    print(tail)
                    sys.exit("baseline failed: the selected tests must pass without mutation")
    for m in chosen:
        tmp = tempfile.mkdtemp(prefix=f"eplb-mut-{m.name}-")
        copy = Path(tmp)
        try:
            copy_tree(copy)
            check_imports(copy)
            path = locate(copy, m)
            text = path.read_text()
            path.write_text(text.replace(m.snippet, m.replacement, 1))
            rc, sec, tail = run_pytest(copy, m.pytest_args, m.limit_s)
        finally:
            if not ns.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        caught = rc not in (None, 0, 5)
        verdict = "yes" if caught else ("NO (timeout)" if rc is None else
                                        "NO (no tests)" if rc == 5 else "NO")
        survived += not caught
        rows.append((m.name, verdict, sec))
        print(f"{m.name}: {verdict} ({sec:.0f} s; pytest {' '.join(m.pytest_args)})", flush=True)
        if not caught:
            print("  " + tail.replace("\n", "\n  "))
    width = max(len(r[0]) for r in rows)
    print(f"\n| {'mutation':{width}s} | caught? | seconds |")
    print(f"|{'-' * (width + 2)}|---------|---------|")
    for name, verdict, sec in rows:
        print(f"| {name:{width}s} | {verdict:7s} | {sec:7.0f} |")
    print(f"\n{len(rows) - survived} of {len(rows)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
