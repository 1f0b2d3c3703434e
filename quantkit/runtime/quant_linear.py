"""`QuantLinear`: an nn.Linear stand-in that holds a checkpoint's packed tensors verbatim.

Buffers are named exactly as the format stores them (``qweight``, ``weight_packed``, ...), so
``model.load_state_dict`` of checkpoint tensors fills them directly. The matmul backend is built
lazily from those buffers on the first forward (or an explicit ``prepare()``) and rebuilt after a
state-dict load, a device move or ``set_backend``; it reads bits only through ``format.unpack``.
"""
from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import LinearSpec, get_format
from quantkit.qtensor import QuantizedWeight
from quantkit.runtime import backends
from quantkit.runtime.packed_buffers import PackedBuffers


class QuantLinear(PackedBuffers):
    def __init__(self, spec: LinearSpec, format_name: str, bias: bool = False,
                 dtype: torch.dtype = torch.float16, backend: str = "auto"):
        super().__init__()
        self.spec = spec
        self.format_name = get_format(format_name).NAME
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.dtype = dtype
        self._packed_names = []
        defaults = self.format.default_tensors(spec)
        for name, (shape, buf_dtype) in self.format.packed_shapes(spec).items():
            init = defaults[name].to(buf_dtype) if name in defaults else torch.zeros(shape, dtype=buf_dtype)
            self.register_buffer(name, init)
            self._packed_names.append(name)
        if bias:
            self.register_buffer("bias", torch.zeros(spec.out_features, dtype=dtype))
        else:
            self.bias = None
        backends.resolve(backend, torch.device("cpu"))  # reject unknown names now
        self.backend = backend
        self._impl = None
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.invalidate())

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, format_name: str, dtype: torch.dtype = torch.float16,
                       backend: str = "auto") -> "QuantLinear":
        """Pack an in-memory QuantizedWeight through the format, as a checkpoint round trip would."""
        module = cls(LinearSpec.of(qw), format_name, bias=qw.bias is not None, dtype=dtype, backend=backend)
        packed = module.format.pack(qw)
        for name in module._packed_names:
            getattr(module, name).copy_(packed[name])
        if qw.bias is not None:
            module.bias.copy_(qw.bias)
        return module

    @property
    def format(self):
        """The layout module (looked up, not stored, so the layer deep-copies and pickles)."""
        return get_format(self.format_name)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._packed_names}

    def quantized_weight(self) -> QuantizedWeight:
        """The canonical weight these buffers encode (CPU tensors), bias included."""
        qw = self.format.unpack(self.packed_tensors(), self.spec)
        qw.bias = None if self.bias is None else self.bias.detach().cpu().clone()
        return qw

    @property
    def active_backend(self) -> str | None:
        return None if self._impl is None else self._impl.name

    def invalidate(self) -> None:
        self._impl = None

    def set_backend(self, name: str) -> None:
        """Switch backend; it is rebuilt on the next forward (buffers may not be loaded yet)."""
        backends.resolve(name, torch.device("cpu"))
        self.backend = name
        self.invalidate()

    def prepare(self) -> None:
        device = next(iter(self.packed_tensors().values())).device
        name = backends.resolve(self.backend, device)
        try:
            qw = self.format.unpack(self.packed_tensors(), self.spec)
        except QuantkitError as exc:
            source = getattr(self, "source", None)  # "file (module)", set by the loader
            if source is None:
                raise
            raise QuantkitError(f"{source}: {exc}") from None
        self._impl = backends.build(name, qw, device)

    def packed_buffer_names(self):
        return self._packed_names

    def _apply(self, fn, *args, **kwargs):
        """Device moves reach the packed buffers, dtype casts do not: ``model.to(torch.bfloat16)``
        must not round fp16 scales (the checkpoint's exact values). The prepared backend is dropped."""
        self.invalidate()
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._impl is None:
            self.prepare()
        if x.shape[-1] != self.in_features:
            raise QuantkitError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        y = self._impl(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def backend_impl(self):
        """The prepared backend object (built now if needed): for callers that run its kernels
        themselves, e.g. the engine's C decode step reading ``decode_gemv``."""
        if self._impl is None:
            self.prepare()
        return self._impl

    def matmul_fn(self, dtype: torch.dtype):
        """This layer as a plain callable ``x [M, in] -> [M, out]`` (activations in `dtype`), the
        backend's cheapest entry when it has one; exactly what ``forward`` computes. Resolved now:
        a later device move or ``set_backend`` needs a new one."""
        if self._impl is None:
            self.prepare()
        return backends.matmul_fn(self._impl, dtype, self.bias)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"in_features={s.in_features}, out_features={s.out_features}, bits={s.bits}, "
                f"group_size={s.group_size}, sym={s.sym}, act_order={s.act_order}, "
                + (f"input_quant={s.input_quant}, " if s.input_quant else "") +
                f"format={self.format.NAME}, backend={self.backend}, bias={self.bias is not None}")
