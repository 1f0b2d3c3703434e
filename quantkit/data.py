"""Calibration and evaluation text: named datasets, local files, or in-memory data, as tokens.

A *source* is one of:
  - a registry name (``lee``, ``wiki``, ``wikitext2``, ``c4``, ``pileval``, ``ultrachat``; see
    ``calibration_data/registry.yaml``),
  - a local file: ``.txt``/``.cor`` (each non-empty line is a document), ``.jsonl``/``.json``/
    ``.parquet`` with a ``text`` or ``messages`` field (optionally ``.gz``/``.zst``/... compressed),
  - a list of strings or chat conversations (lists of ``{role, content}`` messages), a
    ``datasets.Dataset`` with a ``text``/``messages`` field,
  - token ids: a 2-D LongTensor ``[n, seq_len]`` or a list of 1-D LongTensors.

Other containers (DataLoaders, ``{"input_ids"}`` batches, tokenized Datasets) are turned into one
of these by ``quantkit.calibration_sources``, the single entry point of ``quantkit.quantize``.

Named datasets and local files have two disjoint splits, ``calibration`` and ``eval``; a single
local file is split by documents, the first 80 % calibrating and the last 20 % held out (``lee``:
90/10, see the registry), and held-out documents that repeat a calibration document are dropped,
so perplexity is never measured on calibrated text (``split="all"`` takes the whole file).
``wiki`` is split by article (see ``quantkit.wiki``).
In-memory sources are used as given: the caller already chose the data.
"""
from __future__ import annotations

import functools
import importlib.resources
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Sequence

import yaml

from quantkit.errors import QuantkitError

SPLITS = ("calibration", "eval")
LOCAL_SPLITS = {"calibration": "train[:80%]", "eval": "train[80%:]", "all": "train"}
_BUILDERS = {".txt": "text", ".cor": "text", ".text": "text", ".jsonl": "json", ".json": "json",
             ".parquet": "parquet"}
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
_HUB_HINT = "use --dataset lee or --dataset wiki (offline) or a local .txt/.jsonl/.parquet file"


@dataclass(frozen=True)
class SplitSpec:
    """One split of a named dataset, as handed to ``datasets.load_dataset``."""

    split: str
    data_files: str | None = None
    keep_empty: bool = False


@dataclass(frozen=True)
class DatasetSpec:
    """A registry entry: where the documents live and which splits calibrate / evaluate."""

    name: str
    description: str
    field: str
    calibration: SplitSpec
    eval: SplitSpec
    path: str | None = None
    config_name: str | None = None
    local: str | None = None

    @property
    def offline(self) -> bool:
        return self.local is not None


@functools.lru_cache(maxsize=None)
def registry() -> dict[str, DatasetSpec]:
    """All named datasets, read from the packaged ``registry.yaml``."""
    text = (importlib.resources.files("quantkit.calibration_data") / "registry.yaml").read_text("utf-8")
    specs = {}
    for name, e in yaml.safe_load(text).items():
        specs[name] = DatasetSpec(
            name=name, description=e.get("description", ""), field=e["field"],
            calibration=SplitSpec(**e["calibration"]), eval=SplitSpec(**e["eval"]),
            path=e.get("path"), config_name=e.get("name"), local=e.get("local"),
        )
    return specs


def dataset_spec(name: str) -> DatasetSpec:
    """The registry entry for ``name``, or a QuantkitError listing the known names."""
    try:
        return registry()[name]
    except KeyError:
        raise QuantkitError(
            f"unknown dataset {name!r}; use one of {', '.join(registry())} or a local "
            f".txt/.cor/.jsonl/.json/.parquet file"
        ) from None


# ----------------------------------------------------------------------------- documents


@dataclass
class _Docs:
    """One split's documents, rendered to text only when read: a hub split is never materialized whole."""

    label: str  # for messages: "dataset 'lee' (calibration split)", "the given list of 3 texts", ...
    rows: Any  # a datasets.Dataset or a list
    field: str | None  # column of a Dataset; None for a list
    keep_empty: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    def values(self, indices: Sequence[int]) -> list:
        if self.field is None:
            return [self.rows[i] for i in indices]
        return list(self.rows[list(indices)][self.field])


