"""What flows into and out of a decoder layer (or one of its blocks) during calibration, as the
pipeline and the recipe steps both handle it: nested arguments moved between devices or cut to fewer
sequences, the hidden states of an output, and the exception that ends a forward early."""
from __future__ import annotations

import torch


class StopForward(Exception):
    """Raised from a hook to end a forward once everything it was run for has been seen."""


def to_device(obj, device):
    """Move tensors inside nested tuples/lists/dicts to `device` (kwargs hold rotary tuples, masks...)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def layer_output(out):
    """The hidden states of a decoder layer's (or block's) output, which may be a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


def batch_shapes(inputs: list) -> list[tuple[int, int]]:
    """(sequences, tokens per sequence) of each calibration batch."""
    return [(h.shape[0], h.shape[1] if h.dim() > 2 else 1) for h, _ in inputs]


def slice_batch(obj, rows: int, batch: int, seq: int):
    """Keep the first ``rows`` sequences of a batch of ``batch`` x ``seq`` tokens in nested args.

    Tensors with a leading batch dim are cut to ``rows``; flattened token tensors ([batch*seq, ...],
    e.g. OPT's fc1 input) to ``rows*seq``; everything else (rotary tables with batch 1, None) is kept.
    """
    if rows >= batch:
        return obj
    return slice_rows(obj, 0, rows, batch, seq)


def slice_rows(obj, start: int, stop: int, batch: int, seq: int):
    """Sequences ``start:stop`` of a batch of ``batch`` x ``seq`` tokens in nested args (as `slice_batch`)."""
    if start == 0 and stop >= batch:
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 2 and obj.shape[0] == batch:
            return obj[start:stop]
        if obj.dim() >= 2 and obj.shape[0] == batch * seq and seq > 1:
            return obj[start * seq: stop * seq]
        return obj
    if isinstance(obj, tuple):
        return tuple(slice_rows(o, start, stop, batch, seq) for o in obj)
    if isinstance(obj, list):
        return [slice_rows(o, start, stop, batch, seq) for o in obj]
    if isinstance(obj, dict):
        return {k: slice_rows(v, start, stop, batch, seq) for k, v in obj.items()}
    return obj
