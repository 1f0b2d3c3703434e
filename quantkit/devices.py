"""The compute device a user names (--device), checked before any work.

torch accepts any device string it knows the type of and fails only at the first tensor moved
there (an AssertionError deep in a forward for `cuda` on a CPU build, after the model is loaded
and a staging folder exists): every command resolves its device here first, so a device this
torch cannot serve is one line naming what it can.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from quantkit.errors import QuantkitError


def available_devices() -> list[str]:
    """The device names this torch build and machine can run on, for the error message."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def compute_device(device: Union[str, torch.device, None]) -> torch.device:
    """`device` (None: cpu) as a torch.device this process can use, or a QuantkitError naming the choices."""
    if isinstance(device, torch.device):
        name = str(device)
    else:
        name = "cpu" if device is None else str(device).strip()
    choices = ", ".join(available_devices())
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise QuantkitError(f"unknown device {name!r}; this machine offers {choices}") from None
    problem = _unavailable(dev)
    if problem is not None:
        raise QuantkitError(f"--device {name}: {problem}; use one of {choices}")
    return dev


def _unavailable(dev: torch.device) -> Optional[str]:
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None or torch.version.hip is not None
            return ("no CUDA GPU is visible to this torch" if built
                    else f"the installed torch {torch.__version__} is a CPU-only build")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"there are only {torch.cuda.device_count()} CUDA devices (0 to {torch.cuda.device_count() - 1})"
        return None
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "MPS is not available to this torch"
    return f"quantkit runs on cpu, cuda or mps, not {dev.type}"
