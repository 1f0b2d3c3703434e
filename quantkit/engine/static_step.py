"""A decode step with no Python in the loop: static buffers per batch-size bucket, one CUDA graph each.

A batch-1 decode step of an 8B model launches a few hundred kernels; called eagerly, the Python
around each (wrappers, Triton's launcher and autotuner lookup) costs more than the kernel itself
(issue #49: 0.06-0.14 ms per eager dequant-GEMM at M = 1, 0.011 ms from a graph). So, as vLLM's
CUDAGraphRunner and nano-vllm's ``capture_cudagraph`` do, the whole decode forward (embedding,
every layer with its K/V write and paged attention, final norm, LM head) is captured once per
batch-size bucket and replayed; per step, Python only fills the input buffers and copies the
logits out.

Buffers (:class:`StepBuffers`), preallocated once for the largest bucket, a bucket using their first
rows (one shared set, as nano-vllm's ``graph_vars``):

* ``rows`` [4, max_batch] int64: token id, position, KV slot and context length of each row;
* ``block_tables`` [max_batch, width] int32, width = the blocks of the longest sequence the model
  takes (max_position_embeddings, at most the whole pool); only the columns a step uses are copied;
* ``logits`` [max_batch, vocab] fp32, written by the step.

Buckets (:func:`batch_buckets`): 1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (at most 512),
nano-vllm's choice. A decode batch of n rows runs in the smallest bucket >= n; rows n.. are padding:
token 0 at position 0, context length 1, their K/V written to a scratch block that the engine's
block manager never hands out (the pool has one block more than the manager's count), so a padding
row writes nothing any sequence reads and attends to something finite. A batch above the largest
bucket, every prefill and every extend step (speculative verification) runs eagerly, as before.

On CUDA each bucket is captured the first time it is needed (one memory pool shared by all
graphs): the step runs eagerly twice first on the padded buffers (Triton compiles and autotunes
there, so nothing autotunes inside the capture; with ``QUANTKIT_TRITON_AUTOTUNE=0`` each GEMM takes
its fixed config), then is captured. A capture that fails (an op that syncs with the host) leaves
that engine eager, with a notice. On CPU there are no graphs: the same buffers, padding and buckets
run eagerly, which is how the CPU tests prove that this step gives the eager engine's tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.notices import notice

if TYPE_CHECKING:  # the runner builds this step; imported for annotations only
    from quantkit.engine.model_runner import ModelRunner
    from quantkit.engine.sequence import Sequence

MAX_BUCKET = 512
ROW_TOKEN, ROW_POSITION, ROW_SLOT, ROW_CONTEXT = range(4)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes a decode step is captured for: 1, 2, 4, 8, then 16, 32, ... up to
    ``max_num_seqs`` (capped at 512), the largest always ``max_num_seqs`` itself when under the cap."""
    top = max(1, min(int(max_num_seqs), MAX_BUCKET))
    sizes = {b for b in (1, 2, 4, 8) if b <= top} | set(range(16, top + 1, 16)) | {top}
    return tuple(sorted(sizes))


def pick_bucket(buckets: tuple[int, ...], n: int) -> Optional[int]:
    """The smallest bucket holding ``n`` rows; None above the largest (the step then runs eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def static_step_problem(runner: "ModelRunner") -> Optional[str]:
    """Why ``runner``'s decode step cannot run from static buffers (None: it can)."""
    if any(p.moe is not None for p in runner.plans):
        return "MoE layers route tokens with data-dependent shapes"
    if runner.device.type == "cuda" and not runner.use_triton:
        return "paged attention without the Triton kernel reads the batch's longest context on the host"
    return None


@dataclass
class StepBuffers:
    """The preallocated inputs and output of the static decode step (see the module docstring)."""
    rows: torch.Tensor  # [4, max_batch] int64
    block_tables: torch.Tensor  # [max_batch, width] int32
    logits: torch.Tensor  # [max_batch, vocab] fp32

    @classmethod
    def plan(cls, max_batch: int, width: int, vocab: int, device: torch.device) -> "StepBuffers":
        return cls(torch.zeros(4, max_batch, dtype=torch.long, device=device),
                   torch.zeros(max_batch, width, dtype=torch.int32, device=device),
                   torch.zeros(max_batch, vocab, dtype=torch.float32, device=device))

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]


def block_table_width(max_model_len: Optional[int], block_size: int, num_blocks: int) -> int:
    """Columns of the block-table buffer: the blocks of the longest sequence the model takes
    (``max_position_embeddings``), never more than the pool; the whole pool when the length is unknown."""
    if not max_model_len:
        return num_blocks
    return max(1, min(num_blocks, math.ceil(max_model_len / block_size)))


