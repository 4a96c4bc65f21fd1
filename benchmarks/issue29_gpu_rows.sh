#!/usr/bin/env bash
# Issue 29 on one GPU, row by row: `--cost gpu` replays of chosen configurations from plans
# made beforehand (`benchmarks/issue29.py --plan-only`), each under its own time limit, so a
# slow row cannot take the ones after it down, and everything packed into ONE archive (a
# device that returns few files keeps every row's json and GEMM timings).
#
#   OUT=/dir PLANS=/plans SHARED=/traces/npy bash benchmarks/issue29_gpu_rows.sh SPEC [SPEC ...]
#
# SPEC is EP:PRESET:TRACE[:SECONDS[:EXTRA]], e.g. 64:prefill:esft:150 or
# 8:decode:olmoe:120:--retime=1 (EXTRA: issue29.py flags, commas for spaces). Rows run in
# the order given; SECONDS (default 180) is the row's limit (a row cut by it keeps what
# it scored: nothing, or its GEMM timings). Writes $OUT/rows.log (every row's result line
# and exit code) and $OUT/rows.tgz (each row's folder: issue29.json, gemms.json(.gz),
# rounds.json, its log), rewritten after each row. MODEL (default deepseek-v3) and PYTHON
# (default python3) can be set. Seen on one H200 (2026-12-05): decode rows at EP 64-256 take
# 2-30 s, EP 8 decode 40-90 s; prefill rows 30-240 s, but the shifting families' prefill
# rows did not finish in 110 s (EP 8) and 230 s (EP 64). Each row's line gives its wall
# time (start-up included). Forecast a row's GEMM time on a CPU before spending device time
# on it: benchmarks/diag/issue29_row_time.py (same SPEC, `--model=M` in EXTRA for MODEL).
set -u
OUT=${OUT:?set OUT to the output folder}
PLANS=${PLANS:?set PLANS to the folder of plans made by issue29.py --plan-only}
SHARED=${SHARED:-$( [ -d ../shared/traces/npy ] && echo ../shared/traces/npy || echo shared/traces/npy )}
MODEL=${MODEL:-deepseek-v3}
PY=${PYTHON:-python3}
# prefill rows at EP 256 time GEMMs of millions of rows: without expandable segments one ran
# out of memory on an H100 with 13 GiB free but fragmented (benchmarks/README.md, 2026-12-06)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
[ $# -gt 0 ] || { echo "usage: OUT=... PLANS=... bash $0 EP:PRESET:TRACE[:SECONDS[:EXTRA]] ..." >&2; exit 2; }
cd "$(dirname "$0")/.."
WORK=$(mktemp -d)
mkdir -p "$OUT"
: > "$OUT/rows.log"
for spec in "$@"; do
    IFS=: read -r ep preset trace seconds extra <<< "$spec"
    if [ -z "$ep" ] || [ -z "$preset" ] || [ -z "$trace" ]; then
        echo "bad SPEC '$spec': want EP:PRESET:TRACE[:SECONDS[:EXTRA]]" | tee -a "$OUT/rows.log" >&2
        continue
    fi
    seconds=${seconds:-180}
    name="ep${ep}-${preset}-${trace}${extra:+-${extra//[^a-zA-Z0-9=.]/_}}"  # EXTRA in the name: rows differing only there keep their folders apart
    mkdir -p "$WORK/$name"
    t0=$(date +%s)
    # shellcheck disable=SC2086 # EXTRA is split on purpose
    timeout "$seconds" "$PY" benchmarks/issue29.py --cost gpu --plans "$PLANS" --ep "$ep" --models "$MODEL" \
        --presets "$preset" --traces "$trace" --shared "$SHARED" --out "$WORK/$name" ${extra//,/ } \
        > "$WORK/$name/log.txt" 2>&1
    rc=$?
    line=$(grep "default/deepseek" "$WORK/$name/log.txt" | tail -1)
    echo "$name rc $rc wall $(( $(date +%s) - t0 )) s ${line:-(no row scored)}" | tee -a "$OUT/rows.log"
    # the archive is rewritten after every row: a call cut short still returns the rows done
    find "$WORK" -name gemms.json -exec gzip -f {} \;
    tar czf "$OUT/rows.tgz.part" -C "$WORK" . && mv "$OUT/rows.tgz.part" "$OUT/rows.tgz"
done
rm -rf "$WORK"
echo "rows: $OUT/rows.log, archive: $OUT/rows.tgz" >&2
