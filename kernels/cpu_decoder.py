"""A stack of Llama-shaped decoder layers for a few tokens in one C call (CPU decode); see cpu_decoder.c.

Why: after the int4/int8 decode kernels (cpu_gemv), the projections of a demo-model decode step take
~8 ms and the ~15 PyTorch calls per layer around them (norms, rotary, K/V writes, attention, SiLU,
residuals) another 9-10 ms of dispatch. This runs all layers of a step in C on the same projection
kernels, so that what a step costs is its weights' memory traffic. It covers what the Llama family
and its kin (Qwen2 with q/k/v bias, Mistral) compute: pre-norm RMSNorm, one fused q/k/v and one
fused gate/up projection (or the three and two apart), full rotary, GQA attention over an fp32 paged
cache, SiLU-gated MLP; projections int4, int8 or unquantized fp32 (cpu_gemv's kernels), and Qwen3's per-head q/k RMSNorm.

The plain PyTorch form of a step is the engine's own layer loop (engine.model_runner.ModelRunner
.forward): the tests compare the two on the same quantized weights.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from quantkit.kernels import c_library
from quantkit.kernels.cpu_gemv import F32Gemv, Int4Gemv, Int8Gemv

SOURCES = (Path(__file__).with_name("cpu_decoder.c"), Path(__file__).with_name("cpu_gemv.c"))


class _Proj(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("G", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Stacked(ctypes.Structure):
    _fields_ = [("parts", ctypes.c_int32), ("part", _Proj * 3)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Stacked), ("o", _Proj),
                ("gate_up", _Stacked), ("down", _Proj), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Decoder(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
                ("layers", ctypes.POINTER(_Layer))]


Gemv = Union[Int4Gemv, Int8Gemv, F32Gemv]
Projection = tuple[Gemv, Optional[torch.Tensor]]  # a prepared kernel and the bias added after it (int4/int8)


@dataclass
class LayerWeights:
    """One layer as the C step reads it: norm weights (fp32 [hidden]; q/k norms [head_dim] or None) and the projections as prepared
    cpu_gemv kernels with their biases; q/k/v (and gate/up) one fused weight or several, whose
    outputs the step lays side by side."""
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: list[Projection]
    o: Projection
    gate_up: list[Projection]
    down: Projection
    q_norm: Optional[torch.Tensor] = None  # [head_dim]: per-head RMSNorm of q and k before rotary (Qwen3)
    k_norm: Optional[torch.Tensor] = None


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _proj(projection: Projection, keep: list) -> _Proj:
    gemv, bias = projection
    if isinstance(gemv, F32Gemv):
        if bias is not None:
            raise ValueError("an fp32 kernel carries its own bias")
        return _Proj(32, gemv.k, gemv.n, gemv.k, gemv.weight.data_ptr(), None, _ptr(gemv.bias))
    if bias is not None:
        bias = bias.detach().float().contiguous()
        if bias.shape != (gemv.n,):
            raise ValueError(f"bias of {tuple(bias.shape)} for a projection of {gemv.n} outputs")
        keep.append(bias)
    if isinstance(gemv, Int4Gemv):
        return _Proj(4, gemv.k, gemv.n, gemv.group_size, gemv.weight.data_ptr(), None, _ptr(bias))
    return _Proj(8, gemv.k, gemv.n, gemv.k, gemv.weight.data_ptr(), gemv.scale.data_ptr(), _ptr(bias))


def _stacked(projections: list[Projection], keep: list) -> _Stacked:
    if not 1 <= len(projections) <= 3:
        raise ValueError(f"a stacked projection has 1-3 parts, not {len(projections)}")
    parts = (_Proj * 3)(*[_proj(p, keep) for p in projections])
    return _Stacked(len(projections), parts)


class DecoderStack:
    """All layers' weights and K/V caches as the C step reads them, built once per engine.
    ``stack(x, positions, slots, tables, cos, sin_signed)`` runs x [R, hidden] fp32 through every layer."""

    def __init__(self, lib: ctypes.CDLL, layers: list[LayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]],
                 num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, eps: float, attn_scale: float,
                 threads_ok: bool):
        hidden, width = layers[0].qkv[0][0].k, (num_heads + 2 * num_kv_heads) * head_dim
        self.hidden, self.intermediate = hidden, layers[0].down[0].k
        self._keep: list = []  # every tensor and kernel whose memory the C structs point into
        c_layers = (_Layer * len(layers))()
        for i, (lw, (kc, vc)) in enumerate(zip(layers, caches)):
            shapes = {"qkv": (lw.qkv, hidden, width), "o": ([lw.o], num_heads * head_dim, hidden),
                      "gate_up": (lw.gate_up, hidden, 2 * self.intermediate), "down": ([lw.down], self.intermediate, hidden)}
            for name, (parts, k, n) in shapes.items():
                got = (parts[0][0].k, sum(g.n for g, _ in parts))
                if got != (k, n) or any(g.k != k for g, _ in parts):
                    raise ValueError(f"layer {i} {name}: {got[0]} -> {got[1]}, the step needs {k} -> {n}")
            if kc.dtype != torch.float32 or not kc.is_contiguous() or kc.shape[-2:] != (num_kv_heads, head_dim):
                raise ValueError(f"layer {i}: needs a contiguous fp32 cache [..., {num_kv_heads}, {head_dim}]")
            if (lw.q_norm is None) != (lw.k_norm is None) or \
                    any(n is not None and n.shape != (head_dim,) for n in (lw.q_norm, lw.k_norm)):
                raise ValueError(f"layer {i}: q and k norms come together, [{head_dim}] each")
            norms = [None if w is None else w.detach().float().contiguous()
                     for w in (lw.attn_norm, lw.mlp_norm, lw.q_norm, lw.k_norm)]
            self._keep += [*norms, kc, vc, lw]
            c_layers[i] = _Layer(*[_ptr(n) for n in norms], _stacked(lw.qkv, self._keep),
                                 _proj(lw.o, self._keep), _stacked(lw.gate_up, self._keep), _proj(lw.down, self._keep),
                                 kc.data_ptr(), vc.data_ptr())
        self._layers = c_layers
        self._model = _Decoder(len(layers), hidden, self.intermediate, num_heads, num_kv_heads, head_dim, block_size,
                               eps, attn_scale, c_layers)
        self.head_dim = head_dim
        self._fn = lib.quantkit_decoder_layers
        self._threads_ok = threads_ok

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] -> [R, hidden] after every layer (fp32). positions, slots [R] int64 (slot < 0:
        K/V not written); tables [R, W] int32, each row's sequence's block table; cos, sin_signed [R, head_dim]."""
        x = x.float().contiguous().clone()
        R = x.shape[0]
        positions, slots = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        tables = tables.to(torch.int32).contiguous()
        cos, sin_signed = cos.float().contiguous(), sin_signed.float().contiguous()
        if positions.shape != (R,) or slots.shape != (R,) or tables.shape[0] != R or \
                cos.shape != (R, self.head_dim) or sin_signed.shape != (R, self.head_dim):
            raise ValueError("decoder step: positions, slots, tables, cos and sin need one row per token")
        threads = torch.get_num_threads() if self._threads_ok else 1
        rc = self._fn(ctypes.byref(self._model), x.data_ptr(), R, positions.data_ptr(), slots.data_ptr(),
                      tables.data_ptr(), tables.shape[1], cos.data_ptr(), sin_signed.data_ptr(), threads)
        if rc != 0:
            raise MemoryError("CPU decoder step: scratch allocation failed")
        return x


class CpuDecoderKernel:
    """The compiled library, or why there is none (``problem``)."""

    def __init__(self, build_dir: Path):
        lib, self.problem, self.threads_ok = c_library.load(build_dir, "cpu_decoder", SOURCES)
        self.lib: Optional[ctypes.CDLL] = lib
        if lib is None:
            return
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.quantkit_decoder_layers.argtypes = [ctypes.POINTER(_Decoder), p, i64, p, p, p, i64, p, p, ctypes.c_int]
        lib.quantkit_decoder_layers.restype = ctypes.c_int

    def stack(self, layers: list[LayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
              num_kv_heads: int, head_dim: int, block_size: int, eps: float, attn_scale: float) -> DecoderStack:
        if self.lib is None:
            raise RuntimeError(f"the CPU decoder step is unavailable: {self.problem}")
        return DecoderStack(self.lib, layers, caches, num_heads, num_kv_heads, head_dim, block_size, eps, attn_scale,
                            self.threads_ok)
