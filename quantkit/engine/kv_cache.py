"""The paged KV pool: one preallocated tensor per K and V, in the model dtype, int8 or fp8.

Layout: ``k[layer]`` / ``v[layer]`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot
(``block_id * block_size + offset``) holds one token's vectors for all KV heads.

Quantized caches (``kv_cache_dtype``):

* ``"int8"``: symmetric, one fp32 scale per token and KV head, ``scale = absmax / 127``,
  ``q = round(x / scale)``.
* ``"fp8"`` (alias ``"fp8_e4m3"``): ``torch.float8_e4m3fn`` with one fp32 scale per token and KV
  head, ``scale = absmax / 448`` (the e4m3 maximum), so each vector uses the full fp8 range. A
  dynamic scale costs 4 bytes per 64-128 values but needs no calibration, unlike a fixed
  per-tensor scale, and cannot overflow.
* ``"fp8"`` with ``static_scales`` (a checkpoint written by ``quantize --kv-cache-scheme``, read by
  ``quantkit.runtime.kv_scales``): each layer's calibrated scale (per tensor or per KV head,
  ``absmax / 448`` over the calibration tokens) instead, as vLLM applies a checkpoint's ``k_scale`` /
  ``v_scale``; values beyond the calibrated range saturate at +-448. The per-slot scale tensors hold
  that value, so every attention path reads the cache alike (no memory is saved by it here).

Scales live in ``k_scale`` / ``v_scale`` ``[layers, num_blocks, block_size, num_kv_heads]``.
Values are dequantized (``q * scale``) when attention reads them. A prefill without cached prefix
attends over the freshly computed (unquantized) K/V, like vLLM; decode and prefix hits read the
cache. ``"auto"`` keeps the model dtype (no scales).
"""
from __future__ import annotations

import re
from typing import Optional, Union

import torch

from quantkit.errors import QuantkitError

FP8_MAX = 448.0
INT8_MAX = 127.0
_ALIASES = {"auto": "auto", "model": "auto", "int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8",
            "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def resolve_kv_dtype(kv_cache_dtype: Union[str, torch.dtype, None], model_dtype: torch.dtype) -> tuple[torch.dtype, bool]:
    """(storage dtype, quantized with scales?) for a ``kv_cache_dtype`` name."""
    if isinstance(kv_cache_dtype, torch.dtype):
        name = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}.get(kv_cache_dtype, kv_cache_dtype)
    else:
        key = str(kv_cache_dtype or "auto").strip().lower()
        if key not in _ALIASES:
            raise QuantkitError(f"unknown kv cache dtype {kv_cache_dtype!r}; use auto, int8 or fp8 "
                                "(or fp16/bf16/fp32)")
        name = _ALIASES[key]
    if name == "auto":
        return model_dtype, False
    if name == "int8":
        return torch.int8, True
    if name == "fp8":
        return torch.float8_e4m3fn, True
    return name, False


def kv_dtype_name(dtype: torch.dtype) -> str:
    return {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.float32: "fp32"}.get(dtype, str(dtype))


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    quantized: bool) -> int:
    """Bytes one block takes over all layers, K and V, scales included."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token_head = head_dim * elem + (4 if quantized else 0)
    return 2 * num_layers * block_size * num_kv_heads * per_token_head


def parse_bytes(value: Union[int, float, str]) -> int:
    """``1073741824``, ``"512MB"``, ``"1.5GiB"`` -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", str(value).lower())
    if not m:
        raise QuantkitError(f"cannot read {value!r} as a memory size; write e.g. 512MB or 2GiB")
    num, unit, _ = m.groups()
    return int(float(num) * (1024 ** "_kmgt".index(unit) if unit else 1))


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q in ``dtype``, fp32 scale [...]); symmetric per vector."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    qmax = INT8_MAX if dtype == torch.int8 else FP8_MAX
    scale = (amax / qmax).clamp_min(1e-12)
    y = xf / scale.unsqueeze(-1)
    if dtype == torch.int8:
        q = y.round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = y.clamp_(-FP8_MAX, FP8_MAX).to(dtype)
    return q, scale


