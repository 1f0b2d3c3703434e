"""Plain-PyTorch references for the quantized GEMM kernels.

They serve twice: as the CPU fallback (any device, no Triton needed) and as the oracle the Triton
kernels are tested against. They favour obviousness over speed: unpack everything, dequantize in
fp32, one matmul. Layouts follow GPTQ v1 (see the project's formats reference):

* ``qweight`` int32 ``[K / pf, N]``, packed along K (input dim), LSB first, ``pf = 32 // bits``;
* ``qzeros``  int32 ``[G, ceil(N / pf)]``, packed along N, LSB first, storing ``zero - 1`` (v1);
* ``scales``  fp16/bf16/fp32 ``[G, N]``;
* ``g_idx``   int ``[K]``, group of each input row.

Nothing here imports the rest of quantkit: the kernels package stands on torch (and triton) alone.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

SUPPORTED_BITS = (4, 8)


def _check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 32 // bits


def _shifts(bits: int, device) -> torch.Tensor:
    pf = 32 // bits
    return torch.arange(pf, device=device, dtype=torch.int32) * bits


def unpack_gptq_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``qweight [K/pf, N] int32`` -> integer codes ``[K, N] int32`` in ``[0, 2**bits)``.

    Word row ``r`` holds input rows ``r*pf .. r*pf+pf-1``, value ``j`` at bits ``bits*j``.
    The arithmetic right shift of negative words is harmless because we mask afterwards.
    """
    pf = _check_bits(bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    mask = (1 << bits) - 1
    codes = (qweight[:, None, :] >> _shifts(bits, qweight.device)[None, :, None]) & mask
    return codes.reshape(qweight.shape[0] * pf, qweight.shape[1])


def unpack_gptq_qzeros(qzeros: torch.Tensor, bits: int, n: Optional[int] = None) -> torch.Tensor:
    """``qzeros [G, N/pf] int32`` -> true zero points ``[G, N] int32`` (v1: stored + 1, masked).

    ``n`` trims the padding columns when N is not a multiple of the pack factor.
    """
    pf = _check_bits(bits)
    if qzeros.dtype != torch.int32 or qzeros.dim() != 2:
        raise ValueError(f"qzeros must be a 2-D int32 tensor, got {qzeros.dtype} {tuple(qzeros.shape)}")
    mask = (1 << bits) - 1
    z = (qzeros[:, :, None] >> _shifts(bits, qzeros.device)[None, None, :]) & mask
    z = z.reshape(qzeros.shape[0], qzeros.shape[1] * pf)
    if n is not None:
        z = z[:, :n]
    return (z + 1) & mask


def pack_gptq_qweight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_gptq_qweight`: codes ``[K, N]`` -> ``[K/pf, N] int32``.

    Used by tests and by :func:`prepare_act_order` (re-pack after reordering rows).
    """
    pf = _check_bits(bits)
    k, n = codes.shape
    if k % pf:
        raise ValueError(f"K={k} must be a multiple of the pack factor {pf} for {bits}-bit")
    c = codes.to(torch.int64).reshape(k // pf, pf, n) & ((1 << bits) - 1)
    word = (c << _shifts(bits, codes.device).to(torch.int64)[None, :, None]).sum(dim=1)
    # wrap to the signed int32 range (the top nibble may set the sign bit)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def pack_gptq_qzeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_gptq_qzeros`: true zeros ``[G, N]`` -> v1 words ``[G, ceil(N/pf)]``.

    Stores ``zero - 1`` masked to ``bits`` (so zero = 0 wraps, the historic v1 behaviour).
    """
    pf = _check_bits(bits)
    g, n = zeros.shape
    pad = (-n) % pf
    z = (zeros.to(torch.int64) - 1) & ((1 << bits) - 1)
    if pad:
        z = torch.cat([z, torch.zeros(g, pad, dtype=z.dtype, device=z.device)], dim=1)
    z = z.reshape(g, (n + pad) // pf, pf)
    word = (z << _shifts(bits, zeros.device).to(torch.int64)[None, None, :]).sum(dim=2)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def dequantize_gptq(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    g_idx: Optional[torch.Tensor],
    bits: int,
    group_size: Optional[int] = None,
) -> torch.Tensor:
    """Dense fp32 ``W [K, N]`` with ``W[k, n] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``.

    ``qzeros=None`` means symmetric with the implicit zero ``2**(bits-1)``. ``g_idx=None`` means
    contiguous groups ``k // group_size``; without ``group_size`` (None / <= 0) it is inferred
    from the number of scale rows (``K // G``; one row = per-channel).
    """
    q = unpack_gptq_qweight(qweight, bits)
    k, n = q.shape
    if g_idx is None:
        if group_size is None or group_size <= 0:
            if k % scales.shape[0]:
                raise ValueError(f"K={k} is not a multiple of the {scales.shape[0]} scale rows")
            group_size = k // scales.shape[0]
        g_idx = torch.arange(k, device=q.device) // int(group_size)
    g_idx = g_idx.to(device=q.device, dtype=torch.long)
    if qzeros is None:
        z = torch.full((scales.shape[0], n), 1 << (bits - 1), dtype=torch.int32, device=q.device)
    else:
        z = unpack_gptq_qzeros(qzeros, bits, n)
    return scales.float()[g_idx] * (q - z[g_idx]).float()


def w4a16_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    g_idx: Optional[torch.Tensor],
    bits: int = 4,
    group_size: Optional[int] = None,
) -> torch.Tensor:
    """``x [..., K] @ W`` for GPTQ-packed ``W`` (4- or 8-bit despite the name), fp32 math.

    Output has ``x.dtype``. This is the semantics :func:`dequant_gemm` must reproduce.
    """
    w = dequantize_gptq(qweight, scales, qzeros, g_idx, bits, group_size)
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has K={x.shape[-1]} but qweight unpacks to K={w.shape[0]}")
    return (x.float() @ w).to(x.dtype)


def w8a8_reference(
    x_int8: torch.Tensor,
    w_int8: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """W8A8: ``(x_int8 @ w_int8.T) * x_scale * w_scale + bias`` with exact integer accumulation.

    ``w_int8`` is ``[N, K]`` (the ``nn.Linear`` / compressed-tensors ``int-quantized`` layout).
    ``x_scale [M, 1]`` per token, ``w_scale [N]`` (or ``[N, 1]`` / ``[1, N]``) per channel.
    The integer product is done in int32 on CPU; CUDA has no integer matmul, so there it goes
    through fp64, which is exact for any realistic K (|sum| < 2**53).
    """
    if x_int8.dtype != torch.int8 or w_int8.dtype != torch.int8:
        raise ValueError("w8a8_reference expects int8 activations and weights")
    if x_int8.shape[-1] != w_int8.shape[1]:
        raise ValueError(f"K mismatch: x {tuple(x_int8.shape)} vs w [N, K] {tuple(w_int8.shape)}")
    if x_int8.device.type == "cpu":
        acc = (x_int8.to(torch.int32) @ w_int8.to(torch.int32).t()).float()
    else:
        acc = (x_int8.double() @ w_int8.double().t()).float()
    y = acc * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float().reshape(1, -1)
    return y.to(out_dtype)


def quantize_per_token_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic per-token int8: ``scale = absmax / 127``, ``q = round(x / scale)``.

    Rounds half to even (``torch.round``), clamps to ``[-128, 127]``. All-zero rows get scale 0
    and codes 0 (dividing by 1 instead of 0). Returns ``(x_int8 [M, K], scale fp32 [M, 1])``
    for ``x [..., K]`` flattened to ``M`` rows.
    """
    xf = x.reshape(-1, x.shape[-1]).float()
    scale = xf.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xf / safe).clamp_(-128, 127).to(torch.int8)
    return q, scale
