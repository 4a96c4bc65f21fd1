"""Issue 29: default/deepseek over 24 draws of the synthetic families (29-52), replayed on
GEMM fits by `benchmarks/diag/issue29_fitted_sweep.py`, one markdown file per
configuration (MODEL-EP-TRACE.md or MODEL-EP-[PRESET-]TRACE.md). Per configuration: draws,
how many are below deepseek (fit with expected counts, fit with Poisson counts, analytic),
the lowest and the mean of each.

    python benchmarks/results/2026-12-05-issue29-h100/draws.py benchmarks/results/2026-12-05-issue29-h100/prefill-draws24
"""
import re
import sys
from pathlib import Path

import numpy as np


def main(folder: str) -> None:
    print("| configuration | fit | draws | below deepseek (fit expected / Poisson / analytic) | lowest | mean |")
    print("|---|---|---|---|---|---|")
    for f in sorted(Path(folder).glob("*.md")):
        text = f.read_text().splitlines()
        v = np.array([[float(x) for x in line.split("|")[2:5]] for line in text if re.match(r"\| \d", line)])
        head = text[0]  # "MODEL EP M PRESET TRACE, settings; fit: SOURCE"
        conf, fit = head.split(", ", 1)[0], head.rsplit("fit: ", 1)[-1]
        below = " / ".join(str(int(x)) for x in (v < 1).sum(0))
        low = " / ".join(f"{x:.4f}" for x in v.min(0))
        mean = " / ".join(f"{x:.4f}" for x in v.mean(0))
        print(f"| {conf} | {fit} | {len(v)} | {below} | {low} | {mean} |")


if __name__ == "__main__":
    main(sys.argv[1])
