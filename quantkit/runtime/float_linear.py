"""`FloatLinear`: an nn.Linear stand-in for one linear of a compressed-tensors float checkpoint (FP8, NVFP4, MXFP4).

Its buffers are the checkpoint's tensors under their own names and dtypes (``weight`` float8_e4m3fn +
``weight_scale``; ``weight_packed`` + ``weight_scale`` [+ ``weight_global_scale``]; ``input_scale`` /
``input_global_scale`` where the activations are static), so the state dict loads into it verbatim. The
forward is the reference path: the weight dequantized once through the layout module (float32, cached per
compute dtype), the input fake-quantized as the preset's activations are (`float_codecs.activations`), then a
dense matmul. No fast kernel: on CPU this is how the float presets run.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.float_codecs import activations
from quantkit.runtime.packed_buffers import PackedBuffers
from quantkit.scheme_presets import QuantArgs


class FloatLinear(PackedBuffers):
    def __init__(self, layout: ModuleType, weights: QuantArgs, input_activations: Optional[QuantArgs],
                 in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.layout, self.weights, self.input_activations = layout, weights, input_activations
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.packed_shapes = dict(layout.packed_shapes((out_features, in_features), weights))
        self.input_tensor = activations.check_supported(input_activations) if input_activations else None
        if self.input_tensor is not None:
            self.packed_shapes[self.input_tensor] = ((1,), torch.float32)
        for name, (shape, buf_dtype) in self.packed_shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=buf_dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.source = None  # "file (module)", set by the loader for error messages
        self._weight_cache: dict[torch.dtype, torch.Tensor] = {}
        self.register_load_state_dict_post_hook(lambda module, incompatible: module._weight_cache.clear())

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the checkpoint encodes, [out, in] in `dtype` (cached)."""
        w = self._weight_cache.get(dtype)
        if w is None:
            tensors = {name: getattr(self, name) for name in self.packed_shapes}
            try:
                w32 = self.layout.read(tensors, (self.out_features, self.in_features), self.weights).dequantize()
            except QuantkitError as exc:
                raise QuantkitError(f"{self.source}: {exc}" if self.source else str(exc)) from None
            w = self._weight_cache[dtype] = w32.to(dtype)
        return w

    def packed_buffer_names(self):
        return self.packed_shapes

    def _apply(self, fn, *args, **kwargs):
        """Device moves reach the checkpoint's tensors, dtype casts do not (``model.to(torch.bfloat16)`` must
        not turn float8 codes or float32 scales into something else); the cached weight is dropped."""
        self._weight_cache.clear()
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise QuantkitError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        if self.input_activations is not None:
            scale = getattr(self, self.input_tensor) if self.input_tensor else None
            x = activations.fake_quantize(x, self.input_activations, scale)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        acts = self.input_activations
        return (f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout.FORMAT}, "
                f"weights={self.weights.kind}{self.weights.bits} {self.weights.strategy}, "
                f"activations={'none' if acts is None else f'{acts.kind}{acts.bits} {acts.strategy}'}, "
                f"bias={self.bias is not None}")
