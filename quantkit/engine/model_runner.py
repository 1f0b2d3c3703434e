"""Runs a transformers causal LM of any supported family over paged KV: the model's parts come
from its family's adapter (engine.decoder); batch preparation, K/V writes, attention and the
layer loop are here.

A step packs the new tokens of all its sequences into one [N, hidden] batch, so every linear runs
once per layer for the whole batch.

* Prefill: each sequence's uncached tokens, with a causal mask. Without a cached prefix it
  attends over its fresh K/V; with one (prefix-cache hit) it attends over the K/V gathered from
  its blocks (the cached prefix plus the new tokens, written first) with the causal mask offset by
  the prefix length.
* Decode: one token per sequence, paged attention over its block table: the Triton kernel on
  GPU; on CPU a gather of every sequence's cached tokens (their slots computed once per step for
  all layers) and softmax attention in fp32.
* Extend: a few new tokens per sequence over its cached prefix (speculative decoding's
  verification, a draft catching up), the decode path's gather with a causal mask.

A batch-1 CPU decode step of a small model is bound by per-op dispatch, not arithmetic, so the
layer loop keeps its op count low where that costs no exactness: projections, norms and the
activation are plain callables resolved once (engine.decoder), q and k of a fused q/k/v
projection are rotated as one tensor, attention's per-step set-up is shared by all layers. Where
the model allows (fp32 on CPU, Llama-shaped layers, every projection on a cpu_gemv kernel), a
decode or extend step of up to DECODE_ROWS tokens skips that loop altogether: every layer runs in
one C call (engine.c_decode_step), the loop below being its reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from quantkit.engine.decoder import DecoderModel
from quantkit.engine.kv_cache import KVCache, bytes_per_block, parse_bytes, resolve_kv_dtype
from quantkit.engine.rotary import RotaryEmbedding
from quantkit.engine.sequence import Sequence
from quantkit.errors import QuantkitError
from quantkit.notices import notice
from quantkit.platform_support import available_memory_bytes
from quantkit.runtime.backends import DECODE_ROWS

CPU_DEFAULT_FRACTION = 0.25
CPU_DEFAULT_CAP = 4 << 30
GPU_DEFAULT_FRACTION = 0.9


def available_memory(device: torch.device) -> int:
    """Free memory of `device` in bytes; on a host that cannot tell, the CPU cap (with a notice)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = available_memory_bytes()
    if free is None:
        notice(f"free host memory is unknown on this platform; the KV pool takes {CPU_DEFAULT_CAP >> 30} GiB "
               "(set kv_cache_memory to choose)")
        return int(CPU_DEFAULT_CAP / CPU_DEFAULT_FRACTION)
    return int(free)


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [N] long, -1: do not write
    has_skipped_slots: bool = False
    # prefill: per sequence
    query_starts: Optional[list[int]] = None  # offset of the sequence's first new token in the batch
    query_lens: Optional[list[int]] = None
    context_lens: Optional[list[int]] = None  # tokens attended to (cached prefix + new)
    block_tables: Optional[list[torch.Tensor]] = None
    # decode: the Triton kernel reads block tables, the CPU path the gathered slots
    block_tables_t: Optional[torch.Tensor] = None  # [B, max_blocks] int32
    context_lens_t: Optional[torch.Tensor] = None  # [B] int32
    decode_slots: Union[torch.Tensor, slice, None] = None  # [B * T] long, or one run of slots
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, T] additive, None when all lengths agree
    # extend (several new tokens per sequence over its cached prefix): queries laid out [B, Q], the
    # CPU-path slots above and a causal mask [B, 1, Q * group, T]
    extend_shape: Optional[tuple[int, int]] = None


@dataclass
class ExtendRequest:
    """New tokens of one sequence over its cached prefix: the K/V of positions < ``start`` is in the
    blocks of ``block_table``, which cover ``start + len(token_ids)`` positions (the new tokens' K/V
    is written there)."""
    block_table: list[int]
    start: int
    token_ids: list[int]


