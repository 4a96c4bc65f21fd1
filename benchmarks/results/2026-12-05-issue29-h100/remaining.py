"""Issue 29: the GPU rows still to run after 2026-12-05 (fifth session), packed into device
calls. Rows: those of ../2026-12-05-issue29-fresh-counts/forecast/schedule.md not scored in
this folder, then the configurations whose plans b8c0c2b changed and that have no row here.
A row's limit is 2 x its H200 forecast + 30 s (this session's H100 ran rows 1.0-1.3x their
H200 forecast in wall time, and the retimed prefill row did not finish in 190 s against a
108 s forecast); a call holds rows up to 540 s of limits (first fit, in the schedule's order).

    python benchmarks/results/2026-12-05-issue29-h100/remaining.py > benchmarks/results/2026-12-05-issue29-h100/remaining.md
"""
import re

import summary

CALL_S = 540
CHANGED_S = 120  # a changed configuration outside the schedule (DeepSeek-V3 EP 8 prefill): its limit


def main():
    done = {(m["model"], m["trace"], int(m["ep"]), m["preset"]) for _, m in summary.measured() if m["dd"]}
    rows = []  # (model, spec, limit)
    for line in (summary.GRID / "forecast" / "schedule.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 7 or not re.match(r"\d+:", cells[0]):
            continue
        ep, preset, trace, *extra = cells[0].split(":")
        model = "qwen3-235b" if "--model=qwen3-235b" in extra else "deepseek-v3"
        flags = [e for e in extra if not e.startswith("--model=")]
        if (model, trace, int(ep), preset) in done and not flags:
            continue
        limit = round(2 * float(cells[4]) + 30)
        rows.append((model, ":".join([ep, preset, trace, str(limit)] + ([",".join(flags)] if flags else [])), limit))
    for model, trace, ep, preset in sorted(summary.changed() - done):
        if not any(r[1].startswith(f"{ep}:{preset}:{trace}:") and r[0] == model for r in rows):
            rows.append((model, f"{ep}:{preset}:{trace}:{CHANGED_S}", CHANGED_S))
    print(f"{len(rows)} rows; limits {sum(r[2] for r in rows)} s in all\n")
    n = 0
    for model in ("deepseek-v3", "qwen3-235b"):
        calls: list[tuple[list[str], int]] = []  # first fit: a row joins the first call it fits in
        for m, spec, limit in rows:
            if m != model:
                continue
            i = next((i for i, (_, t) in enumerate(calls) if t + limit <= CALL_S), len(calls))
            if i == len(calls):
                calls.append(([], 0))
            calls[i] = (calls[i][0] + [spec], calls[i][1] + limit)
        for call, total in calls:
            n += 1
            print(f"# call {n}: {len(call)} rows, limits {total} s")
            print(f"OUT=$OUT/r{n} PLANS=.devplans/all SHARED=.devshared/traces/npy MODEL={model} "
                  f"taskset -c 4-15 bash benchmarks/issue29_gpu_rows.sh {' '.join(call)}")

if __name__ == "__main__":
    main()
