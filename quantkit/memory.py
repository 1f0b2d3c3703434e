"""Peak memory of the current process, measured the same way by quantkit and its benchmark peers,
and handing a file mapping's pages back once they are no longer needed.

`peak_rss_mb` uses the standard library only: scripts/llmcompressor_peer.py runs in another venv and
loads this one file by path, so both tools' "peak RSS" columns come from the same reader.
"""
from __future__ import annotations

import mmap
import sys


def peak_rss_mb() -> float:
    """This process's own peak resident memory, in MB (NaN where the platform does not say).

    Linux's `ru_maxrss` is not it for a child of a big process: `subprocess` starts children with
    vfork, and exec carries the parent's high-water mark into the child's `ru_maxrss` (a 4.3 GB
    pytest parent made a 0.8 GB quantize run report 4.3 GB). `VmHWM` belongs to the process's own
    address space, so it is read first; `ru_maxrss` remains the fallback elsewhere (kilobytes on
    Linux and the BSDs, bytes on macOS), and Windows reports its peak working set."""
    hwm = _linux_hwm_mb()
    if hwm is not None:
        return hwm
    if sys.platform == "win32":
        return _windows_peak_mb()
    try:
        import resource  # POSIX only; imported here so that importing quantkit works on Windows
    except ImportError:
        return float("nan")
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss / 2**20 if sys.platform == "darwin" else max_rss / 1024.0


def _linux_hwm_mb():
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def _windows_peak_mb() -> float:
    """`PeakWorkingSetSize` of this process (psapi `GetProcessMemoryInfo`)."""
    import ctypes

    class ProcessMemoryCounters(ctypes.Structure):
        _fields_ = [("cb", ctypes.c_ulong), ("PageFaultCount", ctypes.c_ulong)] + [
            (name, ctypes.c_size_t) for name in ("PeakWorkingSetSize", "WorkingSetSize", "QuotaPeakPagedPoolUsage",
                                                 "QuotaPagedPoolUsage", "QuotaPeakNonPagedPoolUsage",
                                                 "QuotaNonPagedPoolUsage", "PagefileUsage", "PeakPagefileUsage")]

    counters = ProcessMemoryCounters()
    counters.cb = ctypes.sizeof(ProcessMemoryCounters)
    try:
        kernel32, psapi = ctypes.windll.kernel32, ctypes.windll.psapi
        kernel32.GetCurrentProcess.restype = ctypes.c_void_p
        psapi.GetProcessMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(ProcessMemoryCounters), ctypes.c_ulong]
        if psapi.GetProcessMemoryInfo(kernel32.GetCurrentProcess(), ctypes.byref(counters), counters.cb):
            return counters.PeakWorkingSetSize / 2**20
    except (AttributeError, OSError):
        pass
    return float("nan")


_MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+): reclaim these pages now; contents are kept


def page_out_file_backed(ranges: list[tuple[int, int]]) -> int:
    """Drop the resident pages of the given (address, nbytes) ranges that lie in file mappings.

    A model loaded from safetensors is a view of the file's mapping: every weight page calibration
    reads stays resident (and counts in RSS) until the mapping goes, i.e. to the end of the run,
    even after the layer is finished and its weights replaced. MADV_PAGEOUT hands such pages back
    without changing what the mapping holds (a later read faults them in from the file again), so
    it is safe whoever else views those bytes. Heap memory is left alone (it is freed, not paged
    out). Returns the bytes advised; 0 where the kernel or platform lacks MADV_PAGEOUT."""
    from quantkit.platform_support import glibc

    libc = glibc()
    if libc is None:
        return 0
    try:
        with open("/proc/self/maps") as maps:  # address-range perms offset dev inode [path]
            fields = [line.split() for line in maps]
        files = [tuple(int(x, 16) for x in f[0].split("-")) for f in fields if len(f) > 5 and f[5].startswith("/")]
    except (OSError, ValueError):
        return 0
    page, advised = mmap.PAGESIZE, 0
    for address, nbytes in ranges:
        start, end = address // page * page, -(-(address + nbytes) // page) * page
        for lo, hi in files:
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                if libc.madvise(lo, hi - lo, _MADV_PAGEOUT) != 0:
                    return advised  # EINVAL: a kernel without MADV_PAGEOUT; nothing to gain here
                advised += hi - lo
    return advised
