"""Calibrated FP8 KV-cache scales (`quantize --kv-cache-scheme fp8`), as compressed-tensors declares them
and vLLM reads them.

The keys and values an attention layer caches are observed on the run's calibration tokens: keys after
RoPE, values as projected, which is what a KV cache stores. Each layer keeps one running absolute
maximum per KV head (a streaming max: no activation is stored), and its scale is ``absmax / 448`` (the
e4m3 maximum), compressed-tensors' ``calculate_qparams`` for a symmetric 8-bit float.

Observed the way llm-compressor / compressed-tensors observe them (``modeling.kvcache``): a forward
pre-hook hands each attention module a stand-in cache whose ``update(key_states, value_states, ...)``
sees the states transformers' attention forward is about to cache, after RoPE. The same hook serves
`scripts/bench_kv_cache.py`, which fake-quantizes what the cache would hold.

Written as ``quantization_config.kv_cache_scheme`` (num_bits 8, type float, symmetric, static, strategy
``tensor`` or ``attn_head``) and tensors ``<layer>.self_attn.k_scale`` / ``v_scale``: shape ``[1]``
(tensor) or ``[num_kv_heads, 1, 1]`` (attn_head, compressed-tensors' shape), float32. vLLM maps them to
``self_attn.attn.k_scale``; per-head scales reach backends that take them, others (its CPU build) use
the largest head's.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.float_codecs import fp8

# --kv-cache-scheme NAME -> compressed-tensors strategy
KV_CACHE_SCHEMES = {"fp8": "tensor", "fp8-head": "attn_head"}
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # transformers 5.x, 4.5x, older


@dataclass(frozen=True)
class KVCacheScheme:
    """A static symmetric FP8 (e4m3) KV-cache scheme: one scale per layer (`tensor`) or per KV head
    (`attn_head`)."""

    strategy: str  # "tensor" or "attn_head"

    @property
    def name(self) -> str:
        return {v: k for k, v in KV_CACHE_SCHEMES.items()}[self.strategy]

    def config(self) -> dict:
        """compressed-tensors' QuantizationArgs for config.json's `kv_cache_scheme` (vLLM checks
        num_bits 8, type float, strategy tensor/attn_head, symmetric)."""
        return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": self.strategy,
                "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax"}


def parse_kv_cache_scheme(value) -> Optional[KVCacheScheme]:
    """`--kv-cache-scheme` -> KVCacheScheme (None when not given); one line naming the choices otherwise."""
    if value is None:
        return None
    key = str(value).strip().lower().replace("_", "-")
    if key not in KV_CACHE_SCHEMES:
        raise QuantkitError(f"--kv-cache-scheme {value!r} is not a KV-cache scheme; use fp8 (one scale per layer) "
                            "or fp8-head (one per KV head)")
    return KVCacheScheme(KV_CACHE_SCHEMES[key])


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each decoder layer's self-attention, in layer order: the module under the layer
    whose forward takes the KV cache."""
    from quantkit.models import get_adapter

    adapter = get_adapter(model)
    found = []
    for i, layer in enumerate(adapter.decoder_layers(model)):
        hits = [(n, m) for n, m in layer.named_modules() if n and _cache_kwarg(m) is not None]
        if not hits:
            raise QuantkitError(f"decoder layer {i} of {type(model).__name__} has no attention module taking a KV "
                                "cache; --kv-cache-scheme cannot observe its keys and values: drop it")
        name, module = hits[0]
        found.append((adapter.layer_name(model, i, name), module))
    return found


def _cache_kwarg(module: nn.Module) -> Optional[str]:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in _CACHE_KWARGS if k in params), None)


class _StateTap:
    """Stands in for the KV cache of one attention call: `update` hands the states to `fn` and returns
    what it gives back (the states themselves when it returns None), then what the real cache makes of
    them, if the call had one."""

    def __init__(self, index: int, fn, cache):
        self.index, self.fn, self.cache = index, fn, cache

    def update(self, key_states, value_states, *args, **kwargs):
        out = self.fn(self.index, key_states, value_states)
        if out is not None:
            key_states, value_states = out
        if self.cache is not None:
            return self.cache.update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def __getattr__(self, name):  # anything else a model asks of its cache
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


