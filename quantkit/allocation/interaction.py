"""From the sum of single-module KL increments to the KL of the whole quantized model.

Per-linear increments do not add: the errors of 200 linears compound through the layers, so the
KL of a whole mixture is far above the sum of the KLs each of its linears costs alone (on the demo
model about 3x at 4 bits, more at 2-3 bits). The mapping is measured, not assumed: the whole model
at every uniform candidate scheme gives points (sum of its single-linear KLs, measured whole KL),
and a mixture's KL is read off the piecewise-linear curve through them in log-log coordinates
(straight-line extrapolation beyond the end points with the end segments' slopes). The mapping is
monotone, so it changes the predicted KL of an allocation, never which mixture is best: the
knapsack minimises the sum.
"""
from __future__ import annotations

import math
from typing import Any, Optional


def fit(points: list[tuple[float, float]]) -> Optional[dict[str, Any]]:
    """The mapping through (sum of single KLs, measured whole KL) points; None without a usable point."""
    pts = sorted((s, m) for s, m in points if s > 0 and m > 0)
    if not pts:
        return None
    xs, ys, floor = [], [], -math.inf
    for s, m in pts:  # monotone: a larger sum never predicts a smaller whole-model KL
        floor = max(floor, math.log(m))
        if xs and math.log(s) <= xs[-1]:
            ys[-1] = max(ys[-1], floor)
            continue
        xs.append(math.log(s))
        ys.append(floor)
    return {"log_sum": xs, "log_measured": ys}


def predict(total: float, mapping: Optional[dict[str, Any]]) -> float:
    """Predicted whole-model KL of a mixture whose single-linear KLs sum to `total`."""
    if mapping is None or total <= 0:
        return total
    xs, ys = mapping["log_sum"], mapping["log_measured"]
    x = math.log(total)
    if len(xs) == 1:
        return total * math.exp(ys[0] - xs[0])
    i = 0 if x <= xs[0] else len(xs) - 2 if x >= xs[-1] else max(j for j in range(len(xs) - 1) if xs[j] <= x)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return math.exp(ys[i] + slope * (x - xs[i]))
