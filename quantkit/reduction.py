"""Sums over calibration samples that come out bit for bit the same on any number of data-parallel ranks.

Why: float addition is not associative, so a Hessian summed over 128 samples in one process and the
same Hessian summed as two halves on two ranks differ in the last bits, and GPTQ then rounds a few
weights the other way: the checkpoint would depend on the rank count. Here every sum has one fixed
shape, whatever the rank count:

* the calibration samples are cut into `LEAVES` contiguous leaves (sample ranges fixed by the
  sample count alone); each rank holds an aligned run of whole leaves (`SampleLayout`);
* inside a leaf the rows are added in calibration order, in pieces whose boundaries are fixed
  relative to the leaf (a calibration batch, an MLP chunk never spans two leaves);
* leaves are combined as a perfect binary tree, `((l0 + l1) + (l2 + l3)) + ...`; a rank computes
  its own aligned subtree and the ranks' roots are combined by the same tree (`Comm.tree_sum_`).

So one process adds exactly the numbers, in exactly the order, that 2, 4 or 8 ranks add: the
result is identical by construction, not by luck. Every statistic a recipe step accumulates goes
through the small interface here (`RowSum` for sums over rows, `Comm.max_` for maxima,
`Comm.gather_rows` for row samples, `Comm.ordered_sum` for per-batch loss terms), so steps never
know how many ranks there are; the pipeline builds the `SampleLayout` and hands it to them in the
layer context. A rank count must be a power of two that divides `LEAVES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

LEAVES = 8  # fixed leaves of every reduction tree: data-parallel runs on 1, 2, 4 or 8 ranks give the same bits


class Comm(Protocol):
    """What a reduction needs from the ranks of a run (one local process: `LocalComm`)."""

    rank: int
    world: int

    def tree_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors summed as a perfect binary tree over rank order, in place on every rank."""

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks, in place on every rank."""

    def sum_ints(self, values: list[int]) -> list[int]:
        """Integer sums over the ranks (exact)."""

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' row blocks concatenated along dim 0 in rank order, on every rank."""

    def ordered_sum(self, values: list[float]) -> float:
        """All ranks' values, in rank order, added left to right from 0.0 (as one process would add them)."""

    def agree(self, digest: torch.Tensor) -> bool:
        """Whether every rank holds the same (integer) digest."""


class LocalComm:
    """A run in one process: every reduction is the identity."""

    rank, world = 0, 1

    def tree_sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def sum_ints(self, values: list[int]) -> list[int]:
        return list(values)

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def ordered_sum(self, values: list[float]) -> float:
        return left_fold(values)

    def agree(self, digest: torch.Tensor) -> bool:
        return True