class ModelRunner:
    def __init__(self, model, block_size: int = 16, kv_cache_dtype: Union[str, torch.dtype, None] = "auto",
                 num_blocks: Optional[int] = None, kv_cache_memory: Union[int, str, None] = None,
                 kv_cache_fraction: Optional[float] = None, max_num_seqs: int = 64,
                 attention_backend: str = "auto", fuse_projections: Optional[bool] = None,
                 lm_head_quant: Optional[str] = None, cuda_graph: Optional[bool] = None,
                 graph_buckets: Optional[tuple[int, ...]] = None):
        """``cuda_graph``: decode through the static step (engine.static_step), replayed from a CUDA
        graph per batch-size bucket on CUDA (None: off, until it has been checked on a GPU; on CPU True runs
        the same static-buffer step eagerly); ``graph_buckets``: its batch sizes (default from ``max_num_seqs``)."""
        self.model = model
        cfg = model.config
        self.config = cfg
        self.device = next(model.parameters()).device
        # q/k/v and gate/up of QuantLinear layers as one matmul each (engine.fused); default on CPU only,
        # where per-call overhead dominates and the stacked copy of those weights costs little
        if fuse_projections is None:
            fuse_projections = self.device.type == "cpu"
        self.decoder = DecoderModel.build(model, fuse_projections, lm_head_quant)
        dm = self.decoder
        self.embed, self.lm_head, self.head = dm.embed, dm.lm_head, dm.head
        self.plans, self.fused = dm.plans, dm.fused
        self.device = self.embed.weight.device
        self.num_layers = len(self.plans)
        self.num_heads, self.num_kv_heads, self.head_dim = dm.num_heads, dm.num_kv_heads, dm.head_dim
        self.scale = 1.0 if dm.layout.attention.query_scaled else self.head_dim ** -0.5
        if dm.attention_scale is not None:
            self.scale = dm.attention_scale
        self.dtype = dm.dtype
        self.block_size = block_size
        self.rotary = RotaryEmbedding.from_config(cfg, self.device) if dm.layout.rotary else None
        self.sliding_window = dm.layout.sliding_window  # not implemented: requests are kept within the
        # window, where full causal attention is exactly the same

        kv_dtype, quantized = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        self.bytes_per_block = bytes_per_block(self.num_layers, block_size, self.num_kv_heads, self.head_dim,
                                               kv_dtype, quantized)
        if num_blocks is None:
            num_blocks = self._pool_blocks(kv_cache_memory, kv_cache_fraction, max_num_seqs)
        self.num_blocks = int(num_blocks)
        # off unless asked until the CUDA path has run on a GPU (scripts/gpu_check.sh runs it both ways)
        static = bool(cuda_graph)
        # the static step's padding rows write to one scratch block past the block manager's range
        from quantkit.runtime.kv_scales import calibrated_kv_scales

        # fp8 on a checkpoint with calibrated KV scales (quantize --kv-cache-scheme): those, as vLLM uses them
        calibrated = calibrated_kv_scales(model) if kv_dtype == torch.float8_e4m3fn else None
        self.kv_cache = KVCache(self.num_layers, self.num_blocks + int(static), block_size, self.num_kv_heads,
                                self.head_dim, self.dtype, kv_cache_dtype, self.device, static_scales=calibrated)

        from quantkit.engine import c_decode_step

        # the whole layer stack of a few-token step in one C call where the model allows (engine.c_decode_step)
        self.c_step, self.c_step_problem = c_decode_step.build(model, self.decoder, self.kv_cache, block_size,
                                                               self.scale, self.rotary)

        from quantkit.kernels.triton_support import triton_installed
        from quantkit.kernels.paged_attention import (decode_slots, extend_slots, paged_attention_decode,
                                                      paged_attention_decode_gathered, paged_attention_extend_gathered,
                                                      triton_decode_available)

        self._decode_attention = paged_attention_decode
        self._gathered_attention = paged_attention_decode_gathered
        self._extend_attention = paged_attention_extend_gathered
        self._decode_slots = decode_slots
        self._extend_slots = extend_slots
        if attention_backend not in ("auto", "torch", "triton"):
            raise QuantkitError(f"attention_backend must be auto, torch or triton, got {attention_backend!r}")
        if attention_backend == "triton" and not triton_installed():
            raise QuantkitError("attention_backend 'triton' needs the triton package, which is not installed "
                                "(Linux wheels only); use attention_backend 'torch'")
        if attention_backend == "auto":
            self.use_triton = self.device.type == "cuda" and triton_decode_available(self.device)
        else:
            self.use_triton = attention_backend == "triton"

        from quantkit.engine.static_step import StaticDecodeStep, batch_buckets, static_step_problem

        self.static_step: Optional[StaticDecodeStep] = None
        self.static_step_problem = static_step_problem(self) if static else "off (cuda_graph=False)"
        if static and self.static_step_problem is None:
            self.static_step = StaticDecodeStep(self, graph_buckets or batch_buckets(max_num_seqs),
                                                scratch_block=self.num_blocks, use_graphs=self.device.type == "cuda")

    def _pool_blocks(self, kv_cache_memory, kv_cache_fraction: Optional[float], max_num_seqs: int) -> int:
        """KV blocks for a memory budget: the given one, else a fraction of free memory (capped on
        CPU), never more than every sequence slot at full length."""
        if kv_cache_memory is not None:
            budget = parse_bytes(kv_cache_memory)
            num_blocks = budget // self.bytes_per_block
        else:
            cuda = self.device.type == "cuda"
            frac = kv_cache_fraction
            if frac is None:
                frac = GPU_DEFAULT_FRACTION if cuda else CPU_DEFAULT_FRACTION
            budget = int(available_memory(self.device) * frac)
            if not cuda:
                budget = min(budget, CPU_DEFAULT_CAP)
            max_len = int(getattr(self.config, "max_position_embeddings", 4096) or 4096)
            cap = max_num_seqs * (-(-max_len // self.block_size))
            num_blocks = min(budget // self.bytes_per_block, cap)
        if num_blocks < 1:
            raise QuantkitError(f"the KV cache budget of {budget} bytes holds no block of {self.bytes_per_block} "
                                f"bytes ({self.block_size} tokens); give it more memory")
        return num_blocks

    # ------------------------------------------------------------------ batch preparation
    def _slots(self, seq: Sequence, start: int, end: int, skip_below: int = 0) -> list[int]:
        bs = self.block_size
        table = seq.block_table
        return [table[p // bs] * bs + p % bs if p >= skip_below else -1 for p in range(start, end)]

    def prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slots = [], [], []
        starts, lens, ctx, tables = [], [], [], []
        for seq in seqs:
            start, n = seq.prefill_start, len(seq)
            starts.append(len(input_ids))
            lens.append(n - start)
            ctx.append(n)
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, n))
            # a token recomputed inside a cached (possibly shared) block is not written back
            slots.extend(self._slots(seq, start, n, skip_below=seq.num_cached_tokens))
            tables.append(torch.tensor(seq.block_table, dtype=torch.long, device=self.device))
        dev = self.device
        meta = AttentionMetadata(True, torch.tensor(slots, dtype=torch.long, device=dev), min(slots) < 0, starts, lens,
                                 ctx, tables)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    def prepare_decode(self, seqs: list[Sequence]):
        bs = self.block_size
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        dev = self.device
        meta = AttentionMetadata(False, torch.tensor(slots, dtype=torch.long, device=dev))
        if self.use_triton:
            width = max(len(seq.block_table) for seq in seqs)
            tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
            meta.block_tables_t = torch.tensor(tables, dtype=torch.int32, device=dev)
            meta.context_lens_t = torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=dev)
        else:
            meta.decode_slots, meta.decode_mask = self._decode_slots([seq.block_table for seq in seqs],
                                                                     [len(s) for s in seqs], bs, dev)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    def prepare_extend(self, reqs: list[ExtendRequest]):
        """[B * Q] ids and positions for Q = the most new tokens of any request; a request with fewer
        is padded by repeating its last token, whose K/V is not written (slot -1) and whose outputs
        are dropped."""
        bs, Q = self.block_size, max(len(r.token_ids) for r in reqs)
        input_ids, positions, slots = [], [], []
        for r in reqs:
            n, pad = len(r.token_ids), Q - len(r.token_ids)
            pos = list(range(r.start, r.start + n))
            input_ids.extend(r.token_ids + r.token_ids[-1:] * pad)
            positions.extend(pos + pos[-1:] * pad)
            slots.extend([r.block_table[p // bs] * bs + p % bs for p in pos] + [-1] * pad)
        dev = self.device
        meta = AttentionMetadata(False, torch.tensor(slots, dtype=torch.long, device=dev),
                                 has_skipped_slots=len(slots) != sum(len(r.token_ids) for r in reqs),
                                 extend_shape=(len(reqs), Q))
        meta.decode_slots, meta.decode_mask = self._extend_slots(
            [r.block_table for r in reqs], [r.start for r in reqs], [len(r.token_ids) for r in reqs], bs,
            self.num_heads // self.num_kv_heads, dev)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    def _c_step_rows(self, rows: list[tuple[list[int], int, int, bool]]):
        """(ids, positions, slots, tables) of the C step for rows (block table, position, token, write K/V?)."""
        bs, dev = self.block_size, self.device
        width = max(len(table) for table, _, _, _ in rows)
        slots = [table[p // bs] * bs + p % bs if write else -1 for table, p, _, write in rows]
        return (torch.tensor([t for _, _, t, _ in rows], dtype=torch.long, device=dev),
                torch.tensor([p for _, p, _, _ in rows], dtype=torch.long, device=dev),
                torch.tensor(slots, dtype=torch.long, device=dev),
                torch.tensor([table + [0] * (width - len(table)) for table, _, _, _ in rows], dtype=torch.int32,
                             device=dev))

    def _c_forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   tables: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` through the C step (self.c_step): embedding, every layer in C, the final norm."""
        dm = self.decoder
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        x = self.c_step(dm.embed(ids), positions, slots, tables, cos, RotaryEmbedding.signed_sin(sin))
        for f in dm.post:
            x = f(x)
        return x

    # ------------------------------------------------------------------ forward
    def attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] (already written to the cache) -> [N, H, D]."""
        kc, vc, ks, vs = self.kv_cache.layer(i)
        if not meta.is_prefill:
            if meta.extend_shape is not None:
                B, Q = meta.extend_shape
                out = self._extend_attention(q.view(B, Q, *q.shape[1:]), kc, vc, meta.decode_slots, meta.decode_mask,
                                             self.scale, ks, vs)
                return out.reshape(q.shape)
            if meta.decode_slots is not None:
                return self._gathered_attention(q, kc, vc, meta.decode_slots, meta.decode_mask, self.scale, ks, vs)
            return self._decode_attention(q, kc, vc, meta.block_tables_t, meta.context_lens_t, self.scale, ks, vs,
                                          use_triton=self.use_triton)
        out = torch.empty_like(q)
        for s, n, c, table in zip(meta.query_starts, meta.query_lens, meta.context_lens, meta.block_tables):
            qi = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if n == c:  # nothing cached: attend over the fresh K/V
                ki, vi = k[s:s + n], v[s:s + n]
                mask, causal = None, True
            else:
                ki, vi = self.kv_cache.gather(i, table, c, q.dtype)
                pos_q = torch.arange(c - n, c, device=q.device)
                mask = torch.arange(c, device=q.device)[None, :] <= pos_q[:, None]  # [n, c]
                causal = False
            oi = F.scaled_dot_product_attention(qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                                                attn_mask=mask, is_causal=causal, scale=self.scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            out[s:s + n] = oi[0].transpose(0, 1)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[N] token ids -> [N, hidden] hidden states after the last layer and the final norm."""
        N, H, D = input_ids.shape[0], self.num_heads, self.head_dim
        dm = self.decoder
        x = dm.embed(input_ids)
        if dm.project_in is not None:
            x = dm.project_in(x)
        if dm.positions is not None:
            table, offset = dm.positions
            x = x + F.embedding(positions + offset, table)
        rope = None
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
            rotate = self.rotary.rotate_partial if self.rotary.partial else RotaryEmbedding.rotate
            rope = (rotate, cos[:, None, :], RotaryEmbedding.signed_sin(sin)[:, None, :])
        for i, p in enumerate(self.plans):
            h = p.attn_norm(x) if p.norm_before else x
            q, k, v = self._qkv(p, h, N, rope)
            self.kv_cache.store(i, k, v, meta.slot_mapping, meta.has_skipped_slots)
            attn = self.attention(i, q, k, v, meta)
            if dm.value_dim is not None:  # MLA: drop the padded value channels
                attn = attn.reshape(N, H, D)[..., :dm.value_dim]
            x = x + p.o(attn.reshape(N, -1))
            if not p.norm_before:
                x = p.attn_norm(x)
            x = x + self._mlp(p, p.mlp_norm(x) if p.norm_before else x)
            if not p.norm_before:
                x = p.mlp_norm(x)
        for f in dm.post:
            x = f(x)
        return x

    def _qkv(self, p, h: torch.Tensor, N: int, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, H, D], k and v [N, KVH, D], rotated (and normed, scaled) as the family does; ``rope``
        is (rotate, cos, signed sin) or None."""
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        if p.latent is not None:
            return p.latent(h, rope)
        if p.qkv is not None:
            qkv = p.qkv(h).view(N, H + 2 * KVH, D)
            if rope is not None and p.q_norm is None and p.query_scale is None:  # q and k rotated as one tensor
                qk = rope[0](qkv[:, :H + KVH], rope[1], rope[2])
                return qk[:, :H], qk[:, H:], qkv[:, H + KVH:]
            q, k, v = qkv[:, :H], qkv[:, H:H + KVH], qkv[:, H + KVH:]
        else:
            q, k, v = p.q(h), p.k(h), p.v(h)
            if p.qk_norm_whole:  # OLMoE: over the whole projection, before the heads split
                q, k = p.q_norm(q), p.k_norm(k)
            q, k, v = q.view(N, H, D), k.view(N, KVH, D), v.view(N, KVH, D)
        if p.query_scale is not None:
            q = q * p.query_scale
        if p.q_norm is not None and not p.qk_norm_whole:
            q, k = p.q_norm(q), p.k_norm(k)
        if rope is not None:
            rotate, cos, sin_signed = rope
            q, k = rotate(q, cos, sin_signed), rotate(k, cos, sin_signed)
        return q, k, v

    @staticmethod
    def _mlp(p, h: torch.Tensor) -> torch.Tensor:
        if p.moe is not None:
            return p.moe(h)
        if not p.gated:
            return p.down(p.act(p.up(h)))
        if p.gate_up is not None:
            gate, up = p.gate_up(h).chunk(2, dim=-1)
        else:
            gate, up = p.gate(h), p.up(h)
        return p.down(F.silu(gate).mul_(up) if p.act is F.silu else p.act(gate) * up)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits [len(seqs), vocab] for each sequence's next token (fp32)."""
        if not is_prefill and self.static_step is not None:
            logits = self.static_step.run(seqs)  # None above the largest bucket: the eager step below
            if logits is not None:
                return logits
        if not is_prefill and self.c_step is not None and len(seqs) <= DECODE_ROWS:
            rows = [(seq.block_table, len(seq) - 1, seq.last_token, True) for seq in seqs]
            return self.head(self._c_forward(*self._c_step_rows(rows))).float()
        input_ids, positions, meta = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        hidden = self.forward(input_ids, positions, meta)
        if is_prefill:
            last = torch.tensor([s + n - 1 for s, n in zip(meta.query_starts, meta.query_lens)], device=self.device)
            hidden = hidden[last]
        return self.head(hidden).float()

    @torch.inference_mode()
    def run_extend(self, reqs: list[ExtendRequest], last_only: bool = False) -> torch.Tensor:
        """Logits (fp32) after every new token of each request, [B, Q, vocab] (rows past a request's
        token count are padding), or after its last one only, [B, vocab]."""
        B, Q = len(reqs), max(len(r.token_ids) for r in reqs)
        if self.c_step is not None and B * Q <= DECODE_ROWS:  # padding rows as prepare_extend's: K/V not written
            rows = [(r.block_table, r.start + min(j, len(r.token_ids) - 1), r.token_ids[min(j, len(r.token_ids) - 1)],
                     j < len(r.token_ids)) for r in reqs for j in range(Q)]
            hidden = self._c_forward(*self._c_step_rows(rows))
        else:
            input_ids, positions, meta = self.prepare_extend(reqs)
            hidden = self.forward(input_ids, positions, meta)
        if last_only:
            hidden = hidden[torch.tensor([b * Q + len(r.token_ids) - 1 for b, r in enumerate(reqs)], device=self.device)]
            return self.head(hidden).float()
        return self.head(hidden).float().view(B, Q, -1)

    @torch.inference_mode()
    def run_all_logits(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Prefill ``seqs`` (allocated without prefix caching) and return logits at every prompt
        position, [len(seq), vocab] each, in the LM head's dtype."""
        input_ids, positions, meta = self.prepare_prefill(seqs)
        if any(n != c for n, c in zip(meta.query_lens, meta.context_lens)):
            raise RuntimeError("run_all_logits needs sequences without cached prefix")
        hidden = self.forward(input_ids, positions, meta)
        return [self.head(hidden[s:s + n]) for s, n in zip(meta.query_starts, meta.query_lens)]