def _check_split(split: str, allowed: Sequence[str]) -> None:
    if split not in allowed:
        raise QuantkitError(f"unknown split {split!r}; use one of {', '.join(allowed)}")


def _datasets():
    import datasets

    return datasets


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__


def _local_cache() -> str:
    # Arrow caches of local files go to the quantkit cache: never next to the data or into a repo.
    from quantkit.assets import cache_dir

    return str(cache_dir() / "datasets")


def _load_local(path: Path, split_expr: str, label: str):
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    builder = _BUILDERS.get(suffixes[-1] if suffixes else "")
    if builder is None:
        raise QuantkitError(
            f"unsupported dataset file type {path.name!r}; use .txt, .cor, .jsonl, .json or .parquet"
        )
    if path.stat().st_size == 0:
        raise QuantkitError(f"{label} is empty: {path} has no content; pass a file with text in it")
    try:
        return _datasets().load_dataset(builder, data_files=str(path), split=split_expr, cache_dir=_local_cache())
    except ValueError as e:
        if "corresponds to no data" in str(e):  # e.g. the eval 20 % of a 1-document file
            raise QuantkitError(
                f"{label} is empty: {path.name} has too few documents to split 80/20; add documents or use split 'all'"
            ) from None
        raise QuantkitError(f"could not read {path} as {builder} ({_short(e)}); fix the file") from e
    except Exception as e:
        raise QuantkitError(f"could not read {path} as {builder} ({_short(e)}); fix the file") from e


def _held_out(path: Path, eval_expr: str, calibration_expr: str, label: str):
    """The eval split of a file split by documents, minus any document also in its calibration split:
    corpora repeat documents (lee_background.cor holds 7 twice), and a repeat that straddles the
    split would put calibrated text into the perplexity."""
    import json

    ev = _load_local(path, eval_expr, label)
    cal = _load_local(path, calibration_expr, label)
    key = functools.partial(json.dumps, sort_keys=True, default=str)
    seen = {key(row) for row in cal}
    keep = [i for i, row in enumerate(ev) if key(row) not in seen]
    return ev if len(keep) == len(ev) else ev.select(keep)


def _pick_field(ds, label: str, chat_template: bool) -> str:
    cols = ds.column_names
    if "messages" in cols and ("text" not in cols or chat_template):
        return "messages"
    if "text" in cols:
        return "text"
    raise QuantkitError(f"{label} has no 'text' or 'messages' field (it has {', '.join(cols)}); rename the column")


def _resolve(source, split: str, chat_template: bool) -> _Docs:
    datasets = _datasets()
    if isinstance(source, datasets.DatasetDict):
        raise QuantkitError(f"pass one split of the DatasetDict (it has {', '.join(source)}), e.g. ds['train']")
    if isinstance(source, datasets.Dataset):
        return _Docs("the given Dataset", source, _pick_field(source, "the given Dataset", chat_template))
    if isinstance(source, (list, tuple)) and all(isinstance(s, str) for s in source):
        return _Docs(f"the given list of {len(source)} texts", list(source), None)
    if isinstance(source, (list, tuple)) and all(isinstance(s, (str, list, tuple)) for s in source):
        # chat conversations (lists of {role, content} messages), maybe mixed with texts: _render checks them
        return _Docs(f"the given list of {len(source)} documents", list(source), None)
    if isinstance(source, str) and source in registry():
        return _resolve_named(registry()[source], split)
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_file():
            if path.suffix or len(path.parts) > 1:
                raise QuantkitError(f"dataset file {str(source)!r} not found; check the path")
            dataset_spec(str(source))  # raises: not a name either
        _check_split(split, list(LOCAL_SPLITS))
        label = f"dataset '{path.name}' ({split} split)"
        if split == "eval":
            ds = _held_out(path, LOCAL_SPLITS["eval"], LOCAL_SPLITS["calibration"], label)
        else:
            ds = _load_local(path, LOCAL_SPLITS[split], label)
        return _Docs(label, ds, _pick_field(ds, label, chat_template))
    raise QuantkitError(
        f"unsupported dataset source of type {type(source).__name__}; pass a dataset name, a file path, "
        f"a list of strings, a datasets.Dataset or token-id tensors"
    )


