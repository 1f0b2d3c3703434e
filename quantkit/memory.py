"""Peak memory of the current process, measured the same way by quantkit and its benchmark peers,
and handing a file mapping's pages back once they are no longer needed.

Standard library only: scripts/llmcompressor_peer.py runs in another venv and loads this one file
by path, so both tools' "peak RSS" columns come from the same reader.
"""
from __future__ import annotations

import mmap
import resource


def peak_rss_mb() -> float:
    """This process's own peak resident memory, in MB.

    Linux's `ru_maxrss` is not it for a child of a big process: `subprocess` starts children with
    vfork, and exec carries the parent's high-water mark into the child's `ru_maxrss` (a 4.3 GB
    pytest parent made a 0.8 GB quantize run report 4.3 GB). `VmHWM` belongs to the process's own
    address space, so it is read first; `ru_maxrss` remains the fallback off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+): reclaim these pages now; contents are kept


def page_out_file_backed(ranges: list[tuple[int, int]]) -> int:
    """Drop the resident pages of the given (address, nbytes) ranges that lie in file mappings.

    A model loaded from safetensors is a view of the file's mapping: every weight page calibration
    reads stays resident (and counts in RSS) until the mapping goes, i.e. to the end of the run,
    even after the layer is finished and its weights replaced. MADV_PAGEOUT hands such pages back
    without changing what the mapping holds (a later read faults them in from the file again), so
    it is safe whoever else views those bytes. Heap memory is left alone (it is freed, not paged
    out). Returns the bytes advised; 0 where the kernel or platform lacks MADV_PAGEOUT."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:  # address-range perms offset dev inode [path]
            fields = [line.split() for line in maps]
        files = [tuple(int(x, 16) for x in f[0].split("-")) for f in fields if len(f) > 5 and f[5].startswith("/")]
    except (OSError, AttributeError):
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
