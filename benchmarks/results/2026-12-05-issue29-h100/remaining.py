"""Issue 29: the GPU rows still to run after 2026-12-05 (fifth session), packed into device
calls. Rows: those of ../2026-12-05-issue29-fresh-counts/forecast/schedule.md not scored in
this folder, then the configurations whose plans b8c0c2b changed and that have no row here.
A row's limit is 2 x its H200 forecast + 30 s (this session's H100 ran rows 1.0-1.3x their
H200 forecast in wall time, and the retimed prefill row did not finish in 190 s against a
108 s forecast, nor in 247 s the next session: it gets a call of its own, RETIME_S); a call
holds rows up to 540 s of limits (CALL_S, or one row alone). The rows closest to deepseek go
first (by the H200 fit's forecast, or the analytic ratio where the schedule has none), so
that a short device session runs the rows at risk: first fit in that order, one model per
call, the calls printed by their lowest ratio.

    python benchmarks/results/2026-12-05-issue29-h100/remaining.py > benchmarks/results/2026-12-05-issue29-h100/remaining.md
"""
import summary

CALL_S = 540
CHANGED_S = 120  # a changed configuration outside the schedule (DeepSeek-V3 EP 8 prefill): its limit
RETIME_S = 560  # the retimed row: a call of its own (it did not finish in 190 s, nor in 247 s on 2026-12-05 (sixth))


def main():
    print_calls(rows())


def rows() -> list:
    """The rows to run: (model, spec, limit, ratio)."""
    done = {(m["model"], m["trace"], int(m["ep"]), m["preset"]) for _, m in summary.measured() if m["dd"]}
    an = summary.analytic()
    rows = []  # (model, spec, limit, ratio)
    for model, ep, preset, trace, flags, seconds, ratio in summary.schedule():
        if (model, trace, int(ep), preset) in done and not flags:
            continue
        limit = round(2 * seconds + 30)
        if any(f.startswith("--retime") for f in flags):
            limit = max(limit, RETIME_S)
        rows.append((model, ":".join([ep, preset, trace, str(limit)] + ([",".join(flags)] if flags else [])), limit,
                     ratio))
    for model, trace, ep, preset in sorted(summary.changed() - done):
        if not any(r[1].startswith(f"{ep}:{preset}:{trace}:") and r[0] == model for r in rows):
            rows.append((model, f"{ep}:{preset}:{trace}:{CHANGED_S}", CHANGED_S, an[(model, trace, ep, preset)]))
    return rows


def print_calls(rows, plans: str = ".devplans/all") -> None:
    """Pack rows (model, spec, limit, ratio) into device calls and print them (see above)."""
    print(f"{len(rows)} rows; limits {sum(r[2] for r in rows)} s in all\n")
    rows = sorted(rows, key=lambda r: r[3])
    calls = []  # (lowest ratio, model, specs, limits, ratios)
    for model in ("deepseek-v3", "qwen3-235b"):
        mine: list[list] = []  # first fit: a row joins the first call it fits in
        for m, spec, limit, ratio in rows:
            if m != model:
                continue
            i = next((i for i, c in enumerate(mine) if c[1] + limit <= CALL_S), len(mine))
            if i == len(mine):
                mine.append([[], 0, []])
            mine[i][0].append(spec)
            mine[i][1] += limit
            mine[i][2].append(ratio)
        calls += [(min(r), model, specs, total, r) for specs, total, r in mine]
    for n, (_, model, specs, total, ratios) in enumerate(sorted(calls, key=lambda c: c[0]), 1):
        print(f"# call {n}: {len(specs)} rows, limits {total} s; expected default/deepseek "
              f"{' '.join(f'{x:.4f}' for x in ratios)}")
        print(f"OUT=$OUT/r{n} PLANS={plans} SHARED=.devshared/traces/npy MODEL={model} "
              f"taskset -c 4-15 bash benchmarks/issue29_gpu_rows.sh {' '.join(specs)}")


if __name__ == "__main__":
    main()