class StaticDecodeStep:
    """The runner's decode forward over static buffers, replayed from a CUDA graph per bucket on CUDA.

    ``scratch_block``: a KV block outside the block manager's range, where padding rows write."""

    def __init__(self, runner: "ModelRunner", buckets: tuple[int, ...], scratch_block: int, use_graphs: bool):
        if not buckets or any(int(b) != b or b < 1 for b in buckets):
            raise QuantkitError(f"graph_buckets must be positive whole batch sizes, got {tuple(buckets)}")
        self.runner = runner
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.scratch_block = scratch_block
        self.use_graphs = use_graphs
        max_len = getattr(runner.config, "max_position_embeddings", None)
        width = block_table_width(max_len if isinstance(max_len, int) else None, runner.block_size, runner.num_blocks)
        self.buffers = StepBuffers.plan(self.buckets[-1], width, runner.embed.num_embeddings, runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.steps_by_bucket = {b: 0 for b in self.buckets}  # how often each bucket ran (tests, metrics)
        self.eager_fallbacks = 0  # decode steps too large for any bucket or with a table too wide

    # ------------------------------------------------------------------ inputs
    def _host_rows(self, seqs: list["Sequence"], bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [4, bucket] and block tables [bucket, w] on the host, padding rows included."""
        bs = self.runner.block_size
        pad_slot = self.scratch_block * bs
        tokens, positions, slots, lens = [], [], [], []
        for seq in seqs:
            p = len(seq) - 1
            tokens.append(seq.last_token)
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(len(seq))
        pad = bucket - len(seqs)
        rows = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [pad_slot] * pad, lens + [1] * pad],
                            dtype=torch.long)
        w = max(len(seq.block_table) for seq in seqs)
        tables = torch.full((bucket, w), self.scratch_block, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        return rows, tables

    def _fill(self, rows: torch.Tensor, tables: torch.Tensor) -> None:
        b, w = tables.shape
        self.buffers.rows[:, :b].copy_(rows, non_blocking=True)
        self.buffers.block_tables[:b, :w].copy_(tables, non_blocking=True)

    def _fill_padding(self, bucket: int) -> None:
        """Every row of ``bucket`` a padding row: what warm-up and capture run on (they write K/V to the scratch block only)."""
        pad_slot = self.scratch_block * self.runner.block_size
        rows = torch.tensor([[0] * bucket, [0] * bucket, [pad_slot] * bucket, [1] * bucket], dtype=torch.long)
        self._fill(rows, torch.full((bucket, 1), self.scratch_block, dtype=torch.int32))

    # ------------------------------------------------------------------ the step
    def _forward(self, bucket: int) -> None:
        """The decode forward of the first ``bucket`` rows, buffers in, ``logits[:bucket]`` out;
        no host sync, no allocation whose size depends on the data (what a CUDA graph captures)."""
        from quantkit.engine.model_runner import AttentionMetadata

        r, buf = self.runner, self.buffers
        rows = buf.rows[:, :bucket]
        meta = AttentionMetadata(False, rows[ROW_SLOT], has_skipped_slots=False)
        meta.block_tables_t = buf.block_tables[:bucket]
        meta.context_lens_t = rows[ROW_CONTEXT]
        hidden = r.forward(rows[ROW_TOKEN], rows[ROW_POSITION], meta)
        buf.logits[:bucket].copy_(r.head(hidden))

    def _capture(self, bucket: int) -> Optional["torch.cuda.CUDAGraph"]:
        """Warm up and capture ``bucket`` (padding rows only); None, with a notice, if capture fails."""
        self._fill_padding(bucket)
        torch.cuda.synchronize(self.runner.device)
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes here, never inside capture
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        torch.cuda.synchronize(self.runner.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bucket)
        except RuntimeError as e:
            notice(f"capturing the decode step in a CUDA graph failed ({str(e).splitlines()[0]}); "
                   "the engine decodes eagerly")
            self.use_graphs = False
            return None
        return graph

    def run(self, seqs: list["Sequence"]) -> Optional[torch.Tensor]:
        """Logits [len(seqs), vocab] fp32 of a decode step, or None when no bucket holds it (the
        caller then runs the eager step)."""
        bucket = pick_bucket(self.buckets, len(seqs))
        if bucket is None or max(len(s.block_table) for s in seqs) > self.buffers.width:
            self.eager_fallbacks += 1
            return None
        graph = self.graphs.get(bucket)
        if graph is None and self.use_graphs:
            graph = self._capture(bucket)
            if graph is not None:
                self.graphs[bucket] = graph
        self._fill(*self._host_rows(seqs, bucket))
        if graph is not None:
            graph.replay()
        else:
            self._forward(bucket)
        self.steps_by_bucket[bucket] += 1
        return self.buffers.logits[:len(seqs)].clone()  # the buffer is rewritten by the next step
