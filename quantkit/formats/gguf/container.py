"""A strict, bounded GGUF parser: the first thing that touches a GGUF file quantkit is asked to read.

GGUF files are untrusted input. Before any tensor is decoded, this checks what llama.cpp's
gguf.cpp checks and a little more: the magic, version 2 or 3, every count and length against the
bytes actually left (so an absurd string or array length is refused, never allocated), at most 4
dimensions per tensor, every tensor type id one quantkit reads, alignment, and each tensor's
bytes lying inside the file without overlapping another. Anything wrong is one QuantkitError
naming the file and the problem. Values are read from an mmap; nothing is loaded whole.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.errors import QuantkitError
from quantkit.formats.gguf.types import TYPES_BY_ID, GGMLType

MAGIC = b"GGUF"
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# value type id -> (struct code, size); 8 = string, 9 = array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
            10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
MAX_ARRAY_DEPTH = 2


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (the contiguous dim) first
    type: GGMLType
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    _map: Any = None

    def raw(self, name: str) -> np.ndarray:
        """The bytes of one tensor (a read-only view of the mapping), uint8 [rows, row_bytes]."""
        ti = self.tensors[name]
        rows = int(np.prod(ti.shape[1:])) if len(ti.shape) > 1 else 1
        buf = np.frombuffer(self._map, dtype=np.uint8, count=ti.nbytes, offset=ti.offset)
        return buf.reshape(rows, ti.nbytes // rows)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view of a tensor: the mapping goes with it
                pass
            self._map = None


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str):
        raise QuantkitError(f"GGUF file {self.path} is malformed: {what} (at byte {self.pos}); re-export or re-download it")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            self.fail(f"needs {n} more bytes but only {len(self.buf) - self.pos} remain")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: str, size: int):
        return struct.unpack("<" + code, self.take(size))[0]

    def count(self, min_item_bytes: int, what: str) -> int:
        n = self.scalar("Q", 8)
        if n * max(1, min_item_bytes) > len(self.buf) - self.pos:
            self.fail(f"{what} {n} cannot fit in the {len(self.buf) - self.pos} bytes left")
        return n

    def string(self) -> str:
        n = self.count(1, "string length")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            self.fail("a string is not valid UTF-8")

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9 and depth < MAX_ARRAY_DEPTH:
            etype = self.scalar("I", 4)
            if etype not in _SCALARS and etype not in (8, 9):
                self.fail(f"unknown array element type {etype}")
            if etype in _SCALARS:
                code, size = _SCALARS[etype]
                n = self.count(size, "array length")
                return np.frombuffer(self.take(n * size), dtype=np.dtype("<" + code)).tolist()
            n = self.count(8, "array length")
            return [self.value(etype, depth + 1) for _ in range(n)]
        self.fail(f"unknown metadata value type {vtype}")


def read_gguf(path) -> GGUFFile:
    """Parse and validate the header, metadata and tensor table of a GGUF file (see module doc)."""
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    if size < 24:
        raise QuantkitError(f"GGUF file {path} is malformed: only {size} bytes, shorter than a GGUF header")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        out = _parse(_Cursor(mm, path), path)
    except BaseException:
        mm.close()
        raise
    out._map = mm
    return out


def _parse(c: _Cursor, path: Path) -> GGUFFile:
    if c.take(4) != MAGIC:
        raise QuantkitError(f"{path} is not a GGUF file (bad magic); pass a .gguf written by llama.cpp or quantkit")
    version = c.scalar("I", 4)
    if version not in (2, 3):
        raise QuantkitError(f"GGUF file {path} has version {version}; quantkit reads versions 2 and 3")
    n_tensors = c.count(8 + 4 + 8 + 4 + 8, "tensor count")
    n_kv = c.count(8 + 4, "metadata count")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in metadata:
            c.fail(f"duplicate metadata key {key!r}")
        metadata[key] = c.value(c.scalar("I", 4))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        c.fail(f"general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(c) for _ in range(n_tensors)]
    data_start = -(-c.pos // alignment) * alignment
    out = GGUFFile(path=path, version=version, metadata=metadata)
    spans = []
    for name, shape, t, rel in infos:
        if name in out.tensors:
            c.fail(f"duplicate tensor name {name!r}")
        if rel % alignment:
            c.fail(f"tensor {name!r} offset {rel} is not aligned to {alignment}")
        nbytes = t.row_bytes(shape[0]) * int(np.prod(shape[1:], dtype=np.int64))
        start = data_start + rel
        if start + nbytes > len(c.buf):
            c.fail(f"tensor {name!r} ({nbytes} bytes at {start}) runs past the end of the file ({len(c.buf)} bytes)")
        out.tensors[name] = TensorInfo(name, shape, t, start, nbytes)
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            c.fail(f"tensors {an!r} and {bn!r} overlap")
    return out


def foreign_type(type_id: int):
    """A ggml type quantkit does not write but the gguf package decodes (Q2_K, IQ4_XS, ...): read
    as floats through gguf.quants.dequantize. None for an id nobody knows."""
    import gguf

    try:
        gtype = gguf.GGMLQuantizationType(type_id)
        block, nbytes = gguf.GGML_QUANT_SIZES[gtype]
    except (ValueError, KeyError):
        return None
    return GGMLType(gtype.name, type_id, block, nbytes)


def _tensor_info(c: _Cursor):
    name = c.string()
    n_dims = c.scalar("I", 4)
    if not 1 <= n_dims <= MAX_DIMS:
        c.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
    shape = tuple(c.scalar("Q", 8) for _ in range(n_dims))
    if any(d < 1 for d in shape) or int(np.prod([float(d) for d in shape])) > len(c.buf) * 8:
        c.fail(f"tensor {name!r} has an impossible shape {list(shape)}")
    type_id = c.scalar("I", 4)
    t = TYPES_BY_ID.get(type_id) or foreign_type(type_id)
    if t is None:
        c.fail(f"tensor {name!r} has ggml type id {type_id}, which neither quantkit nor the gguf package knows")
    if shape[0] % t.block:
        c.fail(f"tensor {name!r} rows of {shape[0]} are not a multiple of the {t.name} block ({t.block})")
    offset = c.scalar("Q", 8)
    return name, shape, t, offset
