"""Multiple-choice knapsack: one candidate per item, total cost within a budget, least total value.

Exact dynamic programming over the cost above each item's cheapest candidate, in units of `quantum`
bytes: the greatest common divisor of those extra costs when the table stays under MAX_UNITS (then
the answer is exactly optimal), else the budget spread over MAX_UNITS units with every cost rounded
*up*, so any choice accepted still holds the budget in exact bytes (it can miss a choice whose slack
is under one unit per item). The tests check it against a brute-force search.
"""
from __future__ import annotations

import math
from functools import reduce
from typing import Sequence

import numpy as np

from quantkit.errors import QuantkitError

MAX_UNITS = 1 << 17  # DP table: items x units cells (int16 choices)


def minimum_cost(costs: Sequence[Sequence[int]]) -> int:
    return sum(min(c) for c in costs)


def solve(costs: Sequence[Sequence[int]], values: Sequence[Sequence[float]], budget: int,
          quantum: int | None = None) -> list[int]:
    """Index of the chosen candidate per item: sum of values least with sum of costs <= budget."""
    n = len(costs)
    if n == 0:
        return []
    if len(values) != n or any(len(c) != len(v) or not c for c, v in zip(costs, values)):
        raise ValueError("costs and values need the same non-empty candidate lists per item")
    floor = minimum_cost(costs)
    if budget < floor:
        raise QuantkitError(f"budget of {budget} bytes is below the smallest possible, {floor} bytes")
    extra = [[int(c) - min(row) for c in row] for row in costs]
    room = budget - floor
    if quantum is None:
        quantum = reduce(math.gcd, (e for row in extra for e in row if e), 0) or 1
        if room // quantum > MAX_UNITS:
            quantum = math.ceil(room / MAX_UNITS)
    units = room // quantum
    best = np.full(units + 1, np.inf)
    best[0] = 0.0  # best[u]: least total value of the items so far with exactly u units of extra cost
    choice = np.zeros((n, units + 1), dtype=np.int16)
    for i in range(n):
        new = np.full(units + 1, np.inf)
        for j, (e, v) in enumerate(zip(extra[i], values[i])):
            eu = -(-e // quantum)  # rounded up: the DP never under-counts a cost
            if eu > units:
                continue
            cand = np.full(units + 1, np.inf)
            cand[eu:] = best[:units + 1 - eu] + float(v)
            better = cand < new
            new[better] = cand[better]
            choice[i][better] = j
        best = new
    u = int(np.argmin(best))  # finite: every item's cheapest candidate costs 0 units
    picks = [0] * n
    for i in range(n - 1, -1, -1):
        j = int(choice[i][u])
        picks[i] = j
        u -= -(-extra[i][j] // quantum)
    return picks
