"""Data-parallel calibration on torch.distributed: the ranks of a run, their collectives, and the
progress store as every rank sees it.

A run is a group of ranks (gloo on CPU, NCCL on CUDA), started by `quantkit quantize --nproc N`
(quantkit.launch) or by torchrun (found from RANK / WORLD_SIZE / LOCAL_RANK in the environment).
Every rank loads the model and runs the same pipeline on its share of the calibration samples;
the recipe steps reduce what they accumulate through `TorchComm` (quantkit.reduction says how the
sums keep one fixed shape, so the checkpoint does not depend on the rank count). Rank 0 alone
touches the output: staging folder, progress records, checkpoint, model card. Every collective
has the group's timeout, so a rank that dies or hangs ends the others within it.
"""
from __future__ import annotations

import datetime
import os
import sys
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from quantkit.errors import QuantkitError
from quantkit.progress import LayerRecord, ProgressStore, record_from_bytes, reference_from_bytes
from quantkit.reduction import LEAVES, leaf_bounds, left_fold

DEFAULT_TIMEOUT_S = 600.0  # a collective waits this long for the other ranks before the run ends


def launched_world() -> int:
    """The rank count a launcher (torchrun, or --nproc) set in the environment; 1 when none did."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise QuantkitError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; unset it or launch with "
                            "torchrun") from None


def check_world(world: int) -> None:
    if world < 1 or world > LEAVES or world & (world - 1):
        raise QuantkitError(f"data-parallel calibration runs on 1, 2, 4 or 8 ranks (the calibration set is cut into "
                            f"{LEAVES} fixed shards so that every rank count writes the same checkpoint); got {world}")


def rank_device(device: Optional[str]) -> torch.device:
    """This rank's compute device: its own GPU (LOCAL_RANK) when the run computes on CUDA; with more
    ranks on the node than GPUs, the GPUs are shared round-robin."""
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    return dev


def _nccl_usable(device: torch.device) -> bool:
    """NCCL wants one rank per GPU; ranks sharing a GPU talk through gloo (host memory) instead."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return device.type == "cuda" and local_world <= torch.cuda.device_count()


