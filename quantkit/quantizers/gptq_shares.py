"""GPTQ's solves shared out across data-parallel ranks by output rows.

Every rank holds the same reduced Hessian, and GPTQ treats each output row on its own given it (the
column loop's error feedback and the group ranges are per row; that is why q/k/v can be solved as
one stacked matrix). So each rank solves a contiguous share of the rows and the shares are gathered
in rank order: every rank ends with the whole result, having solved 1/N of it. Without this every
rank would repeat every solve, and the solves are most of a layer's time (bench_distributed.py).

The assumption behind "the same bytes at any rank count": a row's result does not depend on which
other rows are solved with it. The elementwise steps make that true by construction; the lazy-update
GEMMs only if the BLAS computes an output column the same way whatever the matrix's width (MKL on
CPU does: the two-rank tests compare the bytes with one process'; cuBLAS picks kernels by shape).
So it is checked where it is relied on: the first solve of each shape is also solved whole on rank
0 and compared; a shape that differs is solved whole on every rank from then on (one warning), and
the checkpoint stays the one-process one either way.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.gptq_core import gptq_quantize
from quantkit.reduction import Comm, LocalComm

MESSAGE_BYTES = 1000  # of a failing rank's error, handed to the others


def row_share(n_rows: int, rank: int, world: int) -> slice:
    """The rows rank `rank` of `world` solves: contiguous, as equal as integers allow."""
    return slice(n_rows * rank // world, n_rows * (rank + 1) // world)


def share_inputs(rows: slice, weight: torch.Tensor, qparams: Optional[tuple[torch.Tensor, torch.Tensor]]):
    """The weight rows and fixed-grid parameters (if any) of one row share."""
    return weight[rows], None if qparams is None else tuple(q[rows] for q in qparams)


def same_result(a: tuple[QuantizedWeight, dict], b: tuple[QuantizedWeight, dict]) -> bool:
    """Bit-for-bit the same integers, scales, group map and per-row losses."""
    (qa, sa), (qb, sb) = a, b
    return (all(torch.equal(getattr(qa, f), getattr(qb, f)) for f in ("qweight", "scales", "zeros", "g_idx"))
            and torch.equal(sa["row_loss"], sb["row_loss"]))


class SharedSolver:
    """`gptq_quantize` with its rows shared out over the ranks of a run (one process: a plain call).
    One per quantizer: it remembers, per solve shape, whether row shares proved exact."""

    def __init__(self):
        self._exact: dict[tuple, bool] = {}  # solve shape -> whether row shares reproduced the whole solve

    def solve(self, comm: Optional[Comm], name: str, weight: torch.Tensor, H: torch.Tensor,
              qparams: Optional[tuple[torch.Tensor, torch.Tensor]] = None, **options) -> tuple[QuantizedWeight, dict]:
        comm, n = comm or LocalComm(), weight.shape[0]
        key = (tuple(weight.shape), qparams is not None, tuple(sorted(options.items())))
        if comm.world == 1 or n < comm.world or self._exact.get(key) is False:
            return gptq_quantize(weight, H, qparams=qparams, **options)
        part, part_qparams = share_inputs(row_share(n, comm.rank, comm.world), weight, qparams)
        mine = self._solve_share(comm, name, part, H, part_qparams, options)
        whole = self._gather(comm, mine)
        if key in self._exact:
            return whole
        # first solve of this shape: rank 0 also solves it whole, and every rank learns whether they agree
        reference = gptq_quantize(weight, H, qparams=qparams, **options) if comm.rank == 0 else None
        differs = comm.sum_ints([int(reference is not None and not same_result(reference, whole))])[0]
        self._exact[key] = not differs
        if not differs:
            return whole
        warnings.warn(f"GPTQ: solving the {n} x {weight.shape[1]} weight of {name} in row shares across ranks did not "
                      "reproduce the whole solve bit for bit on this device; every rank solves weights of this shape "
                      "whole from now on (same checkpoint as one process, no solve speed-up)", RuntimeWarning,
                      stacklevel=2)
        return reference if reference is not None else gptq_quantize(weight, H, qparams=qparams, **options)

    @staticmethod
    def _solve_share(comm: Comm, name: str, weight, H, qparams, options) -> tuple[QuantizedWeight, dict]:
        """This rank's share. A solve that fails on one rank fails on all of them here, with the first
        failing rank's message (the others would otherwise wait in the gather until the timeout)."""
        try:
            result, error = gptq_quantize(weight, H, qparams=qparams, **options), None
        except QuantkitError as exc:
            result, error = None, exc
        text = str(error).encode()[:MESSAGE_BYTES] if error is not None else b""
        mine = torch.zeros(1, MESSAGE_BYTES + 1, dtype=torch.uint8)
        mine[0, 0] = int(error is not None)
        mine[0, 1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else 0
        failures = [row for row in comm.gather_rows(mine) if int(row[0])]
        if error is not None:
            raise error
        if failures:
            message = bytes(failures[0][1:].tolist()).rstrip(b"\0").decode(errors="replace")
            raise QuantkitError(f"{message} (GPTQ on {name}, found by another rank)")
        return result

    @staticmethod
    def _gather(comm: Comm, share: tuple[QuantizedWeight, dict]) -> tuple[QuantizedWeight, dict]:
        qw, stats = share
        gather = comm.gather_rows
        whole = replace(qw, qweight=gather(qw.qweight), scales=gather(qw.scales), zeros=gather(qw.zeros))
        row_loss = gather(stats["row_loss"])
        extra = {"rounded": gather(stats["rounded"])} if "rounded" in stats else {}
        return whole, {**stats, **extra, "row_loss": row_loss, "loss": float(row_loss.sum())}
