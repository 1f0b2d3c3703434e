"""A decoder layer's tensors while it is calibrated: moved to the compute device in the compute dtype,
written back or dropped afterwards, saved for resume and restored from a saved record."""
from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.progress import LayerRecord
from quantkit.qtensor import QuantizedWeight


def to_compute(layer: nn.Module, device, dtype: torch.dtype) -> dict:
    """Put the layer's tensors on `device`, floating ones in `dtype`, for its calibration; returns
    the stored tensors, which `write_back` fills in place afterwards. Writing into the tensors the
    model already had, instead of `layer.to()` allocating new ones, keeps a model held in bf16 from
    scattering freshly allocated long-lived weights over the heap layer after layer (RSS crept up
    by ~300 MB over the demo's 30 layers)."""
    stored = {}
    for module in layer.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    stored[(module, kind, name)] = t.data
                    t.data = t.data.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return stored


def write_back(layer: nn.Module, stored: dict) -> None:
    """The calibrated layer's values (fake-quantized weights, folded scales) back into its own storage."""
    with torch.no_grad():
        for (module, kind, name), original in stored.items():
            t = getattr(module, kind).get(name)
            if t is None or t.shape != original.shape:  # replaced by the quantizer: keep what it put there
                continue
            if t.data is not original:
                original.copy_(t.data)
                t.data = original


def release(stored: dict, policy) -> None:
    """Drop a finished layer's tensors (to the meta device) and page its weights out of memory.

    A model loaded from safetensors views the file's mapping, so writing the fake-quantized values
    back copied each layer's pages into anonymous memory, and merely reading them kept them resident:
    either way RSS grew by one layer's weights per layer. Once the layer's record is in the store
    nothing reads these tensors again."""
    from accelerate.utils import set_module_tensor_to_device

    originals = list(stored.values())
    for module, kind, name in stored:
        set_module_tensor_to_device(module, name, "meta")
    stored.clear()
    policy.page_out(originals)


def other_tensors(layer, layer_prefix: str, quantized: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Every tensor of the layer that is not a quantized linear's weight/bias (norms, ignored linears)."""
    skip = {f"{name[len(layer_prefix):]}.{t}" for name in quantized for t in ("weight", "bias")}
    return {layer_prefix + k: v.detach().cpu().clone() for k, v in layer.state_dict().items() if k not in skip}


def to_storage_dtype_(other: dict[str, torch.Tensor], linears: set[str], stored: dict) -> None:
    """`linears`' weights and biases in `other` cast, in place, to the layer's storage dtype (what
    `write_back` would give them) where the layer has one floating dtype; else they stay as they are."""
    dtypes = {t.dtype for t in stored.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        return
    dtype = dtypes.pop()
    for name in linears:
        for key in (f"{name}.weight", f"{name}.bias"):
            if key in other:
                other[key] = other[key].to(dtype)


def restore(layer, layer_prefix: str, record: LayerRecord) -> None:
    """Put a saved layer back: fake-quantized linears from their results, everything else as saved."""
    with torch.no_grad():
        for name, qw in record.quantized.items():
            m = layer.get_submodule(name[len(layer_prefix):])
            m.weight.data = qw.dequantize(m.weight.dtype).to(m.weight.device)
        state = {k[len(layer_prefix):]: v for k, v in record.other.items()}
        own = layer.state_dict()
        missing = [k for k in state if k not in own]
        if missing:
            raise QuantkitError(f"--resume: saved layer {record.index} does not match the model (tensor {missing[0]})")
        params = dict(layer.named_parameters())
        for k, v in state.items():
            target = params[k] if k in params else layer.get_buffer(k)
            target.data = v.to(device=target.device, dtype=target.dtype)


def check_finite(name: str, qw: QuantizedWeight) -> None:
    if not torch.isfinite(qw.scales).all():
        raise QuantkitError(f"quantizing {name} produced non-finite scales; the calibration data or weights contain NaN/inf")


def to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    return qw.to("cpu")


@torch.no_grad()
def digest(layer: nn.Module) -> torch.Tensor:
    """An exact fingerprint of every tensor of the layer: per tensor, the integer sum of its bits (an
    integer sum does not depend on its order), so replicas that differ in one bit differ here."""
    sums = []
    for _, t in sorted(layer.state_dict().items()):
        bits = t.detach().contiguous().reshape(-1)
        bits = bits.view(torch.uint8).to(torch.int64) if bits.element_size() == 1 or bits.numel() == 0 else bits.view(
            {2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
        sums.append(bits.sum(dtype=torch.int64).cpu())
    return torch.stack(sums) if sums else torch.zeros(1, dtype=torch.int64)