def join_group(device: torch.device, timeout_s: float) -> "TorchComm":
    """Join the group the launcher started (env://): NCCL between GPUs, else gloo."""
    world = launched_world()
    check_world(world)
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise QuantkitError(f"WORLD_SIZE={world} is set but {key} is not; launch with torchrun or --nproc")
    nccl = _nccl_usable(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if nccl else None)
    return TorchComm(device if nccl else torch.device("cpu"))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End this process with `code`. A process that still holds a process group (it stopped on an
    error before leave_group) skips interpreter finalization: destroying gloo's still-joinable
    threads there aborts with "terminate called without an active exception" on stderr (seen in
    CI), which would break the one-line error. Nothing is left to flush but stdio."""
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class TorchComm:
    """`quantkit.reduction.Comm` over the default torch.distributed group."""

    def __init__(self, device: torch.device):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device  # where collectives run (NCCL: this rank's GPU)
        self.traffic: Counter = Counter()  # payload bytes by kind of collective, for the run's summary

    def tree_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Recursive halving then doubling: at step d every rank adds its partner's (rank ^ d) half of
        what it holds, so each element becomes the perfect binary tree over rank order
        ((r0 + r1) + (r2 + r3)) + ... (IEEE addition commutes, so who adds does not matter); then the
        finished pieces are swapped back. Same volume as a ring all-reduce, any element count."""
        if self.world == 1:
            return t
        self.traffic["tree_sum"] += t.numel() * t.element_size()
        work = t.detach().reshape(-1).to(self.device).contiguous()
        steps, lo, hi, d = [], 0, work.numel(), 1
        while d < self.world:
            partner, mid = self.rank ^ d, (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if self.rank & d == 0 else ((mid, hi), (lo, mid))
            received = work.new_empty(keep[1] - keep[0])
            self._exchange(work[give[0]:give[1]], received, partner)
            work[keep[0]:keep[1]].add_(received)
            steps.append((partner, (lo, hi), keep))
            (lo, hi), d = keep, d * 2
        for partner, (lo, hi), keep in reversed(steps):
            other = (keep[1], hi) if keep[0] == lo else (lo, keep[0])
            self._exchange(work[keep[0]:keep[1]], work[other[0]:other[1]], partner)
        if work.data_ptr() != t.data_ptr():
            t.copy_(work.view(t.shape))
        return t

    @staticmethod
    def _exchange(send: torch.Tensor, receive: torch.Tensor, partner: int) -> None:
        ops = [dist.P2POp(dist.isend, send, partner)] if send.numel() else []
        ops += [dist.P2POp(dist.irecv, receive, partner)] if receive.numel() else []
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        self.traffic["max"] += t.numel() * t.element_size()
        work = t.to(self.device)
        dist.all_reduce(work, op=dist.ReduceOp.MAX)
        if work is not t:
            t.copy_(work)
        return t

    def sum_ints(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.traffic["counts"] += t.numel() * t.element_size()
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, concatenated in rank order (rows may differ in number between ranks)."""
        counts = torch.tensor([t.shape[0]], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(counts) for _ in range(self.world)]
        dist.all_gather(sizes, counts)
        sizes = [int(s) for s in sizes]
        if not max(sizes):
            return t[:0]
        padded = t.new_zeros((max(sizes), *t.shape[1:]), device=self.device)
        padded[:t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        self.traffic["gather"] += sum(sizes) * padded[0].numel() * padded.element_size()
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(t.device)

    def ordered_sum(self, values: list[float]) -> float:
        everything = self.gather_rows(torch.tensor(values, dtype=torch.float64).reshape(-1, 1))
        return left_fold(everything.reshape(-1).tolist())

    def agree(self, digest: torch.Tensor) -> bool:
        everyone = self.gather_rows(digest.reshape(1, -1).to(torch.int64))
        return bool((everyone == everyone[0]).all())

    def broadcast_bytes(self, data: Optional[bytes]) -> bytes:
        """`data` from rank 0 on every rank."""
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data
               else torch.empty(int(size), dtype=torch.uint8))
        buf = buf.to(self.device)
        self.traffic["broadcast"] += int(size)
        if int(size):
            dist.broadcast(buf, 0)
        return bytes(buf.cpu().numpy())

    def from_rank0(self, produce) -> bytes:
        """`produce()` (bytes) run on rank 0 and handed to every rank; a QuantkitError it raises is
        raised on every rank, so a check rank 0 makes stops the whole run the same way."""
        status, payload = b"", b""
        if self.rank == 0:
            try:
                status, payload = b"ok", produce() or b""
            except QuantkitError as exc:
                status, payload = b"error", str(exc).encode()
        status = self.broadcast_bytes(status)
        payload = self.broadcast_bytes(payload)
        if status == b"error":
            raise QuantkitError(payload.decode())
        return payload

    def barrier(self) -> None:
        dist.barrier()


def rank_samples(n_samples: int, rank: int, world: int) -> tuple[int, int]:
    """The global sample range [start, stop) a rank holds (whole leaves of the reduction tree)."""
    per_rank = LEAVES // world
    bounds = leaf_bounds(n_samples)
    return bounds[rank * per_rank], bounds[(rank + 1) * per_rank]


class ReplicatedStore:
    """The progress store as every rank of a run sees it: rank 0 reads and writes the staging folder,
    the others receive what it read (the folder need not be visible to them, e.g. on other nodes).
    The reference stream (GPTAQ) is saved whole by rank 0 and handed back to each rank as its rows."""

    def __init__(self, store: Optional[ProgressStore], comm: TorchComm, n_samples: int):
        self.store, self.comm = store, comm
        self.rows = rank_samples(n_samples, comm.rank, comm.world)

    def done_layers(self) -> list[int]:
        text = ",".join(map(str, self.store.done_layers())).encode() if self.comm.rank == 0 else None
        text = self.comm.broadcast_bytes(text).decode()
        return [int(i) for i in text.split(",")] if text else []

    def load_layer(self, index: int) -> LayerRecord:
        data = self.comm.broadcast_bytes(self.store.layer_bytes(index) if self.comm.rank == 0 else None)
        return record_from_bytes(index, data, f"{index} (received from rank 0)")

    def save_layer(self, record: LayerRecord) -> None:
        if self.comm.rank == 0:
            self.store.save_layer(record)

    def save_reference(self, index: int, hidden: list[torch.Tensor]) -> None:
        (mine,) = hidden
        whole = self.comm.gather_rows(mine)
        if self.comm.rank == 0:
            self.store.save_reference(index, [whole])

    def load_reference(self, index: int) -> Optional[list[torch.Tensor]]:
        data = self.comm.broadcast_bytes((self.store.reference_bytes(index) or b"") if self.comm.rank == 0 else None)
        if not data:
            return None
        whole = torch.cat(reference_from_bytes(data))  # one tensor; an older run saved one per batch
        return [whole[self.rows[0]:self.rows[1]]]


def staging_store(store) -> Optional[ProgressStore]:
    """The staging folder's store on this rank: its own, rank 0's in a data-parallel run, else None."""
    return store.store if isinstance(store, ReplicatedStore) else store
