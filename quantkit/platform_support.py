"""What the operating system offers quantkit, detected rather than assumed.

Linux, macOS and Windows differ in how they report free memory (`/proc/meminfo`; no
`SC_AVPHYS_PAGES` on macOS; no `os.sysconf` at all on Windows) and only glibc has the allocator
controls quantkit uses to hand memory back. Each function here answers None ("unknown" / "not
here") instead of raising, so callers choose a safe default. Standard library only.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

_GLIBC = None  # None: not looked up yet; False: not available here


def available_memory_bytes() -> Optional[int]:
    """Memory the OS could give this process now, in bytes, or None when the platform does not say."""
    for probe in (_meminfo_available, _sysconf_available, _windows_available):
        found = probe()
        if found is not None:
            return found
    return None


def _meminfo_available() -> Optional[int]:
    """Linux: `MemAvailable` (free pages plus reclaimable cache), the figure the kernel recommends."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_available() -> Optional[int]:
    """POSIX systems that have `SC_AVPHYS_PAGES` (free pages only; macOS lacks it, Windows lacks sysconf)."""
    names = getattr(os, "sysconf_names", {})
    if not hasattr(os, "sysconf") or "SC_AVPHYS_PAGES" not in names or "SC_PAGE_SIZE" not in names:
        return None
    try:
        pages, page = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def _windows_available() -> Optional[int]:
    """Windows: `GlobalMemoryStatusEx`'s available physical memory."""
    if sys.platform != "win32":
        return None
    import ctypes

    class MemoryStatusEx(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong)] + [
            (name, ctypes.c_ulonglong) for name in ("ullTotalPhys", "ullAvailPhys", "ullTotalPageFile",
                                                    "ullAvailPageFile", "ullTotalVirtual", "ullAvailVirtual",
                                                    "ullAvailExtendedVirtual")]

    status = MemoryStatusEx()
    status.dwLength = ctypes.sizeof(MemoryStatusEx)
    try:
        if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return None
    except (AttributeError, OSError):
        return None
    return int(status.ullAvailPhys) or None


def glibc():
    """The process's glibc (ctypes), for `malloc_trim`, `mallopt` and `madvise`; None elsewhere
    (macOS, Windows, musl), where the callers' memory tricks are no-ops."""
    global _GLIBC
    if _GLIBC is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            _GLIBC = libc if all(hasattr(libc, f) for f in ("malloc_trim", "mallopt", "madvise")) else False
            if _GLIBC:
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, ImportError):
            _GLIBC = False
    return _GLIBC or None
