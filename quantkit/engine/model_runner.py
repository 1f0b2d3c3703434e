"""Runs a Llama-family transformers model (Llama, Mistral, Qwen2, Qwen3; GQA) over paged KV.

The model's own modules provide the weights: embedding, the q/k/v/o and MLP linears (plain
``nn.Linear`` or quantkit ``QuantLinear`` on any backend: they are only called), the norms'
weights and the LM head. Everything between them is here: RMSNorm, rotary embeddings, K/V
writes into the paged pool and attention.

A step packs the new tokens of all its sequences into one [N, hidden] batch, so every linear runs
once per layer for the whole batch.

* Prefill: each sequence's uncached tokens, with a causal mask. Without a cached prefix it
  attends over its fresh K/V; with one (prefix-cache hit) it attends over the K/V gathered from
  its blocks (the cached prefix plus the new tokens, written first) with the causal mask offset by
  the prefix length.
* Decode: one token per sequence, paged attention over its block table: the Triton kernel on
  GPU; on CPU a gather of every sequence's cached tokens (their slots computed once per step for
  all layers) and softmax attention in fp32.

A batch-1 CPU decode step of a small model is bound by per-op dispatch, not arithmetic, so the
layer loop keeps its op count low where that costs no exactness: each layer's projections, norm
weights and epsilons are resolved once into a LayerPlan (plain callables, no module or backend
dispatch per call), q and k of a fused q/k/v projection are rotated as one tensor, attention's
per-step set-up is shared by all layers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.engine.kv_cache import KVCache, bytes_per_block, parse_bytes, resolve_kv_dtype
from quantkit.engine.rotary import RotaryEmbedding
from quantkit.engine.sequence import Sequence
from quantkit.engine.sliced_linear import linear_fn
from quantkit.errors import QuantkitError

CPU_DEFAULT_FRACTION = 0.25
CPU_DEFAULT_CAP = 4 << 30
GPU_DEFAULT_FRACTION = 0.9


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers' Llama/Qwen: normalise in fp32, cast back, scale.

    ``F.rms_norm`` without a weight is PyTorch's composite of the very ops transformers writes out
    (upcast, pow, mean, + eps, rsqrt, mul, cast back), one Python call instead of seven (tested
    bit-equal in fp32, bf16 and fp16). The weight stays outside: inside, bf16 would round once
    where transformers rounds twice."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def matmul_fn(module: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module` (a projection) as a plain callable on [N, in] activations in `dtype`, computing
    exactly what its forward does: ``F.linear`` for an ``nn.Linear`` (threaded by output rows where
    that is bit-equal, see engine.sliced_linear), the backend's direct entry
    for a ``QuantLinear``, the module itself otherwise. A batch-1 CPU decode step calls ~200 of
    them; module and backend dispatch were ~10 us of each call."""
    from quantkit.runtime.quant_linear import QuantLinear

    hooked = module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")  # e.g. offload
    if type(module) is nn.Linear and not hooked:
        return linear_fn(module.weight, module.bias)  # split across threads where exact (engine.sliced_linear)
    if isinstance(module, QuantLinear):
        return module.matmul_fn(dtype)
    return module


def _norm_eps(module, default: float) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(module, attr):
            return float(getattr(module, attr))
    return default


def _refuse_experts(model, layers) -> None:
    """The engine has no routed-experts path yet: a Mixture-of-Experts model is refused, not run wrong."""
    from quantkit.models import get_adapter

    try:
        adapter = get_adapter(model)
    except QuantkitError:
        return  # not a family quantkit knows: the structural checks below decide
    if any(adapter.moe_blocks(layer) for layer in layers):
        raise QuantkitError(f"the engine does not decode Mixture-of-Experts models ({model.config.model_type}) yet; "
                            "use quantkit.load with transformers' generate, or quantkit eval without --engine")


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


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


@dataclass
class LayerPlan:
    """One decoder layer as the forward loop calls it, resolved once from the model's modules (so a
    runner must be rebuilt after the model is moved or its QuantLinear backends are switched)."""
    in_norm: torch.Tensor  # norm weights and epsilons
    in_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: Optional[Callable]  # fused q/k/v: [N, hidden] -> [N, (H + 2 KVH) D]; else q, k, v apart
    q: Optional[Callable]
    k: Optional[Callable]
    v: Optional[Callable]
    qk_norm: Optional[tuple[torch.Tensor, float, torch.Tensor, float]]  # Qwen3: weights and epsilons
    o: Callable
    gate_up: Optional[Callable]  # gated MLP with a fused gate/up: [N, hidden] -> [N, 2 I]
    gate: Optional[Callable]  # gated MLP, unfused
    up: Optional[Callable]
    down: Optional[Callable]
    act: Optional[Callable]
    mlp: nn.Module  # any other MLP: called whole


