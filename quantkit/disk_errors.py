"""File-system faults while an output is written (a full disk, a read-only or forbidden location),
told in one line with the fix instead of an OSError traceback.

The writers stage everything in a hidden folder beside the output (checkpoint.staging_dir) and
rename it into place only when complete, so a failed write never leaves a half-written output; a
quantize run's staging folder also holds its finished layers, which `--resume` continues from
once space is freed.
"""
from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional

from quantkit.errors import QuantkitError

FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(folder: Path) -> Optional[int]:
    """Free space on the disk holding `folder` (its nearest existing parent), None if unknown."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


@contextlib.contextmanager
def writing_output(output: Path, needed_bytes: Callable[[], Optional[int]] = lambda: None,
                   resume_hint: bool = False) -> Iterator[None]:
    """Turn a full disk or an unwritable location met while writing `output` into a QuantkitError.

    `needed_bytes()` estimates the output's size (asked only on a full disk); with `resume_hint`
    the message says that the same command with --resume continues once space is freed."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in FULL | NOT_WRITABLE:
            raise
        where = Path(exc.filename) if exc.filename else Path(output)
        if exc.errno in NOT_WRITABLE:
            raise QuantkitError(f"cannot write {where} ({exc.strerror or 'not writable'}); choose an --output in a "
                                f"folder you can write to") from None
        try:
            needed = needed_bytes()
        except Exception:  # noqa: BLE001 - an estimate must never hide the disk-full error itself
            needed = None
        free = free_bytes(Path(output).parent)
        size = f"the output needs about {human_bytes(needed)}" if needed else "the output did not fit"
        room = f", {human_bytes(free)} is free there" if free is not None else ""
        fix = ("free space, then rerun the same command with --resume (the finished layers are kept)" if resume_hint
               else "free space or choose an --output on another disk, then rerun")
        raise QuantkitError(f"no space left on the disk of {Path(output).parent} while writing {where.name}: {size}"
                            f"{room}; {fix}") from None
