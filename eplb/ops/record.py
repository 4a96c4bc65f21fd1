"""`eplb record`: a running job's recorded load (GET /load of its server) into a file.

One snapshot (.json: the server's answer, which `eplb plan` reads; .npy: logical_count
[L, N]), or with --every/--count a [T, L, N] trace for `eplb simulate`: entry k holds the
tokens routed between snapshots k-1 and k, told from the running totals of the answers
(a restarted or resized job is refused). Bad input raises ValueError, which eplb.ops.cli
prints as one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _record_write(out: Path, snaps: dict, trace: bool) -> None:
    """Write one /load snapshot (`trace` False: the answer as JSON, or logical_count as an
    [L, N] .npy) or a trace (`snaps`: counts [T, L, N], steps, step, time, meta)."""
    import numpy as np

    try:
        if not trace:
            if out.suffix.lower() == ".npy":
                np.save(out, snaps["counts"])
            else:
                out.write_text(json.dumps(snaps["answer"]) + "\n")
        elif out.suffix.lower() == ".npy":
            np.save(out, snaps["counts"])
        elif out.suffix.lower() == ".npz":
            np.savez(out, counts=snaps["counts"], steps=np.asarray(snaps["steps"], np.int64),
                     step=np.asarray(snaps["step"], np.int64), time=np.asarray(snaps["time"]))
        else:
            out.write_text(json.dumps(dict(snaps["meta"], logical_count=snaps["counts"].tolist(),
                                           steps=snaps["steps"], step=snaps["step"],
                                           time=snaps["time"])) + "\n")
    except OSError as e:
        raise ValueError(f"--out: cannot write {out} ({e.strerror or e.__class__.__name__})") from None


def _record_counts(d: dict, key: str, url: str):
    """`d[key]` of a /load answer as a checked [L, N] array (int64 when all integral)."""
    import numpy as np

    from eplb.core.loadio import as_load

    if key not in d:
        raise ValueError(f"{url}: the answer has no {key} (an eplb older than the load export?)")
    arr = np.asarray(d[key]) if isinstance(d[key], list) else None
    if arr is None or arr.ndim != 2:
        raise ValueError(f"{url}: {key} is not an [L, N] array")
    load = as_load(arr, f"{url}: {key}")  # numeric, finite, non-negative: [L, N] float64
    return load.astype(np.int64) if np.array_equal(load, np.round(load)) else load


def record(a: argparse.Namespace) -> int:
    import numpy as np

    from eplb.core.loadio import MAX_LOAD_ELEMENTS
    from eplb.ops.client import TriggerError, fetch_load

    out = Path(a.out)
    trace = a.count is not None or a.every is not None
    if trace and (a.count is None or a.every is None):
        raise ValueError("--every and --count go together (a trace of K entries from K + 1 "
                         "snapshots S seconds apart)")
    kinds = (".json", ".npy", ".npz") if trace else (".json", ".npy")
    if out.suffix.lower() not in kinds:
        raise ValueError(f"--out: {out.name} must end in {', '.join(kinds)}"
                         + ("" if trace else " (.npz with --every/--count)"))
    if not out.resolve().parent.is_dir():
        raise ValueError(f"--out: directory does not exist: {out.parent}")
    if out.is_dir():
        raise ValueError(f"--out: {out} is a directory")
    if not 0 < a.timeout <= 3600:
        raise ValueError(f"--timeout must be in (0, 3600] seconds, got {a.timeout:g}")
    if trace and not 0 < a.every <= 86400:
        raise ValueError(f"--every must be in (0, 86400] seconds, got {a.every:g}")
    if trace and a.count > 10**6:
        raise ValueError(f"--count: {a.count} is more than the supported {10**6}")

    def fetch() -> dict:
        try:
            return fetch_load(a.url, a.timeout)
        except TriggerError as e:
            raise ValueError(str(e)) from None

    first = fetch()
    if not trace:
        counts = _record_counts(first, "logical_count", a.url)  # [L, N]
        _record_write(out, {"answer": first, "counts": counts}, trace=False)
        L, N = counts.shape
        print(f"wrote {out}: {L} layers x {N} experts, the window of {first.get('steps')} steps "
              f"at step {first.get('step')}")
        return 0

    total = _record_counts(first, "total_logical_count", a.url)  # [L, N] since metrics attached
    if "total_steps" not in first:
        raise ValueError(f"{a.url}: the answer has no total_steps (an eplb older than the load export?)")
    L, N = total.shape
    if a.count * L * N > MAX_LOAD_ELEMENTS:
        raise ValueError(f"--count {a.count}: {a.count} x {L} x {N} counts are more than the "
                         f"supported {MAX_LOAD_ELEMENTS}")
    prev_steps, prev_step = int(first["total_steps"]), first.get("step")
    entries, steps, at_step, times = [], [], [], []
    meta = {"layers": L, "experts": N, "gpus": first.get("gpus"), "every": a.every, "url": a.url,
            "start_step": prev_step}
    print(f"eplb record: {a.url} at step {prev_step}; {a.count} snapshots every {a.every:g} s",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        for k in range(1, a.count + 1):
            time.sleep(max(0.0, t0 + k * a.every - time.monotonic()))
            d = fetch()
            now = _record_counts(d, "total_logical_count", a.url)
            n = int(d.get("total_steps", -1))
            if now.shape != (L, N):
                raise ValueError(f"{a.url}: the job changed between snapshots ({L} x {N} -> "
                                 f"{now.shape[0]} x {now.shape[1]} experts)")
            if n < prev_steps or (now < total).any():
                raise ValueError(f"{a.url}: the job restarted between snapshots (step "
                                 f"{prev_step} -> {d.get('step')}, counts went down)")
            entries.append(now - total)
            steps.append(n - prev_steps)
            at_step.append(int(d.get("step", -1)))
            times.append(float(d.get("time", 0.0)))
            note = "" if n > prev_steps else " (no metrics update since the last snapshot)"
            print(f"eplb record: {k}/{a.count} at step {d.get('step')}: {n - prev_steps} steps, "
                  f"{int(entries[-1].sum())} token-expert assignments{note}",
                  file=sys.stderr, flush=True)
            total, prev_steps, prev_step = now, n, d.get("step")
    except KeyboardInterrupt:
        if not entries:
            raise
        print(f"eplb record: interrupted after {len(entries)} of {a.count} snapshots", file=sys.stderr)
    counts = np.stack(entries)  # [T, L, N]
    _record_write(out, {"counts": counts, "steps": steps, "step": at_step, "time": times,
                        "meta": meta}, trace=True)
    print(f"wrote {out}: {len(entries)} snapshots {a.every:g} s apart ([T, L, N] = "
          f"[{len(entries)}, {L}, {N}]), steps {meta['start_step']}..{at_step[-1]} "
          f"({sum(steps)} steps)")
    return 0 if len(entries) == a.count else 130