class ModelRunner:
    def __init__(self, model, block_size: int = 16, kv_cache_dtype: Union[str, torch.dtype, None] = "auto",
                 num_blocks: Optional[int] = None, kv_cache_memory: Union[int, str, None] = None,
                 kv_cache_fraction: Optional[float] = None, max_num_seqs: int = 64,
                 attention_backend: str = "auto", fuse_projections: Optional[bool] = None):
        self.model = model
        cfg = model.config
        self.config = cfg
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
            raise QuantkitError(f"the engine runs Llama-family models (Llama, Mistral, Qwen2, Qwen3); "
                                f"{type(model).__name__} has no model.layers / embed_tokens / norm")
        _refuse_experts(model, layers)
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                    or not hasattr(layer, "mlp"):
                raise QuantkitError(f"{type(model).__name__}: decoder layers need self_attn.q/k/v/o_proj and mlp; "
                                    "the engine runs Llama-family models only")
        self.embed = inner.embed_tokens
        self.layers = list(layers)
        self.final_norm = inner.norm
        self.lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.scale = self.head_dim ** -0.5
        self.dtype = self.embed.weight.dtype
        self.head = matmul_fn(self.lm_head, self.dtype)  # the call the runner makes
        self.device = self.embed.weight.device
        self.block_size = block_size
        # q/k/v and gate/up of QuantLinear layers as one matmul each (engine.fused); default on CPU only,
        # where per-call overhead dominates and the stacked copy of those weights costs little
        if fuse_projections is None:
            fuse_projections = self.device.type == "cpu"
        self.fused = [self._fuse(layer) if fuse_projections else (None, None) for layer in self.layers]
        self.plans = [self._plan(layer, qkv, gate_up) for layer, (qkv, gate_up) in zip(self.layers, self.fused)]
        self.final_eps = _norm_eps(self.final_norm, self.eps)
        self.rotary = RotaryEmbedding.from_config(cfg, self.device)
        uses_window = getattr(cfg, "use_sliding_window", cfg.model_type == "mistral")
        self.sliding_window = getattr(cfg, "sliding_window", None) if uses_window else None  # not implemented:
        # requests are kept within the window, where full causal attention is exactly the same

        kv_dtype, quantized = resolve_kv_dtype(kv_cache_dtype, self.dtype)
        self.bytes_per_block = bytes_per_block(self.num_layers, block_size, self.num_kv_heads, self.head_dim,
                                               kv_dtype, quantized)
        if num_blocks is None:
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
                max_len = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
                cap = max_num_seqs * (-(-max_len // block_size))  # never more than every slot at full length
                num_blocks = min(budget // self.bytes_per_block, cap)
            if num_blocks < 1:
                raise QuantkitError(f"the KV cache budget of {budget} bytes holds no block of {self.bytes_per_block} "
                                    f"bytes ({block_size} tokens); give it more memory")
        self.num_blocks = int(num_blocks)
        self.kv_cache = KVCache(self.num_layers, self.num_blocks, block_size, self.num_kv_heads, self.head_dim,
                                self.dtype, kv_cache_dtype, self.device)

        from quantkit.kernels.paged_attention import (decode_slots, paged_attention_decode,
                                                      paged_attention_decode_gathered, triton_decode_available)

        self._decode_attention = paged_attention_decode
        self._gathered_attention = paged_attention_decode_gathered
        self._decode_slots = decode_slots
        if attention_backend not in ("auto", "torch", "triton"):
            raise QuantkitError(f"attention_backend must be auto, torch or triton, got {attention_backend!r}")
        if attention_backend == "auto":
            self.use_triton = self.device.type == "cuda" and triton_decode_available(self.device)
        else:
            self.use_triton = attention_backend == "triton"

    @staticmethod
    def _fuse(layer):
        from quantkit.engine.fused import FusedProjection

        attn, mlp = layer.self_attn, layer.mlp
        qkv = FusedProjection.build([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = None
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            gate_up = FusedProjection.build([mlp.gate_proj, mlp.up_proj])
        return qkv, gate_up

    def _plan(self, layer, fused_qkv, fused_gate_up) -> LayerPlan:
        attn, mlp, dt = layer.self_attn, layer.mlp, self.dtype
        qk_norm = None
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over head_dim on q and k before rope
            qk_norm = (attn.q_norm.weight, _norm_eps(attn.q_norm, self.eps), attn.k_norm.weight,
                       _norm_eps(attn.k_norm, self.eps))
        gated = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        act = None
        if gated:
            act = F.silu if isinstance(mlp.act_fn, nn.SiLU) else mlp.act_fn
        # the projections a fused one replaces are not resolved: a QuantLinear would build (pack) its
        # own backend, a second copy of the fused weight that the forward never calls
        apart = fused_qkv is None
        gate_up_apart = gated and fused_gate_up is None
        return LayerPlan(
            in_norm=layer.input_layernorm.weight, in_eps=_norm_eps(layer.input_layernorm, self.eps),
            post_norm=layer.post_attention_layernorm.weight,
            post_eps=_norm_eps(layer.post_attention_layernorm, self.eps),
            qkv=None if apart else fused_qkv.matmul_fn(dt),
            q=matmul_fn(attn.q_proj, dt) if apart else None, k=matmul_fn(attn.k_proj, dt) if apart else None,
            v=matmul_fn(attn.v_proj, dt) if apart else None,
            qk_norm=qk_norm, o=matmul_fn(attn.o_proj, dt),
            gate_up=None if fused_gate_up is None else fused_gate_up.matmul_fn(dt),
            gate=matmul_fn(mlp.gate_proj, dt) if gate_up_apart else None,
            up=matmul_fn(mlp.up_proj, dt) if gate_up_apart else None,
            down=matmul_fn(mlp.down_proj, dt) if gated else None, act=act, mlp=mlp)

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

    # ------------------------------------------------------------------ forward
    def attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] (already written to the cache) -> [N, H, D]."""
        kc, vc, ks, vs = self.kv_cache.layer(i)
        if not meta.is_prefill:
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
        """[N] token ids -> [N, hidden] final-normed hidden states."""
        N = input_ids.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        cos, sin_signed = cos[:, None, :], RotaryEmbedding.signed_sin(sin)[:, None, :]
        rotate = RotaryEmbedding.rotate
        for i, p in enumerate(self.plans):
            h = rms_norm(x, p.in_norm, p.in_eps)
            if p.qkv is not None and p.qk_norm is None:
                qkv = p.qkv(h).view(N, H + 2 * KVH, D)
                qk = rotate(qkv[:, :H + KVH], cos, sin_signed)
                q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH:]
            else:
                if p.qkv is not None:
                    q, k, v = p.qkv(h).split((H * D, KVH * D, KVH * D), dim=-1)
                else:
                    q, k, v = p.q(h), p.k(h), p.v(h)
                q, k, v = q.view(N, H, D), k.view(N, KVH, D), v.view(N, KVH, D)
                if p.qk_norm is not None:
                    q = rms_norm(q, p.qk_norm[0], p.qk_norm[1])
                    k = rms_norm(k, p.qk_norm[2], p.qk_norm[3])
                q, k = rotate(q, cos, sin_signed), rotate(k, cos, sin_signed)
            self.kv_cache.store(i, k, v, meta.slot_mapping, meta.has_skipped_slots)
            x = x + p.o(self.attention(i, q, k, v, meta).reshape(N, H * D))
            h = rms_norm(x, p.post_norm, p.post_eps)
            if p.gate_up is not None:
                gate, up = p.gate_up(h).chunk(2, dim=-1)
            elif p.act is not None:
                gate, up = p.gate(h), p.up(h)
            else:
                x = x + p.mlp(h)
                continue
            x = x + p.down(F.silu(gate).mul_(up) if p.act is F.silu else p.act(gate) * up)
        return rms_norm(x, self.final_norm.weight, self.final_eps)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits [len(seqs), vocab] for each sequence's next token (fp32)."""
        input_ids, positions, meta = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        hidden = self.forward(input_ids, positions, meta)
        if is_prefill:
            last = torch.tensor([s + n - 1 for s, n in zip(meta.query_starts, meta.query_lens)], device=self.device)
            hidden = hidden[last]
        return self.head(hidden).float()

    @torch.inference_mode()
    def run_all_logits(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Prefill ``seqs`` (allocated without prefix caching) and return logits at every prompt
        position, [len(seq), vocab] each, in the LM head's dtype."""
        input_ids, positions, meta = self.prepare_prefill(seqs)
        if any(n != c for n, c in zip(meta.query_lens, meta.context_lens)):
            raise RuntimeError("run_all_logits needs sequences without cached prefix")
        hidden = self.forward(input_ids, positions, meta)
        return [self.head(hidden[s:s + n]) for s, n in zip(meta.query_starts, meta.query_lens)]
