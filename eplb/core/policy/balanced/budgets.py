"""Iteration budgets of the `balanced` planner: sizes only, never clocks.

The same input gives the same plan on every machine. An improvement iteration costs a
fixed number of passes over the R * p slots of all rows, so an iteration budget is a work
constant divided by R * p (pair exchanges), or by (R * p)^2 for the phases whose gain
does not pay for their cost on large problems (max-GPU iterations, moves from a previous
placement), clamped; on large problems with more than 64 rows the per-row overhead counts
too (x R / 64). Small problems (26 layers x 80 slots: R * p = 2080) get 19 pair-exchange
iterations, 20 max-GPU iterations (the limit) and 57 move iterations, where they have
converged; DeepSeek-V3-sized ones (58 layers x 288 slots: R * p = 16704)
get two pair-exchange iterations (one in the hierarchical case, 232 rows) and nothing
else. With two slots per GPU pair exchanges cannot improve on the packing and
replica-count moves are what helps, so that case gets max-GPU iterations on the linear
rule instead.
"""
from __future__ import annotations

PAIR_WORK, PAIR_ITERS = 40_000, (1, 40)  # pair-exchange iterations: work / (R p max(1, R/64))
MAX_WORK, MAX_ITERS = 250_000_000, (0, 20)  # max-GPU iterations: work / ((R p)^2 max(1, R/64))
MAX2_WORK = 600_000  # max-GPU iterations with two slots per GPU: work / (R p)
PREV_WORK, PREV_ITERS = 250_000_000, (0, 80)  # moves from a previous placement: work / (R p)^2
COUNT_WORK, COUNT_ITERS = 25_000_000, (0, 256)  # count-search steps: work / (R 4n p)
EXACT_COUNTS_MAX = 20_000  # two slots per GPU: count vectors per row up to which the search is exhaustive
EXACT_COUNTS_WORK = 50_000_000  # ... and item values over all rows (R x vectors x p) up to which it runs
COUNT_MOVES_WORK = 300_000  # small problems: slots of the count-move candidates of one step, at most
SMALL = 8192  # R * p up to which a problem counts as small (full effort, every row)
GOOD_ENOUGH = 5e-4  # large problems: rows with max/mean <= 1 + this are left as they are


def iterations(work: int, size: int, limits: tuple[int, int]) -> int:
    """work // size, clamped to limits = (lo, hi): an iteration budget from a problem size."""
    lo, hi = limits
    return int(min(hi, max(lo, work // max(size, 1))))
