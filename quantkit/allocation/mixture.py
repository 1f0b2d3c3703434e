"""The sensitivity table as rows, and a mixture chosen from it under a budget.

A row is one (linear, scheme): its stored bytes (the format's packed tensors), its proxy, its
predicted KL increment, and its measured KL where it was measured. The same rows are the JSON
report and the allocation's input, so `quantize --sensitivity report.json` allocates from exactly
what the report shows.
"""
from __future__ import annotations

from typing import Any, Optional

from quantkit.allocation import knapsack
from quantkit.allocation.budget import human_size
from quantkit.errors import QuantkitError
from quantkit.scheme import LinearScheme


def table_rows(measured: dict[str, Any], costs: dict[str, dict[str, int]], candidates: dict[str, tuple],
               shapes: dict[str, tuple[int, int]], layers_prefix: str) -> list[dict[str, Any]]:
    from quantkit.allocation.sensitivity import layer_of, scheme_label

    rows = []
    for name, schemes in candidates.items():
        weights = shapes[name][0] * shapes[name][1]
        for s in schemes:
            label = scheme_label(s)
            if label not in costs[name]:
                continue
            nbytes = costs[name][label]
            rows.append({"linear": name, "layer": layer_of(name, layers_prefix), "shape": list(shapes[name]),
                         "scheme": label, "bits": s.bits, "group_size": s.group_size, "sym": s.sym, "bytes": nbytes,
                         "weights": weights,
                         "bits_per_weight": round(8 * nbytes / weights, 4),
                         "proxy": measured["proxy"][(name, label)],
                         "predicted_kl": measured["predicted"][(name, label)],
                         "measured_kl": measured["measured"].get((name, label))})
    return rows


def by_linear(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["linear"], []).append(r)
    return out


def row_scheme(row: dict[str, Any]) -> LinearScheme:
    return LinearScheme(bits=int(row["bits"]), group_size=int(row["group_size"]), sym=bool(row["sym"]))


def allocate(rows: list[dict[str, Any]], budget_bytes: int, what: str = "budget") -> dict[str, dict[str, Any]]:
    """The row chosen per linear: least summed predicted KL with summed bytes <= budget_bytes.

    Linears that serving engines fuse (q/k/v, gate/up: quantkit.formats.fused_linears; vLLM serves a
    fused layer at one scheme) are one knapsack item whose candidates are the schemes all members have."""
    items = _share_one_scheme(by_linear(rows))
    costs = [[sum(r["bytes"] for r in c) for c in item] for item in items]
    floor = knapsack.minimum_cost(costs)
    if budget_bytes < floor:
        raise QuantkitError(f"{what} is below the smallest possible: every linear at its smallest scheme takes "
                            f"{_describe(floor, rows)}; raise the target")
    picks = knapsack.solve(costs, [[sum(r["predicted_kl"] for r in c) for c in item] for item in items], budget_bytes)
    return {r["linear"]: r for item, j in zip(items, picks) for r in item[j]}


def _share_one_scheme(table: dict[str, list[dict[str, Any]]]) -> list[list[list[dict[str, Any]]]]:
    """Knapsack items: per item its candidates, each the rows (one per member linear) of one scheme."""
    from quantkit.formats.fused_linears import fused_groups

    grouped = {m: members for members in fused_groups(table).values() for m in members}
    items, seen = [], set()
    for name in table:
        if name in seen:
            continue
        members = grouped.get(name, [name])
        seen.update(members)
        common = [r["scheme"] for r in table[members[0]]
                  if all(any(o["scheme"] == r["scheme"] for o in table[m]) for m in members)]
        if not common:  # no scheme the format stores for every member: each on its own
            items += [[[r] for r in table[m]] for m in members]
            continue
        items.append([[next(o for o in table[m] if o["scheme"] == label) for m in members] for label in common])
    return items


def _describe(nbytes: int, rows) -> str:
    weights = sum(r["weights"] for r in by_linear(rows).values() for r in r[:1])
    return f"{human_size(nbytes)} of packed weights, {8 * nbytes / weights:.3f} bits per weight"


def summary(choice: dict[str, dict[str, Any]], mapping: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Size and predicted KL of a mixture: the sum of its linears' single KLs, read through the measured
    interaction mapping when there is one (quantkit.allocation.interaction)."""
    from quantkit.allocation import interaction

    nbytes = sum(r["bytes"] for r in choice.values())
    weights = sum(r["weights"] for r in choice.values())
    counts: dict[str, int] = {}
    for r in choice.values():
        counts[r["scheme"]] = counts.get(r["scheme"], 0) + 1
    total = sum(r["predicted_kl"] for r in choice.values())
    return {"packed_bytes": nbytes, "bits_per_weight": round(8 * nbytes / weights, 4),
            "predicted_kl": interaction.predict(total, mapping), "predicted_kl_sum": total, "schemes": counts}


def uniform(rows: list[dict[str, Any]], label: str) -> Optional[dict[str, dict[str, Any]]]:
    """Every linear at scheme `label` (None if some linear lacks it)."""
    table = by_linear(rows)
    pick = {n: next((r for r in rs if r["scheme"] == label), None) for n, rs in table.items()}
    return None if any(r is None for r in pick.values()) else pick


def size_curve(rows: list[dict[str, Any]], points: int = 16, mapping: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """Predicted KL of the best mixture at budgets from the smallest to the largest possible."""
    table = by_linear(rows)
    lo = sum(min(r["bytes"] for r in rs) for rs in table.values())
    hi = sum(max(r["bytes"] for r in rs) for rs in table.values())
    out = []
    for i in range(points):
        budget = int(lo + (hi - lo) * i / (points - 1))
        out.append(summary(allocate(rows, budget), mapping))
    return out
