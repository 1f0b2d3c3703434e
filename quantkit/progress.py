"""Per-layer progress kept in the output's staging folder, so a crashed run can `--resume`.

After each decoder layer the driver's results are written here (atomically, one safetensors file
per layer): the QuantizedWeight of every quantized linear in canonical form, plus every other
tensor of the layer (norms that AWQ/SmoothQuant may have rescaled, ignored linears). The final
writer assembles the checkpoint from these records in both the whole-model and the streaming
path, so a resumed run writes byte-for-byte what an uninterrupted one would.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.qtensor import QuantizedWeight, TwoLevelScales

RUN_FILE = "run.json"
LAYER_DIR = "layers"
_QW_FIELDS = ("qweight", "scales", "zeros", "g_idx")
_TWO_LEVEL_FIELDS = ("d", "sc", "dmin", "m")


@dataclass
class LayerRecord:
    index: int
    quantized: dict[str, QuantizedWeight]  # full module name -> result (a float preset's: FloatResult)
    other: dict[str, torch.Tensor]  # full tensor name -> value (everything else in the layer)
    stats: dict[str, Any] = field(default_factory=dict)  # what the layer's calibration reports (MoE token counts)


class ProgressStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.fingerprint: Optional[dict[str, Any]] = None  # set by start

    # -- run identity ---------------------------------------------------------------------
    def start(self, fingerprint: dict[str, Any], resume: bool) -> None:
        """Create the staging folder, or (with resume) check it belongs to the same run."""
        run_file = self.folder / RUN_FILE
        self.check_leftover(resume)
        self.fingerprint = fingerprint
        if self.folder.exists():
            if not run_file.is_file():
                raise QuantkitError(f"{self.folder} holds no run.json, so it cannot be resumed; delete it to start over")
            saved = json.loads(run_file.read_text())
            if saved != _jsonable(fingerprint):
                diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != _jsonable(fingerprint).get(k))
                raise QuantkitError(f"--resume: {self.folder} was made with different settings ({', '.join(diff)}); "
                                    "use the original command or delete the folder")
            return
        (self.folder / LAYER_DIR).mkdir(parents=True)
        _atomic_write_bytes(run_file, (json.dumps(_jsonable(fingerprint), indent=2, sort_keys=True) + "\n").encode())

    def child(self, name: str) -> "ProgressStore":
        """A store of this run's for a calibration pass of its own (a float preset's SmoothQuant / AWQ pass
        before GPTQ), in a subfolder of this one: started with this run's fingerprint, so a resumed run
        continues it too."""
        if self.fingerprint is None:
            raise ValueError("start the store before making a child store")
        store = ProgressStore(self.folder / name)
        store.start(self.fingerprint, resume=True)
        return store

    def has_layers(self) -> bool:
        """Whether this store, or a child's, holds any finished layer (then the run is worth resuming)."""
        return any(self.folder.glob(f"**/{LAYER_DIR}/layer-*.safetensors"))

    def check_leftover(self, resume: bool) -> None:
        """A partial folder of an earlier run is never reused or deleted silently (called before any loading)."""
        if self.folder.exists() and not resume:
            raise QuantkitError(f"found the partial folder {self.folder} of an interrupted run; rerun the same command "
                                "with --resume to continue it, or delete the folder to start over")

    # -- layers ---------------------------------------------------------------------------
    def _path(self, index: int) -> Path:
        return self.folder / LAYER_DIR / f"layer-{index:05d}.safetensors"

    def done_layers(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in (self.folder / LAYER_DIR).glob("layer-*.safetensors"))

    def save_layer(self, record: LayerRecord) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for name, qw in record.quantized.items():
            if not isinstance(qw, QuantizedWeight):  # a float preset's result (quantkit.float_codecs.result)
                parts, meta[name] = qw.record()
                tensors.update({f"f::{name}::{k}": t for k, t in parts.items()})
                continue
            for f in _QW_FIELDS:
                tensors[f"q::{name}::{f}"] = getattr(qw, f).contiguous()
            if qw.bias is not None:
                tensors[f"q::{name}::bias"] = qw.bias.contiguous()
            meta[name] = {"bits": qw.bits, "group_size": qw.group_size, "sym": qw.sym, "act_order": qw.act_order}
            if qw.offsets is not None:
                tensors[f"q::{name}::offsets"] = qw.offsets.contiguous()
            if qw.two_level is not None:  # k-quant grid: its integers, the float scales follow from them
                tl = qw.two_level
                meta[name]["two_level_super"] = tl.super_size
                for f in _TWO_LEVEL_FIELDS:
                    if getattr(tl, f) is not None:
                        tensors[f"q::{name}::two_level_{f}"] = getattr(tl, f).contiguous()
            if qw.input_quant is not None:  # W8A8: the activation scheme, its static scale as a tensor
                meta[name]["input_quant"] = {k: v for k, v in qw.input_quant.items() if k != "scale"}
                if "scale" in qw.input_quant:
                    tensors[f"q::{name}::input_scale"] = qw.input_quant["scale"].detach().cpu().reshape(1).contiguous()
        for key, t in record.other.items():
            tensors[f"o::{key}"] = t.detach().contiguous()
        path = self._path(record.index)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.clone() for k, v in tensors.items()}, str(tmp),
                  metadata={"quantized": json.dumps(meta, sort_keys=True), "stats": json.dumps(record.stats, sort_keys=True)})
        os.replace(tmp, path)

    # -- the unquantized model's hidden states (recipes with reference inputs, e.g. GPTAQ) ----------
    def _reference_path(self, index: int) -> Path:
        return self.folder / LAYER_DIR / f"reference-{index:05d}.safetensors"

    def save_reference(self, index: int, hidden: list[torch.Tensor]) -> None:
        """The full-precision stream after layer `index` (saved before that layer's record, so a record
        always has it); only the newest is kept: resume needs just the one after the last done layer."""
        from safetensors.torch import save_file

        path = self._reference_path(index)
        tmp = path.with_suffix(".tmp")
        save_file({f"batch::{i:05d}": h.detach().cpu().contiguous() for i, h in enumerate(hidden)}, str(tmp))
        os.replace(tmp, path)
        for old in (self.folder / LAYER_DIR).glob("reference-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)

    def load_reference(self, index: int) -> Optional[list[torch.Tensor]]:
        path = self._reference_path(index)
        if not path.is_file():
            return None
        try:
            return reference_from_bytes(path.read_bytes())
        except Exception as exc:
            raise QuantkitError(f"--resume: reference record {path} is unreadable ({type(exc).__name__}); delete the "
                                "staging folder and start over") from None

    def load_layer(self, index: int) -> LayerRecord:
        from safetensors import safe_open

        path = self._path(index)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads(f.metadata()["quantized"])
                stats = json.loads(f.metadata().get("stats") or "{}")
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as exc:  # e.g. a record cut short by a power loss
            raise QuantkitError(f"--resume: progress record {path} is unreadable ({type(exc).__name__}); delete it "
                                "and resume again (that layer is then redone)") from None
        return _record(index, tensors, meta, stats)

    def layer_bytes(self, index: int) -> bytes:
        """The saved record as it is on disk (data-parallel ranks receive it from rank 0 so)."""
        path = self._path(index)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise QuantkitError(f"--resume: progress record {path} is unreadable ({type(exc).__name__}); delete it "
                                "and resume again (that layer is then redone)") from None

    def reference_bytes(self, index: int) -> Optional[bytes]:
        path = self._reference_path(index)
        return path.read_bytes() if path.is_file() else None


def record_from_bytes(index: int, data: bytes, where="the progress record") -> LayerRecord:
    """A `LayerRecord` from the bytes `save_layer` wrote (what data-parallel ranks receive from rank 0)."""
    from safetensors.torch import load

    try:
        tensors = load(data)
        metadata = _safetensors_metadata(data)
        meta, stats = json.loads(metadata["quantized"]), json.loads(metadata.get("stats") or "{}")
    except Exception as exc:  # e.g. a record cut short by a power loss
        raise QuantkitError(f"--resume: progress record {where} is unreadable ({type(exc).__name__}); delete it "
                            "and resume again (that layer is then redone)") from None
    return _record(index, tensors, meta, stats)


def _record(index: int, tensors: dict[str, torch.Tensor], meta: dict, stats: dict) -> LayerRecord:
    quantized: dict[str, dict] = {}
    floats: dict[str, dict] = {}
    other = {}
    for key, tensor in tensors.items():
        kind, rest = key.split("::", 1)
        if kind == "o":
            other[rest] = tensor
        else:
            name, field_name = rest.split("::", 1) if kind == "f" else rest.rsplit("::", 1)
            (floats if kind == "f" else quantized).setdefault(name, {})[field_name] = tensor
    qws = {}
    if floats:
        from quantkit.float_codecs.result import FloatResult

        qws.update({name: FloatResult.from_record(parts, meta[name]) for name, parts in floats.items()})
    for name, fields in quantized.items():
        info = dict(meta[name])
        if "input_scale" in fields:
            info["input_quant"] = {**info["input_quant"], "scale": fields.pop("input_scale")}
        if "two_level_super" in info:
            parts = {f: fields.pop(f"two_level_{f}", None) for f in _TWO_LEVEL_FIELDS}
            info["two_level"] = TwoLevelScales(super_size=info.pop("two_level_super"), **parts)
        qws[name] = QuantizedWeight(**fields, **info)
    return LayerRecord(index=index, quantized=qws, other=other, stats=stats)


def reference_from_bytes(data: bytes) -> list[torch.Tensor]:
    from safetensors.torch import load

    tensors = load(data)
    return [tensors[k] for k in sorted(tensors)]


def _safetensors_metadata(data: bytes) -> dict:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def run_fingerprint(**settings: Any) -> dict[str, Any]:
    return _jsonable(settings)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
