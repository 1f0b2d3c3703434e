"""`PackedBuffers`: the base of the runtime's checkpoint-holding linears (`QuantLinear`, `FloatLinear`).

Their buffers are a checkpoint's tensors verbatim (int32 words, float8 codes, fp16 or float32 scales), so
``model.to(torch.bfloat16)`` must move them without casting them: a cast would change the stored values.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class PackedBuffers(nn.Module):
    """An nn.Module whose `packed_buffer_names()` follow device moves but never dtype casts."""

    def packed_buffer_names(self) -> Iterable[str]:
        raise NotImplementedError

    def _apply(self, fn, *args, **kwargs):
        order = list(self._buffers)
        packed = {name: self._buffers.pop(name) for name in self.packed_buffer_names()}
        try:
            super()._apply(fn, *args, **kwargs)
        finally:  # fn applied to an empty tensor on a buffer's device says where fn moves it
            for name, t in packed.items():
                packed[name] = t.to(fn(torch.empty(0, device=t.device)).device)
            rest = dict(self._buffers)
            self._buffers.clear()
            self._buffers.update({name: packed[name] if name in packed else rest[name] for name in order})
        return self
