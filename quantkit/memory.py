"""Peak memory of the current process, measured the same way by quantkit and its benchmark peers.

Standard library only: scripts/llmcompressor_peer.py runs in another venv and loads this one file
by path, so both tools' "peak RSS" columns come from the same reader.
"""
from __future__ import annotations

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
