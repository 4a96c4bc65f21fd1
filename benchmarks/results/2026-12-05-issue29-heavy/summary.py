"""Issue 29, 2026-12-05 (sixth session): the analytic grid planned with the heavy-replica
check (`moves.HEAVY_ROWS`, `.devplans/heavy`; this folder) against the grid of the plans
before it (../2026-12-05-issue29-fresh-counts, `.devplans/all`, scored by the same code):
targets 1 and 2, moves on the steady family, and every row that changed (the report of
../2026-12-05-issue29-fresh-counts/summary.py). Run from the repository root:

    python benchmarks/results/2026-12-05-issue29-heavy/summary.py > benchmarks/results/2026-12-05-issue29-heavy/summary.txt
"""
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEFORE = HERE.parent / "2026-12-05-issue29-fresh-counts"


def main() -> None:
    spec = importlib.util.spec_from_file_location("fresh_counts_summary", BEFORE / "summary.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    report.compare(HERE, BEFORE)


if __name__ == "__main__":
    main()
