"""One-line notices for paths that degrade instead of failing (a missing kernel, a platform that does
not report a fact), said once per distinct reason so a 32-layer model prints one line, not 224."""
from __future__ import annotations

import warnings

_noticed: set[str] = set()


def notice(reason: str) -> None:
    """Warn once per distinct `reason` for the life of the process (see `reset_notices`)."""
    if reason not in _noticed:
        _noticed.add(reason)
        warnings.warn(reason, stacklevel=3)


def reset_notices() -> None:
    """Forget what was said, so the next occurrence of each reason warns again (tests)."""
    _noticed.clear()