def _resolve_named(spec: DatasetSpec, split: str) -> _Docs:
    label = f"dataset '{spec.name}' ({split} split)"
    if spec.local is not None:
        _check_split(split, [*SPLITS, "all"])
    if spec.local == "wiki":
        return _wiki_docs(spec, split, label)
    if spec.local == "lee":
        ds, part = _lee_rows(spec, split, label)
    else:
        _check_split(split, SPLITS)
        part = getattr(spec, split)
        ds = _hub_rows(spec, part)
    if spec.field not in ds.column_names:
        raise QuantkitError(f"{label} has no {spec.field!r} field; the registry entry is out of date")
    return _Docs(label, ds, spec.field, keep_empty=part.keep_empty)


def _lee_rows(spec: DatasetSpec, split: str, label: str):
    from quantkit.assets import lee_corpus_path

    part = SplitSpec("train") if split == "all" else getattr(spec, split)
    if split == "eval":
        return _held_out(lee_corpus_path(), part.split, spec.calibration.split, label), part
    return _load_local(lee_corpus_path(), part.split, label), part


def _wiki_docs(spec: DatasetSpec, split: str, label: str) -> _Docs:
    """Whole articles; the registry's split names are the article splits of ``quantkit.wiki``."""
    from quantkit.wiki import wiki_articles

    wanted = {spec.calibration.split, spec.eval.split} if split == "all" else {getattr(spec, split).split}
    return _Docs(label, [a.text for a in wiki_articles() if a.split in wanted], None)


def _hub_rows(spec: DatasetSpec, part: SplitSpec):
    kwargs: dict[str, Any] = {"split": part.split}
    if part.data_files:
        kwargs["data_files"] = {part.split.split("[")[0]: part.data_files}
    args = (spec.path, spec.config_name) if spec.config_name else (spec.path,)
    try:
        return _datasets().load_dataset(*args, **kwargs)
    except Exception as e:
        raise QuantkitError(
            f"dataset '{spec.name}' needs the Hugging Face Hub ({spec.path}) and could not be loaded "
            f"({_short(e)}); {_HUB_HINT}"
        ) from e


def _chat(messages, tokenizer, required: bool) -> str:
    try:
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    except (TypeError, KeyError):
        raise QuantkitError("chat messages must be lists of {role, content} objects; fix the 'messages' field") from None
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    if required:
        raise QuantkitError("chat_template=True but the tokenizer has no chat template; drop --chat-template")
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs)


def _render(value, tokenizer, chat_template: bool) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        # Plain text under a chat template becomes one user turn: the activations an instruct
        # model sees at inference.
        return _chat([{"role": "user", "content": value}], tokenizer, True) if chat_template else value
    if isinstance(value, (list, tuple)):
        return _chat(value, tokenizer, False)
    raise QuantkitError(f"documents must be strings or chat message lists, got {type(value).__name__}")


def _is_empty(text: str) -> bool:
    return not text.strip()


def _token_rows(source) -> list | None:
    """Token-id sources as a list of 1-D LongTensors, or None when the source is text."""
    import torch

    if isinstance(source, torch.Tensor):
        rows = [source.reshape(-1)] if source.dim() else None  # rows of [n, seq_len] are consecutive
    elif isinstance(source, (list, tuple)) and source and all(isinstance(t, torch.Tensor) for t in source):
        rows = [t.reshape(-1) for t in source]
    else:
        return None
    if rows is None or any(r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool for r in rows):
        raise QuantkitError("token-id tensors must hold integer ids (a LongTensor [n, seq_len] or 1-D LongTensors)")
    return [r.to(torch.long) for r in rows]


# ----------------------------------------------------------------------------- public API


def load_texts(source, split: str = "calibration", tokenizer=None, chat_template: bool = False) -> list[str]:
    """The split's documents as strings, chat ``messages`` rendered with the tokenizer's template.

    Empty documents are dropped (except where the registry keeps them, e.g. wikitext2 eval, to
    match the standard perplexity protocol). Raises QuantkitError when nothing is left.
    """
    if _token_rows(source) is not None:
        raise QuantkitError("token ids have no text; pass them to calibration_batches or eval_token_stream instead")
    docs = _resolve(source, split, chat_template)
    texts = [_render(v, tokenizer, chat_template) for v in docs.values(range(len(docs)))]
    if all(_is_empty(t) for t in texts):
        raise QuantkitError(f"{docs.label} is empty; pass a dataset with text in it")
    return texts if docs.keep_empty else [t for t in texts if not _is_empty(t)]