@contextlib.contextmanager
def tap_kv_states(model: nn.Module, fn: Callable) -> Iterator[list[str]]:
    """For the duration: ``fn(layer_index, key_states, value_states)`` sees each attention call's states
    [batch, kv_heads, tokens, head_dim] (keys after RoPE) before they are cached and attended over, and may
    return replacements. Yields the attention modules' names."""
    handles = []

    def pre_hook(index, kwarg):
        def hook(module, args, kwargs):
            cache = next((kwargs.pop(k) for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
            for k in _CACHE_KWARGS:
                kwargs.pop(k, None)
            kwargs[kwarg] = _StateTap(index, fn, cache)
            return args, kwargs
        return hook

    modules = attention_modules(model)
    try:
        for i, (_, module) in enumerate(modules):
            handles.append(module.register_forward_pre_hook(pre_hook(i, _cache_kwarg(module)), with_kwargs=True))
        yield [n for n, _ in modules]
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class KVScales:
    """Calibrated scales per layer: `k` and `v` float32 [layers, kv_heads] (``absmax / 448``), the
    attention modules' names, and the scheme they were calibrated for."""

    k: torch.Tensor
    v: torch.Tensor
    modules: tuple[str, ...]
    scheme: KVCacheScheme

    def tensors(self, rename: Callable[[str], str] = lambda n: n) -> dict[str, torch.Tensor]:
        """The checkpoint tensors: ``<attention>.k_scale`` / ``v_scale`` in compressed-tensors' shapes."""
        out = {}
        for i, name in enumerate(self.modules):
            for kind, scales in (("k", self.k[i]), ("v", self.v[i])):
                t = scales.amax().reshape(1) if self.scheme.strategy == "tensor" else scales.reshape(-1, 1, 1)
                out[f"{rename(name)}.{kind}_scale"] = t.float().contiguous().clone()
        return out


def observe_kv_absmax(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 8,
                      progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(key absmax, value absmax) float32 [layers, kv_heads] over `input_ids` [samples, seq_len] run through
    `model` `batch_size` rows at a time, and the attention modules' names."""
    kmax: dict[int, torch.Tensor] = {}
    vmax: dict[int, torch.Tensor] = {}

    def observe(i, k, v):
        for store, x in ((kmax, k), (vmax, v)):
            m = x.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
            store[i] = m if i not in store else torch.maximum(store[i], m)

    device = next(model.parameters()).device
    with tap_kv_states(model, observe) as names, torch.inference_mode():
        for start in range(0, input_ids.shape[0], batch_size):
            model(input_ids=input_ids[start:start + batch_size].to(device), use_cache=False)
            if progress:
                print(f"  kv-cache scales: {min(start + batch_size, input_ids.shape[0])}/{input_ids.shape[0]} "
                      "calibration sequences", flush=True)
    missing = [n for i, n in enumerate(names) if i not in kmax]
    if missing:
        raise QuantkitError(f"{missing[0]} never cached a key during calibration; --kv-cache-scheme cannot observe "
                            "this architecture: drop it")
    return torch.stack([kmax[i] for i in range(len(names))]), torch.stack([vmax[i] for i in range(len(names))]), names


def calibrate_kv_scales(model: nn.Module, input_ids: torch.Tensor, scheme: KVCacheScheme, batch_size: int = 8,
                        progress: bool = False) -> KVScales:
    """The scheme's scales from the keys and values `model` caches on `input_ids`."""
    if input_ids is None:
        raise QuantkitError("--kv-cache-scheme needs calibration tokens; give --dataset (default lee)")
    kmax, vmax, names = observe_kv_absmax(model, input_ids, batch_size, progress)
    # absmax / 448 as the FP8 weights' and inputs' scales are; an all-zero head gets their eps (any positive
    # scale is exact for zeros; vLLM wants > 0)
    return KVScales(k=fp8.scale_of_absmax(kmax), v=fp8.scale_of_absmax(vmax), modules=tuple(names), scheme=scheme)