def quantize_kv_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, KVH, D] -> (fp8 q, fp32 scale [N, KVH]) with one calibrated fp32 scale per KV head `scale`
    [KVH] (a per-tensor scale repeated); saturating at +-448 as vLLM's fp8 cache writes do."""
    s = scale.to(device=x.device, dtype=torch.float32)
    q = (x.float() / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.expand(x.shape[:-1])


def dequantize_kv(q: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 model_dtype: torch.dtype, kv_cache_dtype: Union[str, torch.dtype, None] = "auto",
                 device: Union[str, torch.device] = "cpu",
                 static_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """``static_scales``: calibrated (k, v) fp32 scales [num_layers, num_kv_heads] for an fp8 cache
        (quantkit.runtime.kv_scales); None: dynamic per-token-head scales."""
        self.dtype, self.quantized = resolve_kv_dtype(kv_cache_dtype, model_dtype)
        if static_scales is not None:
            if self.dtype != torch.float8_e4m3fn:
                raise QuantkitError("calibrated KV-cache scales are FP8 scales; use kv_cache_dtype fp8 with them")
            want = (num_layers, num_kv_heads)
            if any(tuple(t.shape) != want for t in static_scales):
                raise QuantkitError(f"calibrated KV-cache scales have shapes {[tuple(t.shape) for t in static_scales]}, "
                                    f"the model needs {want}; the checkpoint does not match this model")
            static_scales = tuple(t.to(device=device, dtype=torch.float32) for t in static_scales)
        self.static_scales = static_scales
        self.model_dtype = model_dtype
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: unused slots must never hold NaN (masked softmax weights are 0, 0*NaN is NaN)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)
        if self.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        else:
            self.k_scale = self.v_scale = None
        # each layer's views made once: a decode step asks for them twice per layer, and at batch 1
        # on CPU the few microseconds of each select/view are what the step is made of
        self._layers = [(self.k[i], self.v[i], None if self.k_scale is None else self.k_scale[i],
                         None if self.v_scale is None else self.v_scale[i]) for i in range(num_layers)]
        self._slot_views = [self._by_slot(*views) for views in self._layers]

    def _by_slot(self, kc, vc, ks, vs):
        """One layer's K/V (and scales) with blocks flattened to slots, [slots, KVH, D] ([slots, KVH]);
        fp8 through a byte view (index_copy_ does not cover fp8)."""
        kvh, d = self.num_kv_heads, self.head_dim
        if self.dtype == torch.float8_e4m3fn:
            kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
        return (kc.view(-1, kvh, d), vc.view(-1, kvh, d), None if ks is None else ks.view(-1, kvh),
                None if vs is None else vs.view(-1, kvh))

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                               self.quantized)

    @property
    def name(self) -> str:
        return kv_dtype_name(self.dtype) + ("_static" if self.static_scales is not None else "")

    def layer(self, i: int):
        """(k, v, k_scale, v_scale) views of layer ``i`` (scales None when not quantized)."""
        return self._layers[i]

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              may_skip: bool = True) -> None:
        """Write k, v [N, KVH, D] to slots [N]; negative slots are skipped (already cached tokens).
        ``may_skip=False`` promises there are none (saves a device sync per layer in decode)."""
        if may_skip:
            keep = slot_mapping >= 0
            if not bool(keep.all()):
                k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        if slot_mapping.numel() == 0:
            return
        kc, vc, ks, vs = self._slot_views[i]
        if self.static_scales is not None:
            k, k_scale = quantize_kv_static(k, self.static_scales[0][i])
            v, v_scale = quantize_kv_static(v, self.static_scales[1][i])
            ks.index_copy_(0, slot_mapping, k_scale)
            vs.index_copy_(0, slot_mapping, v_scale)
        elif self.quantized:
            k, k_scale = quantize_kv(k, self.dtype)
            v, v_scale = quantize_kv(v, self.dtype)
            ks.index_copy_(0, slot_mapping, k_scale)
            vs.index_copy_(0, slot_mapping, v_scale)
        else:
            k, v = k.to(self.dtype), v.to(self.dtype)
        if k.dtype != kc.dtype:  # fp8 through the byte views
            k, v = k.view(kc.dtype), v.view(vc.dtype)
        kc.index_copy_(0, slot_mapping, k)
        vc.index_copy_(0, slot_mapping, v)

    def gather(self, i: int, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        """The first ``length`` cached K and V of one sequence, [length, KVH, D] in ``dtype``."""
        from quantkit.kernels.paged_attention import gather_kv

        kc, vc, ks, vs = self.layer(i)
        return gather_kv(kc, ks, block_table, length, dtype), gather_kv(vc, vs, block_table, length, dtype)
