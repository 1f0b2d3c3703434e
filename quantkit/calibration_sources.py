"""Any calibration container -> the token rows a run calibrates on, with a description and a hash.

Accepted sources (``quantkit.quantize(dataset=...)``):
  - text: a dataset name or file path, a list of strings, a list of chat conversations (each a list
    of ``{"role", "content"}`` messages, rendered with the tokenizer's chat template), a list of
    ``{"text"}`` / ``{"messages"}`` records, a ``datasets.Dataset`` with a ``text`` or ``messages``
    column. Text is tokenized and cut into windows by ``quantkit.data.calibration_batches``
    (defaults 128 x 512, seeded document order).
  - token ids: a ``datasets.Dataset`` with an ``input_ids`` column (it wins over ``text``), a tensor
    ``[T]`` or ``[B, T]``, a ``{"input_ids": ...}`` mapping (a tokenizer's ``BatchEncoding``), or a
    list, torch ``DataLoader`` or any iterable of such tensors, mappings or lists of ints, batched or
    not. A batch's ``attention_mask``, when given, removes its padding: only real tokens calibrate.

Token rows are used as given when they all have one length and neither ``num_samples`` nor
``seq_len`` is set: ``[rows, length]``, in order. Otherwise (ragged rows, or a shape asked for)
the rows are packed: joined end to end in order, with no separator, and cut into windows of
``seq_len`` tokens (default: the longest row); the tail shorter than a window is dropped, and
``num_samples`` windows (default: all) are picked with a seeded draw kept in stream order.
quantkit's calibration pipeline runs whole windows without padding masks, which is why ragged rows
are packed rather than padded.

The result depends only on the token rows (and the settings), never on the container that carried
them: a DataLoader of ``{"input_ids"}`` batches and a list of the same rows give the same tensor,
hence the same checkpoint, and the same ``sha256`` recorded on the model card.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.utils.data

from quantkit.errors import QuantkitError

ACCEPTED = ("a dataset name or file, a list of strings or chat conversations, a datasets.Dataset (text, messages "
            "or input_ids column), or token ids: tensors, {'input_ids': ...} dicts, or a DataLoader/iterable of them")


@dataclass(frozen=True)
class CalibrationTokens:
    """The calibration token rows ``input_ids`` (int64 ``[num_samples, seq_len]``) and where they came from."""

    input_ids: torch.Tensor
    source: str  # for the model card: "lee", "DataLoader: 8 token rows as given", ...

    @property
    def sha256(self) -> str:
        return tokens_sha256(self.input_ids)


def tokens_sha256(input_ids: torch.Tensor) -> str:
    """SHA-256 of the tokens as contiguous little-endian int64: the identity of a calibration set."""
    return hashlib.sha256(input_ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def calibration_tokens(source: Any, tokenizer, *, num_samples: Optional[int] = None, seq_len: Optional[int] = None,
                       seed: int = 0, chat_template: bool = False) -> CalibrationTokens:
    """The calibration rows of any accepted ``source`` (see the module docstring). ``num_samples`` and
    ``seq_len`` are the caller's explicit choices (None: not given); text sources fill in the defaults."""
    from quantkit import data
    from quantkit.plan import CALIBRATION_DEFAULTS

    kind, value, label = _classify(source)
    if kind == "text":
        ids = data.calibration_batches(value, tokenizer, seed=seed, chat_template=chat_template,
                                       num_samples=num_samples or CALIBRATION_DEFAULTS["num_samples"],
                                       seq_len=seq_len or CALIBRATION_DEFAULTS["seq_len"])
        return CalibrationTokens(ids, label)
    return _shape_rows(value, label, num_samples, seq_len, seed)


def check_vocabulary(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse token ids the model's embedding has no row for (they would fail deep inside the forward)."""
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise QuantkitError(f"calibration token id {bad} is outside the model's vocabulary (0..{vocab_size - 1}); "
                            "tokenize the calibration data with this model's tokenizer")


# ----------------------------------------------------------------------------- what the source is


def _classify(source: Any) -> tuple[str, Any, str]:
    """("text", a source quantkit.data reads, label) or ("tokens", list of 1-D int64 rows, label)."""
    import datasets

    if isinstance(source, (str, Path)):
        return "text", source, str(source)
    if isinstance(source, datasets.DatasetDict):
        raise QuantkitError(f"pass one split of the DatasetDict (it has {', '.join(source)}), e.g. ds['train']")
    if isinstance(source, datasets.Dataset):
        if "input_ids" in source.column_names:
            masks = list(source["attention_mask"]) if "attention_mask" in source.column_names else None
            rows = _mapping_rows({"input_ids": list(source["input_ids"]), "attention_mask": masks}, "the Dataset")
            return "tokens", rows, f"Dataset ({source.num_rows} rows, input_ids column)"
        return "text", source, f"Dataset ({source.num_rows} rows)"
    if isinstance(source, (torch.Tensor, Mapping)):
        return "tokens", _rows_of(source, "the given tensor"), type(source).__name__
    if not isinstance(source, Iterable) or isinstance(source, (bytes, bytearray)):
        raise QuantkitError(f"unsupported dataset of type {type(source).__name__}; pass {ACCEPTED}")
    items = list(source)  # a list as it is; a DataLoader's batches, a generator's items
    name = f"{type(source).__name__} of {len(items)}"
    if not items:
        raise QuantkitError(f"the given {type(source).__name__} of calibration data is empty; pass some data")
    if all(isinstance(i, str) or _is_conversation(i) for i in items):
        chats = sum(not isinstance(i, str) for i in items)
        what = "texts" if not chats else "chat conversations" if chats == len(items) else "texts and conversations"
        return "text", items, f"{name} {what}"
    if all(isinstance(i, Mapping) and "input_ids" not in i and ({"text", "messages"} & set(i)) for i in items):
        return "text", datasets.Dataset.from_list([dict(i) for i in items]), f"{name} records"
    rows = [row for i, item in enumerate(items) for row in _rows_of(item, f"item {i}")]
    return "tokens", rows, f"{name} {'batches' if isinstance(source, torch.utils.data.DataLoader) else 'items'}"


def _is_conversation(item: Any) -> bool:
    return (isinstance(item, (list, tuple)) and len(item) > 0
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in item))


