"""Models bigger than one device: accelerate's device map says where each decoder layer lives.

`--device-map auto` plans the placement with `accelerate.infer_auto_device_map` (GPUs first, then
host memory, then disk, within `--max-memory`), keeping every decoder layer whole. A layer placed
on a GPU is read onto that GPU once and calibrated there; one placed in host memory is read into
it and calibrated on `--device`; one placed on disk is not copied anywhere: it is streamed from the
model's own safetensors when the pipeline reaches it (quantkit.streaming), so host-RAM streaming
and the device map are one mechanism. A finished layer is dropped from wherever it lived (its
results are in the progress store).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from quantkit.errors import QuantkitError
from quantkit.streaming import LazyLayers

DISK = "disk"


def parse_max_memory(text: Optional[str]) -> Optional[dict[Union[int, str], str]]:
    """'0=70GiB,1=70GiB,cpu=200GiB' -> {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'} (accelerate's form)."""
    if not text:
        return None
    out: dict[Union[int, str], str] = {}
    for part in text.split(","):
        key, sep, size = part.partition("=")
        if not sep or not key.strip() or not size.strip():
            raise QuantkitError(f"--max-memory {text!r}: each entry is DEVICE=SIZE, e.g. 0=70GiB,cpu=200GiB")
        key = key.strip()
        out[int(key) if key.isdigit() else key] = size.strip()
    return out


def plan_layer_devices(model, adapter, max_memory, dtype: torch.dtype) -> list[Union[torch.device, str]]:
    """Each decoder layer's home (a device, or DISK) from accelerate's device map of the meta skeleton."""
    from accelerate import infer_auto_device_map

    layers = adapter.decoder_layers(model)
    no_split = sorted({type(layer).__name__ for layer in layers})
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    try:
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
                                           clean_result=False)
    except (ValueError, KeyError) as exc:
        raise QuantkitError(f"--device-map auto: {exc}; check --max-memory") from None
    prefix = adapter.layers_prefix(model)
    return [_home(device_map, f"{prefix}.{i}") for i in range(len(layers))]


def _home(device_map: dict, name: str) -> Union[torch.device, str]:
    """The device the map gives module `name` (its own entry or its closest listed ancestor)."""
    owners = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
    if not owners:
        inside = {v for k, v in device_map.items() if k.startswith(name + ".")}
        if len(inside) != 1:
            raise QuantkitError(f"--device-map auto split decoder layer {name} across {sorted(map(str, inside))}")
        value = inside.pop()
    else:
        value = device_map[max(owners, key=len)]
    if value == DISK:
        return DISK
    return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)


class PlacedLayers(LazyLayers):
    """The decoder layers where the device map put them: resident layers are read onto their
    device up front; layers placed on disk are read (into host memory) only while calibrated."""

    def __init__(self, model, folder: Path, layers_prefix: str, dtype: torch.dtype, homes: list):
        super().__init__(model, folder, layers_prefix, dtype)
        self.homes = homes
        for i, home in enumerate(homes):
            if home != DISK:
                self._read_layer(i, home)

    def materialize(self, index: int) -> None:
        if self.homes[index] == DISK or self._on_meta(index):  # streamed, or released and needed again
            self._read_layer(index, "cpu" if self.homes[index] == DISK else self.homes[index])

    def compute_device(self, index: int, default: torch.device) -> torch.device:
        """Where layer `index` is calibrated: the GPU that holds it, else the run's compute device."""
        home = self.homes[index]
        return home if isinstance(home, torch.device) and home.type != "cpu" else default

    def placement(self) -> dict[str, int]:
        """How many layers each home holds (for the run's summary)."""
        out: dict[str, int] = {}
        for home in self.homes:
            out[str(home)] = out.get(str(home), 0) + 1
        return out

    def _on_meta(self, index: int) -> bool:
        layer = self.model.get_submodule(f"{self.prefix}.{index}")
        return any(p.device.type == "meta" for p in layer.parameters())


def load_placed_model(folder: Path, dtype: torch.dtype, max_memory, trust_remote_code: bool = False):
    """A meta skeleton with the non-layer tensors in host memory and each decoder layer where
    accelerate's device map puts it; returns (model, PlacedLayers)."""
    from quantkit.models import get_adapter
    from quantkit.streaming import load_streaming_model

    model, lazy = load_streaming_model(folder, dtype, trust_remote_code)
    adapter = get_adapter(model)
    homes = plan_layer_devices(model, adapter, max_memory, dtype)
    return model, PlacedLayers(model, folder, lazy.prefix, dtype, homes)
