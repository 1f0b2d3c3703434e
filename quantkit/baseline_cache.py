"""The baseline's side of a KL evaluation, kept on disk so that scoring another model costs one forward.

What is cached is the input of the baseline's LM head on every eval window (its last hidden states),
plus the head's weight: the baseline's logits are then one matmul away, exactly as its forward computes
them (checked on every window when the cache is built). Log-probabilities themselves would be
vocab/hidden times larger (49152 / 576 = 85x for the demo: ~100 KB per token in fp16).

A cache entry is keyed by everything that changes those numbers: the baseline's files (names, sizes,
modification times, config), the exact eval token ids, the dtype, device type and backend, and the
torch / transformers / quantkit versions. A baseline whose head is not a plain linear of its last
hidden state (a quantized head, logit soft-capping) is scored live instead, and not cached.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.scoring import batches, model_device

CACHE_ENTRIES = 8  # newest entries kept; each is [eval tokens, hidden] plus one head weight
_FORMAT = 1  # bump when the entry layout changes


def model_fingerprint(folder: Path) -> dict:
    """What identifies a model folder's contents cheaply: its config and each weight file's size and mtime."""
    folder = folder.resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json", ".gguf") and p.is_file())
    return {"folder": str(folder),
            "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def cache_key(fingerprint: dict, windows: torch.Tensor, settings: dict) -> str:
    import transformers

    from quantkit import __version__

    ids = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    parts = {"model": fingerprint, "windows": [list(windows.shape), ids], "settings": settings, "format": _FORMAT,
             "versions": [torch.__version__, transformers.__version__, __version__]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class BaselineLogits:
    """`logits(start, ids)`: the baseline's logits on the windows `start:start+len(ids)`."""

    def __init__(self, fn: Callable[[int, torch.Tensor], torch.Tensor], cache: str):
        self.fn, self.cache = fn, cache  # cache: "hit", "miss" (built now), or "off"

    def __call__(self, start: int, ids: torch.Tensor) -> torch.Tensor:
        return self.fn(start, ids)


def _plain_head(model) -> Optional[nn.Linear]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if type(head) is nn.Linear else None


@torch.no_grad()
def _head_inputs(model, head: nn.Linear, windows: torch.Tensor, batch_size: int, progress: bool) -> Optional[torch.Tensor]:
    """The head's input on every window, [n, T, H]; None if the model's logits are not head(input)."""
    seen = []
    handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    states = []
    try:
        for _, batch in batches(windows, batch_size, progress, "baseline"):
            seen.clear()
            logits = model(input_ids=batch.to(head.weight.device), use_cache=False).logits
            if len(seen) != 1 or seen[0].shape[:2] != batch.shape:
                return None
            again = F.linear(seen[0], head.weight, head.bias)
            if again.shape != logits.shape or not torch.allclose(again.float(), logits.float(), rtol=1e-5, atol=1e-5):
                return None  # scaled or soft-capped logits: not one matmul away
            states.append(seen[0].cpu())
    finally:
        handle.remove()
    return torch.cat(states)


def _store(path: Path, states: torch.Tensor, head: nn.Linear) -> None:
    from safetensors.torch import save_file

    tensors = {"states": states.contiguous(), "weight": head.weight.detach().cpu().contiguous()}
    if head.bias is not None:
        tensors["bias"] = head.bias.detach().cpu().contiguous()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    entries = sorted(path.parent.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[CACHE_ENTRIES:]:
        old.unlink(missing_ok=True)


def _from_file(path: Path, device) -> Callable[[int, torch.Tensor], torch.Tensor]:
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")
    weight = handle.get_tensor("weight").to(device)
    bias = handle.get_tensor("bias").to(device) if "bias" in handle.keys() else None
    states = handle.get_slice("states")

    def logits(start: int, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(states[start:start + ids.shape[0]].to(device), weight, bias)

    return logits


def _readable(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {"states", "weight"} <= set(f.keys())
    except Exception:  # a torn or foreign file: rebuild it
        return False


def baseline_logits(load: Callable[[], nn.Module], folder: Optional[Path], windows: torch.Tensor, settings: dict,
                    cache_dir: Optional[Path], batch_size: int = 4, progress: bool = False) -> BaselineLogits:
    """The baseline's logits on `windows`: from the cache when an entry matches, else computed now
    (with the head inputs stored for next time when the head allows it). `load()` loads the baseline
    model; it is called only on a cache miss."""
    path = None
    if cache_dir is not None and folder is not None:
        path = cache_dir / f"{cache_key(model_fingerprint(folder), windows, settings)}.safetensors"
        if path.is_file() and _readable(path):
            os.utime(path)  # most recently used
            return BaselineLogits(_from_file(path, settings.get("device") or "cpu"), "hit")
    model = load()
    head = _plain_head(model)
    states = _head_inputs(model, head, windows, batch_size, progress) if head is not None and path is not None else None
    if states is None:  # score it live, window batch by window batch
        def live(start: int, ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids.to(model_device(model)), use_cache=False).logits

        return BaselineLogits(live, "off")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _store(path, states, head)
    except OSError as exc:
        raise QuantkitError(f"could not write the baseline cache {path} ({exc}); free disk space or pass "
                            "--no-baseline-cache") from None
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    del model
    return BaselineLogits(lambda start, ids: F.linear(states[start:start + ids.shape[0]].to(weight.device), weight, bias),
                          "miss")


@torch.no_grad()
def in_memory_baseline(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> BaselineLogits:
    """The baseline's side held in memory instead of on disk (tests and in-process comparisons that
    score many fake-quantized copies of one model): its head inputs once, its head weight copied."""
    head = _plain_head(model)
    states = _head_inputs(model, head, windows, batch_size, False) if head is not None else None
    if states is None:
        raise QuantkitError("the baseline's logits are not a plain linear head of its last hidden state; "
                            "score it live with baseline_logits(..., cache_dir=None)")
    weight = head.weight.detach().clone()
    bias = None if head.bias is None else head.bias.detach().clone()
    return BaselineLogits(lambda start, ids: F.linear(states[start:start + ids.shape[0]].to(weight.device), weight, bias),
                          "memory")