def _need_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise QuantkitError("a tokenizer is needed to turn text into tokens; pass the model's tokenizer")


def calibration_batches(source, tokenizer, num_samples: int = 128, seq_len: int = 512, seed: int = 0,
                        chat_template: bool = False, split: str = "calibration"):
    """``num_samples`` non-overlapping windows of ``seq_len`` tokens, deterministic in ``seed``.

    Text: documents are visited in a seeded random order, each tokenized on its own (no special
    tokens) and followed by EOS (``"\\n\\n"`` tokens if the tokenizer has no EOS), until the
    stream holds ``num_samples * seq_len`` tokens; the stream is cut into consecutive windows.
    Only as much text as needed is tokenized, so a big hub split costs little.
    Token ids: rows are concatenated as given, cut into ``seq_len`` chunks, and ``num_samples``
    chunks are picked with a seeded ``randperm`` (kept in stream order).
    Asking for more tokens than the split has raises QuantkitError with the available count.
    """
    import torch

    if num_samples < 1 or seq_len < 1:
        raise QuantkitError(f"num_samples and seq_len must be positive (got {num_samples}, {seq_len})")
    need = num_samples * seq_len
    gen = torch.Generator().manual_seed(seed)

    def too_few(label: str, have: int) -> QuantkitError:
        return QuantkitError(
            f"calibration needs {need} tokens ({num_samples} samples x {seq_len} seq_len) but {label} "
            f"has only {have}; lower --num-samples or --seq-len"
        )

    rows = _token_rows(source)
    if rows is not None:
        stream = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        if stream.numel() == 0:
            raise QuantkitError("the given token ids are empty; pass non-empty tensors")
        if stream.numel() < need:
            raise too_few("the given token ids", stream.numel())
        n_chunks = stream.numel() // seq_len
        pick = torch.randperm(n_chunks, generator=gen)[:num_samples].sort().values
        return stream[: n_chunks * seq_len].view(n_chunks, seq_len)[pick].clone()

    _need_tokenizer(tokenizer)
    docs = _resolve(source, split, chat_template)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else \
        tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    order = torch.randperm(len(docs), generator=gen).tolist()
    pieces: list[list[int]] = []
    have = 0
    for start in range(0, len(order), 256):
        texts = [_render(v, tokenizer, chat_template) for v in docs.values(order[start:start + 256])]
        texts = [t for t in texts if not _is_empty(t)]
        if texts:
            for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
                pieces.append(ids + sep)
                have += len(ids) + len(sep)
        if have >= need:
            break
    if have == 0:
        raise QuantkitError(f"{docs.label} is empty; pass a dataset with text in it")
    if have < need:
        raise too_few(docs.label, have)
    flat = list(chain.from_iterable(pieces))[:need]
    return torch.tensor(flat, dtype=torch.long).view(num_samples, seq_len)


def eval_token_stream(source, tokenizer, split: str = "eval", max_tokens: int | None = None,
                      chat_template: bool = False):
    """The held-out split as one token stream ``[T]`` for perplexity.

    Documents are joined with ``"\\n\\n"`` and tokenized as one text without special tokens
    (the usual wikitext protocol); then the tokenizer's BOS, if it has one, is put once at the
    start, whether or not the tokenizer would add it itself, so every model sees the same start.
    ``max_tokens`` truncates, tokenizing only a growing prefix of the documents.
    Token-id sources are concatenated as given.
    """
    import torch

    rows = _token_rows(source)
    if rows is not None:
        stream = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        if stream.numel() == 0:
            raise QuantkitError("the given token ids are empty; pass non-empty tensors")
        return stream[:max_tokens] if max_tokens else stream

    _need_tokenizer(tokenizer)
    texts = load_texts(source, split, tokenizer, chat_template)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    n_docs = len(texts) if not max_tokens else min(len(texts), 64)
    while True:
        ids = bos + tokenizer("\n\n".join(texts[:n_docs]), add_special_tokens=False, verbose=False)["input_ids"]
        if n_docs >= len(texts) or (max_tokens and len(ids) >= max_tokens):
            break
        n_docs *= 2
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)
