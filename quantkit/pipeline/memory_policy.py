"""How the calibration pipeline keeps host memory down, in one place: handing finished layers' file
pages back to the OS, returning freed heap to it, and reusing big intermediates across layers.

Each trick is a feature of one platform (Linux + glibc); `memory_policy()` picks the full policy
where they exist and a policy of no-ops elsewhere, so the pipeline runs the same code everywhere and
only the resident-memory curve differs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from quantkit.memory import page_out_file_backed
from quantkit.platform_support import glibc
from quantkit.streaming import trim_heap


class ScratchBuffers:
    """Named buffers that every layer's one-pass forward reuses for its big intermediates.

    Why: a tensor above glibc's mmap threshold (32 MiB) is a fresh mapping, page-faulted in on first
    write and unmapped when freed, so every layer paid for its 75-200 MB intermediates afresh: on the
    demo's CPU an elementwise op writing into fresh memory ran ~4x slower than into reused memory.
    A slot's buffer only grows. Whether what a slot held is dead when the slot is taken again depends
    on the decoder layer's structure; the one-pass strategy checks that on a probe forward before it
    shares slots (`OnePassPlan.check`), and uses fresh tensors otherwise."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of `shape` with `like`'s dtype and device, in `slot`'s buffer."""
        numel = math.prod(shape)
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            self._buffers.pop(slot, None)  # the old one goes before the new one arrives
            buf = self._buffers[slot] = like.new_empty(numel)
        return buf[:numel].view(shape)


def empty(scratch: Optional[ScratchBuffers], slot: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor for a `slot` intermediate: from `scratch` when given, else fresh."""
    return like.new_empty(shape) if scratch is None else scratch.take(slot, shape, like)


def byte_ranges(tensors) -> list[tuple[int, int]]:
    """(address, nbytes) of each CPU tensor, for `page_out`."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.device.type == "cpu"]


class MemoryPolicy:
    """The full policy (Linux with glibc): page-out of file-backed weights, heap trimming, scratch reuse."""

    name = "linux-glibc"

    def page_out(self, tensors) -> None:
        """Hand the resident file pages of these (mapping-backed) tensors back; contents are kept."""
        page_out_file_backed(byte_ranges(tensors))

    def trim_heap(self) -> None:
        trim_heap()

    def scratch(self) -> Optional[ScratchBuffers]:
        return ScratchBuffers()


class NoOpPolicy(MemoryPolicy):
    """Where the platform lacks madvise/malloc_trim: nothing is paged out or trimmed (correct, more RSS)."""

    name = "none"

    def page_out(self, tensors) -> None:
        pass

    def trim_heap(self) -> None:
        pass


def memory_policy() -> MemoryPolicy:
    return MemoryPolicy() if glibc() is not None else NoOpPolicy()
