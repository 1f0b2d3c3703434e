"""Option values that parse but make no sense (a zero count, a negative size, a shard size that is
not a size), refused when a command starts rather than when the value is first used, which for
some is after calibration: a typo must never cost a whole run.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Union

from quantkit.errors import QuantkitError

_SHARD_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def shard_size_bytes(value: Union[int, str]) -> int:
    """--max-shard-size as bytes: 5GB (10^9, as huggingface_hub reads it), 500MB, 2GiB or a byte count."""
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SHARD_UNITS:
            raise QuantkitError(f"--max-shard-size {value!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
        size = int(float(m.group(1)) * _SHARD_UNITS[unit])
    if size < 1:
        raise QuantkitError(f"--max-shard-size {value!r} must be more than 0 bytes; write e.g. 5GB or 500MB")
    return size


def at_least(name: str, value: Optional[int], low: int = 1) -> None:
    """A count (`--seq-len`, `--max-windows`, ...) below `low` is refused naming the option; None passes."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantkitError(f"{name} must be a whole number, got {value!r}")
    if value < low:
        raise QuantkitError(f"{name} must be at least {low}, got {value}")


def finite_number(name: str, value: Optional[float], above: Optional[float] = None) -> None:
    """A float option that is NaN or infinite (click reads 'nan' and 'inf'), or not above `above`; None passes."""
    if value is None:
        return
    if not math.isfinite(float(value)):
        raise QuantkitError(f"{name} must be a finite number, got {value}")
    if above is not None and not value > above:
        raise QuantkitError(f"{name} must be more than {above}, got {value}")
