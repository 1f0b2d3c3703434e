"""Fixed-size KV blocks from one preallocated pool: free list, reference counts, prefix caching.

Every sequence owns a block table (the ids of its blocks, in order). A *full* block is identified
by a hash of its tokens chained with the previous block's hash, so equal hashes mean equal whole
prefixes, and hence equal K/V. When a new sequence's leading full blocks are already in the table
it shares them (reference count + 1) instead of recomputing them; a freed block keeps its hash
and contents until the free list hands it out again, so a finished request's prompt can still be
hit later (the free list is ordered oldest-freed first, i.e. LRU eviction of cached blocks).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional

from quantkit.engine.sequence import Sequence
from quantkit.errors import QuantkitError


def block_hash(token_ids: list[int], prefix_hash: Optional[int]) -> int:
    """Hash of a full block's tokens chained with the previous block's hash (None for the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((-1 if prefix_hash is None else prefix_hash).to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = None
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise QuantkitError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        # counters (never reset by allocation; LLMEngine.reset_metrics resets them)
        self.peak_used = 0
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = 0

    # ---------------------------------------------------------------- accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def reset_counters(self) -> None:
        self.peak_used = self.num_used_blocks
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = 0

    # ---------------------------------------------------------------- primitives
    def _take_free_block(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its contents are about to be overwritten
        block.reset()
        return block

    def _register(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.hash = h
        block.token_ids = list(token_ids)
        self.hash_to_block[h] = block.block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} released more often than taken")
        if block.ref_count == 0:
            self.free[block_id] = None

    # ---------------------------------------------------------------- sequences
    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free) >= seq.num_blocks  # conservative: as if nothing were cached

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True) -> None:
        """Give ``seq`` blocks for all its tokens, sharing the longest cached run of leading full blocks."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        caching = self.enable_prefix_caching and use_prefix_cache
        seq.num_cached_tokens = 0
        h: Optional[int] = None
        miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            h = block_hash(token_ids, h) if (caching and full) else None
            block_id = None
            if h is not None:
                self.prefix_queried_blocks += 1
                if not miss:
                    block_id = self.hash_to_block.get(h)
                    if block_id is not None and self.blocks[block_id].token_ids != token_ids:
                        block_id = None  # hash collision: treat as a miss
            if block_id is None:
                miss = True
                block = self._take_free_block()
                if h is not None:
                    self._register(block, h, token_ids)
            else:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]  # revive a freed block that still holds this prefix
                block.ref_count += 1
                seq.num_cached_tokens += self.block_size
                self.prefix_hit_blocks += 1
            seq.block_table.append(block.block_id)
        self._note_peak()

    def deallocate(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks (shared ones only drop a reference); last blocks go first so
        shared prefixes stay cached longest."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def _needs_new_block(self, seq: Sequence) -> bool:
        return len(seq) > len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token just appended to ``seq`` (its K/V is written by the next decode) has a slot."""
        return len(self.free) >= int(self._needs_new_block(seq))

    def may_append(self, seq: Sequence) -> None:
        """Make room for ``seq``'s last token; when it completes a block, hash that block for reuse."""
        if self._needs_new_block(seq):
            seq.block_table.append(self._take_free_block().block_id)
            self._note_peak()
        if self.enable_prefix_caching and len(seq) % self.block_size == 0:
            n = len(seq) // self.block_size
            last = self.blocks[seq.block_table[n - 1]]
            if last.hash is None:
                prev = self.blocks[seq.block_table[n - 2]].hash if n > 1 else None
                if n == 1 or prev is not None:
                    token_ids = seq.block(n - 1)
                    h = block_hash(token_ids, prev)
                    if h not in self.hash_to_block:
                        self._register(last, h, token_ids)