def left_fold(values) -> float:
    """sum(values) from 0.0, left to right (spelt out: Python 3.12's sum() of floats is compensated)."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


def leaf_bounds(n_samples: int) -> list[int]:
    """Global sample index where each leaf starts, plus the end: leaves as equal as integers allow."""
    return [i * n_samples // LEAVES for i in range(LEAVES + 1)]


@dataclass(frozen=True)
class SampleLayout:
    """This rank's share of the calibration set: an aligned run of whole leaves, in calibration batches.

    `batches` are (start, stop) global sample ranges of this rank's calibration batches, in order:
    the batches one process would run, each cut to this rank's samples. A batch may span leaves;
    whoever sums over it cuts it at the leaf boundaries (`RowSum`, `pieces`), so every piece is
    the same at any rank count."""

    comm: Comm
    n_samples: int  # the whole calibration set
    rows_per_sample: int  # tokens per calibration sequence
    leaves: tuple[int, ...]  # global sample bounds of this rank's leaves (first start ... last stop)
    batches: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, comm: Comm, n_samples: int, rows_per_sample: int, batch_size: int) -> "SampleLayout":
        per_rank = LEAVES // comm.world
        bounds = leaf_bounds(n_samples)[comm.rank * per_rank:(comm.rank + 1) * per_rank + 1]
        first, stop = bounds[0], bounds[-1]
        # the one-process batches, each cut to this rank's samples: the same pieces at any rank count
        batches = tuple((max(s, first), min(s + batch_size, stop)) for s in range(0, n_samples, batch_size)
                        if s < stop and s + batch_size > first)
        return cls(comm, n_samples, rows_per_sample, tuple(bounds), batches)

    @classmethod
    def local(cls, n_samples: int, rows_per_sample: int, batch_size: int) -> "SampleLayout":
        return cls.build(LocalComm(), n_samples, rows_per_sample, batch_size)

    @classmethod
    def of_batches(cls, shapes: list[tuple[int, int]]) -> "SampleLayout":
        """A one-process layout for calibration batches of (sequences, tokens) as they are, one leaf:
        sums in plain batch order (a step called outside the pipeline)."""
        n, starts = 0, []
        for b, _ in shapes:
            starts.append((n, n + b))
            n += b
        return cls(LocalComm(), n, shapes[0][1] if shapes else 1, (0, n), tuple(starts))

    @property
    def first(self) -> int:
        return self.leaves[0]

    def leaf_row_ends(self) -> list[int]:
        """Rows (tokens) seen by this rank when each of its leaves is complete."""
        return [(b - self.first) * self.rows_per_sample for b in self.leaves[1:]]

    def pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Global sample range [start, stop) cut at leaf boundaries."""
        cuts = [b for b in self.leaves if start < b < stop]
        edges = [start, *cuts, stop]
        return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]

    def leading_sequences(self, budget_tokens) -> int:
        """How many leading sequences of the whole set a whole-sequence search runs on: enough for
        `budget_tokens` tokens (0 or None: all of them)."""
        if not budget_tokens:
            return self.n_samples
        return min(self.n_samples, max(1, -(-int(budget_tokens) // self.rows_per_sample)))

    def leading_pieces(self, batch: int, first_n: int) -> list[tuple[int, int]]:
        """The sequences of calibration batch `batch` that are among the first `first_n` of the whole
        set, as (start, stop) within the batch, cut at leaf boundaries: a per-piece statistic of them
        (a search loss term) is then the same whatever share of the set this process holds."""
        a, b = self.batches[batch]
        return [(s - a, e - a) for s, e in self.pieces(a, min(b, first_n))]

    def row_chunks(self, rows: int) -> list[tuple[int, int]]:
        """This rank's rows (one batch of all its samples) in chunks of at most `rows`, restarting at
        every leaf: each chunk lies in one leaf and starts at a fixed offset from that leaf's start.
        A leaf's chunks are as equal as integers allow (no sliver of a chunk at its end)."""
        ends, out = [0, *self.leaf_row_ends()], []
        for a, b in zip(ends, ends[1:]):
            if b > a:
                size = -(-(b - a) // -(-(b - a) // rows))  # ceil(leaf / number of chunks)
                out += [(s, min(s + size, b)) for s in range(a, b, size)]
        return out


class RowSum:
    """A sum over calibration rows with the fixed shape of the module docstring.

    Rows arrive in calibration order through `add`; `total()` is the whole sum (over every rank).
    Without a layout it is a plain running sum (one leaf), for use outside the pipeline."""

    def __init__(self, layout: Optional[SampleLayout] = None):
        self.layout = layout
        self._ends = layout.leaf_row_ends() if layout is not None else None
        self._row = 0  # rows seen (dense calibration rows, on this rank)
        self._leaf = 0  # the open leaf (local index)
        self._open: Optional[torch.Tensor] = None  # the open leaf's partial sum
        self._stack: list[tuple[int, Optional[torch.Tensor]]] = []  # completed subtrees (level, value)
        self._total: Optional[torch.Tensor] = None

    def add(self, n_rows: int, fold: Callable[[slice, Optional[torch.Tensor]], torch.Tensor],
            positions: Optional[torch.Tensor] = None) -> None:
        """Take the next `n_rows` calibration rows. `fold(rows, partial)` returns the open leaf's partial
        sum (None for a leaf's first rows) with the caller's rows `rows` added. With `positions`
        (sorted, each in [0, n_rows)) the caller holds only those rows of the span (an expert's
        routed tokens), and `rows` index its own tensors."""
        if self._total is not None:
            raise RuntimeError("RowSum: rows added after the total was taken")
        if self._ends is None:
            self._open = fold(slice(0, n_rows if positions is None else len(positions)), self._open)
            self._row += n_rows
            return
        stop = self._row + n_rows
        if stop > self._ends[-1]:
            raise RuntimeError(f"RowSum: {stop} rows exceed this rank's {self._ends[-1]} calibration rows")
        self._close_finished_leaves()
        while self._row < stop:
            end = min(stop, self._ends[self._leaf])
            a, b = self._row - (stop - n_rows), end - (stop - n_rows)
            if positions is not None:
                a, b = (int(torch.searchsorted(positions, v)) for v in (a, b))
            if b > a or self._open is None:
                self._open = fold(slice(a, b), self._open)
            self._row = end
            self._close_finished_leaves()

    def _close_finished_leaves(self) -> None:
        while self._leaf < len(self._ends) and self._row == self._ends[self._leaf]:
            self._push(self._open)
            self._open = None
            self._leaf += 1

    def _push(self, value: Optional[torch.Tensor]) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            value = _combine(left, value)
            level += 1
        self._stack.append((level, value))

    def total(self) -> torch.Tensor:
        """The sum over every row of every rank (taken once; on every rank, collectively)."""
        if self._total is not None:
            return self._total
        if self._ends is None:
            if self._open is None:
                raise RuntimeError("RowSum: no rows were added")
            return self._open  # still open: more rows may follow
        if self._row != self._ends[-1]:
            raise RuntimeError(f"RowSum: {self._row} of this rank's {self._ends[-1]} calibration rows were added; "
                               "every row must reach the sum")
        self._close_finished_leaves()
        (_, root), = self._stack
        if root is None:
            raise RuntimeError("RowSum: no rows were added")
        self._total = self.layout.comm.tree_sum_(root)
        self._stack = []
        return self._total


def _combine(left: Optional[torch.Tensor], right: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """left + right (an empty leaf is None), written into left: the tree owns its nodes."""
    if left is None:
        return right
    if right is None:
        return left
    return left.add_(right)

