"""Regenerate (or check) the output blocks of README.md and docs/*.md from the code as it is.

    python docs/regen.py            # rewrite every output block in place
    python docs/regen.py --check    # exit 1 and show the differences if a block is stale
    python docs/regen.py demo       # only the named blocks

An output block is a fenced block right after a marker line `<!-- regen: ID -->`. Its
first line is the command (`$ eplb demo --verify`), run from a scratch directory with
`eplb` and `torchrun` resolving to this checkout; the rest is what the command prints on
stdout. A session block (`<!-- regen: ID session -->`) is the transcript of the bash block
marked `<!-- run: ID -->` above it: each command that prints something, then its output.
A run block marked `<!-- run: ID (continues PREV) -->` goes on in the shell of block PREV
(same directory, PREV's background job still running): a chain of such blocks runs as one
script, and each block's transcript is its own part of it. Sessions run with HOME set to
their scratch directory (a block may write ~/.eplb).

Comparison (`--check`, and tests/test_docs_readme.py) goes line by line after masking the
figures that are not reproducible (TOLERANCE below, per block, stated in the README next to
each block): timings always; the rest of a seeded run must match exactly.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eplb.ops.launch import free_port  # noqa: E402 - below the ephemeral port range

DOCS = [ROOT / "README.md", ROOT / "docs" / "operations.md"]

MARK = re.compile(r"^<!-- regen: ([\w-]+)( session)? -->\n```(\w*)\n(.*?)^```\n", re.S | re.M)
RUN_MARK = re.compile(r"^<!-- run: ([\w-]+)(?: \(continues ([\w-]+)\))?(?: \([^\n]*\))? -->\n"
                      r"```bash\n(.*?)^```\n", re.S | re.M)
BLOCK_SEP = "@@ regen: block "  # a line the chain's script prints between its blocks

# figures that vary from run to run on the same code: wall-clock times (and what is
# derived from them), masked as <t>
TIMINGS = [r"\d+(\.\d+)? ms\b", r"\b\d+(\.\d+)? s\b", r"\d+(\.\d+)? it/s"]
# float32 round-off of the verify comparisons: depends on the CPU's kernels, not on the
# placement; the line's verdict (OK / FAILED, tolerance) is still compared
DIFFS = [r"(?<=max \|diff\| )\d\.\de[-+]\d\d"]
ANY_NUMBER = [r"\d+(\.\d+)?(e[-+]?\d+)?"]
TOLERANCE = {
    "demo": TIMINGS + DIFFS,          # seeded: balancedness, moves and MB exact
    "demo-qwen3": TIMINGS + DIFFS,    # seeded likewise
    "metrics": ANY_NUMBER,            # a live job: figures depend on when each command runs
    # docs/operations.md
    "ops-job": ANY_NUMBER,            # live jobs likewise
    # and the cut after 330 bytes falls after more or fewer counts: the list is one <#>
    "ops-load": ANY_NUMBER + [r"\[\[(<#>, ?)*(<#>)?$"],
    "ops-record": ANY_NUMBER,
    "ops-trace": ANY_NUMBER,
    # and whether a request finds a gain above min_gain depends on the step it lands at:
    # the CLI's "done ... moved" or "skipped ... nothing moved" line, and the second
    # request's "success" or "skipped" (any other outcome, "failed", still differs)
    "ops-trigger": ANY_NUMBER + [
        r"^(done at step <#>: balancedness <#> -> <#> \(predicted\), <#> experts moved, <#> MB, <#> ms"
        r"|skipped at step <#>: predicted gain \+<#> < min gain <#>; balancedness <#>, nothing moved)$",
        r'(?<="outcome": )"(success", "skipped": false|skipped", "skipped": true)'],
    "ops-slots": [r" +[\d.]+$"],  # seeded replay: exact but for the last column (plan ms)
}
# (blocks whose every number is masked are compared with runs of spaces inside a line
# collapsed: a table's column widths follow its figures)
# notes a live job prints or not depending on its speed: dropped before comparing (on a
# busy machine `eplb record` may take a snapshot before the job's next metrics update)
LIVE_NOTES = [r" \(no metrics update since the last snapshot\)$"]
OPTIONAL = {"metrics": LIVE_NOTES, "ops-job": LIVE_NOTES, "ops-record": LIVE_NOTES,
            "ops-trace": LIVE_NOTES}
PORT = 9400  # the port the docs use; a run takes a free one and shows it as this


@dataclass
class Block:
    doc: Path
    id: str
    session: bool
    lang: str
    body: str
    start: int  # offsets of the body in the doc's text
    end: int


def find_blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, m.group(1), bool(m.group(2)), m.group(3), m.group(4), m.start(4), m.end(4))
            for m in MARK.finditer(text)]


def run_blocks(doc: Path) -> dict[str, str]:
    """id -> the bash code of each `<!-- run: ID -->` block."""
    return {m.group(1): m.group(3) for m in RUN_MARK.finditer(doc.read_text())}


def chain(doc: Path, block_id: str) -> list[str]:
    """The ids of the run blocks that run in one shell with `block_id`, first to last:
    its chain of `(continues PREV)` marks, both ways."""
    prev = {m.group(1): m.group(2) for m in RUN_MARK.finditer(doc.read_text())}
    first = block_id
    while prev[first] is not None:
        first = prev[first]
    ids = [first]
    while True:
        nxt = [k for k, v in prev.items() if v == ids[-1]]
        if not nxt:
            return ids
        assert len(nxt) == 1, f"{doc.name}: blocks {nxt} all continue {ids[-1]}"
        ids.append(nxt[0])


def shim_env(workdir: Path) -> dict:
    """An environment whose `eplb` and `torchrun` run this checkout with this interpreter
    (the console script of another install could be first on PATH)."""
    bindir = workdir / ".bin"
    bindir.mkdir(exist_ok=True)
    for name, module in (("eplb", "eplb"), ("torchrun", "torch.distributed.run")):
        f = bindir / name
        f.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def run_command(cmd: str, timeout: float = 600) -> str:
    """stdout of one documented command, run in a scratch directory."""
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run(["bash", "-c", cmd], cwd=tmp, env=shim_env(Path(tmp)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=timeout, start_new_session=True)
    if p.returncode != 0:
        raise RuntimeError(f"`{cmd}` exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def _strip_comment(line: str) -> str:
    return re.split(r"\s+#\s", line, maxsplit=1)[0].rstrip()


_OPENS = {"for": "done", "while": "done", "until": "done", "if": "fi", "case": "esac"}


def _commands(code: str) -> list[str]:
    """The commands of a bash block: a line ending in a backslash goes on on the next one,
    and a `for`/`if`/... that spans lines is one command up to its `done`/`fi` (lines kept,
    comments dropped)."""
    lines: list[str] = []
    for line in code.splitlines():
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line.strip()
        else:
            lines.append(line)
    cmds: list[str] = []
    depth = 0
    for line in lines:
        cmd = _strip_comment(line)
        if depth:
            cmds[-1] += "\n" + cmd if cmd else ""
        elif cmd:
            cmds.append(cmd)
        words = re.findall(r"[\w]+", re.sub(r"'[^']*'|\"[^\"]*\"", "", cmd))
        depth += sum(w in _OPENS for w in words) - sum(w in ("done", "fi", "esac") for w in words)
    return cmds


def session_script(code: str, first: int = 0) -> str:
    """A bash script running `code` command by command under `set -e` that prints,
    for each command with output, `$ command` and the output (its last line ended).
    Background (`... &`), one-line `until`/`while` and `wait` commands run as they are.
    `first` numbers the output files (blocks of one chain share a directory)."""
    out: list[str] = []
    for i, cmd in enumerate(_commands(code), first):
        if cmd.endswith("&") or (cmd.split()[0] in ("until", "wait", "while") and "\n" not in cmd):
            out.append(cmd)
            continue
        out.append(f"{{ {cmd}\n}} > .out{i} 2>&1 || {{ s=$?; printf '%s\\n' {shlex.quote('FAILED: ' + cmd)} >&2; "
                   f"cat .out{i} >&2; exit $s; }}")
        out.append(f"if [ -s .out{i} ]; then printf '%s\\n' {shlex.quote('$ ' + cmd)}; cat .out{i}; "
                   f"[ -z \"$(tail -c 1 .out{i})\" ] || echo; fi")
    return "\n".join(out) + "\n"


def _script(codes: dict[str, str]) -> str:
    """One bash script for a chain of blocks (id -> code, in order), printing BLOCK_SEP
    and the id before each block's transcript."""
    # (no pipefail: `curl ... | grep -q` may cut curl off; grep's status is the answer)
    out = ["set -e", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed line stops the demo"]
    for n, (block_id, code) in enumerate(codes.items()):
        out.append(f"printf '%s\\n' {shlex.quote(BLOCK_SEP + block_id)}")
        out.append(session_script(code, 1000 * n))
    return "\n".join(out)


def run_session(code: str | dict[str, str], workdir: Path, timeout: float = 600) -> str | dict[str, str]:
    """Run a documented bash block as written (or a chain of them, id -> code: one shell),
    on a free port instead of PORT (shown as PORT), with HOME=workdir; the transcript (of
    each block). Raises with the failing command's output if a command fails."""
    port = free_port()
    codes = {"": code} if isinstance(code, str) else code
    script = _script({k: v.replace(str(PORT), str(port)) for k, v in codes.items()})
    env = dict(shim_env(workdir), HOME=str(workdir))
    # output to files, not pipes: a process the block leaves behind (a job's ranks) would
    # hold a pipe open; the block is over when bash exits, and its process group goes then
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        p = subprocess.Popen(["bash", "-c", script], cwd=workdir, env=env, stdout=fout,
                             stderr=ferr, text=True, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, 9)  # whatever the block left running (or bash, on a timeout)
            except ProcessLookupError:
                pass
            p.wait()
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    if p.returncode != 0:
        raise RuntimeError(f"the block failed (exit {p.returncode}):\n{err[-4000:]}")
    parts = re.split(f"^{re.escape(BLOCK_SEP)}(.*)\n", out.replace(str(port), str(PORT)), flags=re.M)
    found = dict(zip(parts[1::2], parts[2::2]))  # id -> its transcript
    return found[""] if isinstance(code, str) else found


def run_chain(doc: Path, block_id: str, workdir: Path, timeout: float = 600) -> dict[str, str]:
    """Run the chain of blocks `block_id` belongs to in one shell; id -> transcript."""
    code = run_blocks(doc)
    return run_session({k: code[k] for k in chain(doc, block_id)}, workdir, timeout)


_CHAINS: dict[tuple, dict[str, str]] = {}  # (doc, chain ids) -> transcripts, run once per process


def produce(block: Block) -> str:
    """The block's body as the code prints it now (a chain of blocks runs once)."""
    if block.session:
        key = (block.doc, tuple(chain(block.doc, block.id)))
        if key not in _CHAINS:
            with tempfile.TemporaryDirectory() as tmp:
                _CHAINS[key] = run_chain(block.doc, block.id, Path(tmp))
        return _CHAINS[key][block.id]
    first = block.body.splitlines()[0]
    if not first.startswith("$ "):
        raise ValueError(f"{block.doc.name}: block {block.id}: first line must be `$ command`")
    return first + "\n" + run_command(first[2:])


def mask(text: str, block_id: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        for pattern in OPTIONAL.get(block_id, []):
            line = re.sub(pattern, "", line)
        patterns = TOLERANCE.get(block_id, TIMINGS)
        for pattern in patterns:
            line = re.sub(pattern, "<#>", line)
        if ANY_NUMBER[0] in patterns:  # every figure varies: so do the widths of aligned columns
            line = re.sub(r"(?<=\S) {2,}", " ", line)
        lines.append(line.rstrip())
    return lines


def differences(block: Block, new: str) -> list[str]:
    old, cur = mask(block.body, block.id), mask(new, block.id)
    if old == cur:
        return []
    return list(difflib.unified_diff(old, cur, f"{block.doc.name} ({block.id})", "now", lineterm=""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ids", nargs="*", help="only these blocks (default: all)")
    p.add_argument("--check", action="store_true", help="compare, do not write; exit 1 if stale")
    a = p.parse_args(argv)
    stale = 0
    for doc in DOCS:
        new = {}
        for b in find_blocks(doc):
            if a.ids and b.id not in a.ids:
                continue
            print(f"{doc.name}: {b.id} ...", file=sys.stderr, flush=True)
            new[b.id] = produce(b)
            diff = differences(b, new[b.id])
            if diff:
                stale += 1
                print("\n".join(diff))
        if not a.check and new:
            # read again: the runs take minutes, and the doc may have been edited meanwhile
            text = doc.read_text()
            for b in reversed(find_blocks(doc)):  # from the end: earlier offsets stay valid
                if b.id in new:
                    text = text[:b.start] + new[b.id] + text[b.end:]
            doc.write_text(text)
    if a.check and stale:
        print(f"{stale} block(s) stale: run python docs/regen.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
