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

    def _register(self, block: Block, h: int, token_ids: list[int], publish: bool = True) -> None:
        block.hash = h
        block.token_ids = list(token_ids)
        if publish:
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

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether the token just appended to ``seq`` (its K/V is written by the next step) and
        ``lookahead`` speculative tokens after it have slots."""
        return len(self.free) >= self.blocks_for(len(seq) + lookahead) - len(seq.block_table)

    def may_append(self, seq: Sequence, lookahead: int = 0) -> None:
        """Make room for ``seq``'s last token and ``lookahead`` speculative tokens after it, and hash
        the blocks its tokens have filled for reuse. The last token's K/V is written by the step this
        is called for, so a block it completes may be hashed now (as may one filled by accepted
        speculative tokens, whose K/V the verification step wrote)."""
        self.ensure(seq, len(seq) + lookahead)
        if self.enable_prefix_caching:
            self._hash_full_blocks(seq)

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` positions (fresh ones from the free list)."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        for _ in range(need):
            seq.block_table.append(self._take_free_block().block_id)
        if need > 0:
            self._note_peak()

    def _hash_full_blocks(self, seq: Sequence) -> None:
        """Hash every full block of ``seq`` not hashed yet, chained on the one before (usually just the
        block its last token completed; several after speculative tokens were accepted). A block
        whose prefix another block already caches keeps the hash, for the chain, without taking over
        the lookup entry."""
        j = len(seq) // self.block_size - 1
        start = j
        while start >= 0 and self.blocks[seq.block_table[start]].hash is None:
            start -= 1
        for i in range(start + 1, j + 1):
            prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
            token_ids = seq.block(i)
            h = block_hash(token_ids, prev)
            self._register(self.blocks[seq.block_table[i]], h, token_ids, publish=h not in self.hash_to_block)

    def rollback(self, seq: Sequence) -> None:
        """Release the blocks past what ``seq``'s tokens need: the slots of rejected speculative
        tokens. They never hold a hash (only blocks full of committed tokens are hashed) nor another
        reference, and go to the front of the free list: they cache nothing, so they are reused
        before any freed block that still holds a prefix (and a batch-1 sequence gets the same block
        back next step, keeping its blocks consecutive)."""
        keep = self.blocks_for(len(seq))
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            if block.hash is not None or block.ref_count != 1:
                raise RuntimeError(f"block {block.block_id} past sequence {seq.seq_id}'s tokens is cached or shared")
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)
