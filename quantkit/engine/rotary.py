"""Rotary position embeddings, read from a transformers config the way transformers reads them.

Supported natively: ``default``, ``linear`` (positions divided by ``factor``) and ``llama3``
(Llama 3.1 frequency-dependent scaling). Other static types that transformers knows (``yarn``,
``longrope``, ...) take their inverse frequencies and attention factor from transformers'
``ROPE_INIT_FUNCTIONS``; ``dynamic`` NTK is evaluated at its base length, i.e. exact up to
``max_position_embeddings``.

A ``partial_rotary_factor`` below 1 (Phi-3.5/Phi-4-mini and others) rotates only the first
``rotary_dim`` channels of each head, as transformers does.

Config forms: transformers >= 5 ``config.rope_parameters = {"rope_type", "rope_theta", ...}``;
older ``config.rope_theta`` + ``config.rope_scaling = {"type"|"rope_type", ...}``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from quantkit.errors import QuantkitError


def rope_parameters(config) -> dict:
    """``{"rope_type", "rope_theta", ...}`` from either config form."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise QuantkitError("per-layer-type rope parameters are not supported by the engine")
    out: dict = {}
    if isinstance(params, dict) and params:
        out.update(params)
    else:
        scaling = getattr(config, "rope_scaling", None) or {}
        out.update(scaling)
    if "rope_theta" not in out:
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def default_inv_freq(theta: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_position_embeddings: int) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings") or max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotary position embedding: cos/sin per position (`cos_sin`, once per step for all layers) and the
    rotation of q and k as transformers' rotate_half layout defines it (`rotate`, `rotate_partial`)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0, head_dim: Optional[int] = None):
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(attention_scaling)
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.partial = head_dim is not None and self.rotary_dim < head_dim

    @classmethod
    def from_config(cls, config, device: Optional[torch.device] = None) -> "RotaryEmbedding":
        params = rope_parameters(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        dim = int(head_dim * factor)
        rope_type = params["rope_type"]
        theta = float(params["rope_theta"])
        inv_freq = default_inv_freq(theta, dim)
        scaling = 1.0
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, params, getattr(config, "max_position_embeddings", 8192))
        else:
            try:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                init = ROPE_INIT_FUNCTIONS[rope_type]
            except (ImportError, KeyError):
                raise QuantkitError(f"rope type {rope_type!r} is not supported by the engine") from None
            inv_freq, scaling = init(config, None)
        return cls(inv_freq.to(device) if device is not None else inv_freq, scaling, head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq  # the same fp32 ops as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    @staticmethod
    def signed_sin(sin: torch.Tensor) -> torch.Tensor:
        """``sin`` with its first half negated, for :meth:`rotate`."""
        half = sin.shape[-1] // 2
        return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` in four ops, bit for bit: ``rotate_half(x) * sin`` is
        ``cat(-x2 * s, x1 * s)`` = ``roll(x, D/2) * cat(-s, s)`` (a sign flip is exact). The engine
        rotates q and k of a fused projection as one tensor [N, H + KVH, D]; cos/sin_signed [N, 1, D]."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    def rotate_partial(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """:meth:`rotate` on the first ``rotary_dim`` channels of each head, the rest passed through."""
        if not self.partial:
            return self.rotate(x, cos, sin_signed)
        rd = self.rotary_dim
        return torch.cat((self.rotate(x[..., :rd], cos, sin_signed), x[..., rd:]), dim=-1)