# ----------------------------------------------------------------------------- token rows


def _rows_of(item: Any, where: str) -> list[torch.Tensor]:
    """One item of a token container (tensor, mapping, list) as 1-D int64 rows."""
    if isinstance(item, Mapping):
        return _mapping_rows(item, where)
    if isinstance(item, (list, tuple)) and item and all(isinstance(x, torch.Tensor) for x in item):
        if len(item) > 1:
            raise QuantkitError(f"{where} is a group of {len(item)} tensors (input_ids and labels?), which is "
                                "ambiguous; yield the input_ids alone or as {'input_ids': ...}")
        return [row for x in item for row in _as_rows(x, where)]
    return _as_rows(item, where)


def _mapping_rows(item: Mapping, where: str) -> list[torch.Tensor]:
    if "input_ids" not in item:
        raise QuantkitError(f"{where} has no 'input_ids' (it has {', '.join(map(str, item)) or 'nothing'}); pass "
                            "{'input_ids': ...} batches, or text")
    rows = _as_rows(item["input_ids"], where)
    if item.get("attention_mask") is None:
        return rows
    masks = _as_rows(item["attention_mask"], f"{where}'s attention_mask", mask=True)
    if [m.shape for m in masks] != [r.shape for r in rows]:
        raise QuantkitError(f"{where}: attention_mask and input_ids differ in shape; pass the tokenizer's own pair")
    return [r[m != 0] for r, m in zip(rows, masks)]  # padding removed: only real tokens calibrate


def _as_rows(value: Any, where: str, mask: bool = False) -> list[torch.Tensor]:
    """A tensor / array / list of ints / list of such rows as 1-D int64 rows (an attention mask, `mask`,
    may also hold bools or floats: nonzero is a real token)."""
    if isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple, torch.Tensor)) for v in value):  # a batch of rows
            return [row for v in value for row in _as_rows(v, where, mask)]
        numbers = (int, float) if mask else int
        if not all(isinstance(v, numbers) and (mask or not isinstance(v, bool)) for v in value):
            raise QuantkitError(f"{where} is not token ids: a list must hold ints (one row) or rows; got "
                                f"{type(next((v for v in value if not isinstance(v, int)), value)).__name__}")
        t = torch.tensor(list(value), dtype=None if mask else torch.int64)
    elif hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        import numpy as np

        t = torch.from_numpy(np.asarray(value))
    else:
        raise QuantkitError(f"{where} is a {type(value).__name__}, not token ids; pass {ACCEPTED}")
    if mask:
        t = t != 0
    elif t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise QuantkitError(f"{where} holds {t.dtype} values; token ids must be integers (a LongTensor)")
    if t.dim() not in (1, 2):
        raise QuantkitError(f"{where} has shape {list(t.shape)}; token ids come as [seq_len] or [batch, seq_len]")
    t = t.detach().to("cpu", torch.int64)
    return [t] if t.dim() == 1 else list(t.unbind(0))


def _shape_rows(rows: list[torch.Tensor], label: str, num_samples: Optional[int], seq_len: Optional[int],
                seed: int) -> CalibrationTokens:
    """As given when the rows are uniform and no shape is asked for; else packed (module docstring)."""
    from quantkit import data

    rows = [r for r in rows if r.numel() > 0]
    if not rows:
        raise QuantkitError(f"the calibration token rows ({label}) are empty; pass non-empty input_ids")
    lengths = {int(r.numel()) for r in rows}
    if num_samples is None and seq_len is None and len(lengths) == 1:
        ids = torch.stack(rows)
        return CalibrationTokens(ids, f"{label}: {len(rows)} token rows as given [{ids.shape[0]} x {ids.shape[1]}]")
    window = seq_len if seq_len is not None else max(lengths)
    if window < 2:
        raise QuantkitError("token rows of one token cannot calibrate; pass rows of at least 2 tokens or seq_len >= 2")
    available = sum(int(r.numel()) for r in rows) // window
    count = num_samples if num_samples is not None else max(available, 1)  # 0 windows: the too-few error
    ids = data.calibration_batches(rows, None, num_samples=count, seq_len=window, seed=seed)
    ragged = f"{min(lengths)}..{max(lengths)} tokens" if len(lengths) > 1 else f"{max(lengths)} tokens"
    return CalibrationTokens(ids, f"{label}: {len(rows)} token rows ({ragged}) packed into {ids.shape[0]} "
                                  f"windows of {window}, seed {seed}")
