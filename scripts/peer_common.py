"""What the benchmark-peer scripts (llmcompressor_peer.py, gptqmodel_peer.py) share.

They run in the peers' own venvs, so they must not import the quantkit package; this module is
stdlib-only at import time and sits beside them (a script's own folder is on sys.path).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path


def _load_peak_rss_mb():
    """quantkit/memory.py's reader, loaded by path (stdlib only; the quantkit package is not imported),
    so every tool's peak RSS is measured the same way (VmHWM, not a vforked child's ru_maxrss)."""
    path = Path(__file__).resolve().parent.parent / "quantkit" / "memory.py"
    spec = importlib.util.spec_from_file_location("_quantkit_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.peak_rss_mb


peak_rss_mb = _load_peak_rss_mb()


def load_calibration_ids(path: str):
    """The calibration token ids quantkit's pipeline wrote: int64 [num_samples, seq_len] under "input_ids"."""
    import torch
    from safetensors.torch import load_file

    ids = load_file(path)["input_ids"].to(torch.int64)
    if ids.dim() != 2:
        raise SystemExit(f"{path}: input_ids must be [num_samples, seq_len], got {tuple(ids.shape)}")
    return ids
