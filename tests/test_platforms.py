"""quantkit where Linux's facilities are missing (macOS, Windows): importable, and a quantize that
degrades with a notice instead of failing.

The child process simulates such a platform on this Linux box before quantkit is imported:
`resource` and `triton` are not found (Windows has no `resource`; triton ships Linux wheels
only), `os.sysconf` is gone (Windows; macOS lacks SC_AVPHYS_PAGES), and quantkit can neither open
`/proc` nor load glibc (neither exists on macOS or Windows; torch's and psutil's own Linux code
paths still may, as their other-platform code paths do without them). The oracle for the quantize is the
same call in this, unrestricted, process: RTN is deterministic, so both must write the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r'''
import builtins, ctypes, importlib.abc, json, os, sys, warnings

import psutil  # noqa: F401  its Linux backend imports resource (its Windows one does not): import it first

BLOCKED = {"resource", "triton"}


class Hiding(importlib.abc.MetaPathFinder):
    """Wraps a finder so BLOCKED modules are not found, exactly as where they are not installed."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):  # find_distributions, invalidate_caches, ...
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[name]
del os.sysconf
real_open, real_cdll_init = builtins.open, ctypes.CDLL.__init__


def by_quantkit() -> bool:  # torch and psutil have Linux code paths of their own that need /proc and glibc
    return sys._getframe(2).f_globals.get("__name__", "").startswith("quantkit")


def no_proc_open(file, *args, **kwargs):
    if str(file).startswith("/proc/") and by_quantkit():
        raise FileNotFoundError(2, "No such file or directory (blocked: no procfs)", str(file))
    return real_open(file, *args, **kwargs)


def no_glibc(self, name, *args, **kwargs):
    if name is not None and "libc.so" in str(name) and by_quantkit():
        raise OSError(f"{name}: cannot open shared object file (blocked: no glibc)")
    real_cdll_init(self, name, *args, **kwargs)


builtins.open, ctypes.CDLL.__init__ = no_proc_open, no_glibc

import torch
import quantkit
import quantkit.api
from quantkit.errors import QuantkitError

model_dir, out = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    summary = quantkit.quantize(model_dir, "rtn", bits=4, group_size=32, output=out, progress=False)
    loaded = quantkit.load(out, backend="auto", dtype="float32")
    reference = quantkit.load(out, backend="reference", dtype="float32")
ids = torch.tensor([[1, 20, 300, 4000, 5]])
with torch.no_grad():
    logits, expected = loaded(ids).logits, reference(ids).logits
try:
    quantkit.load(out, backend="triton")
    triton_refusal = None
except QuantkitError as e:
    triton_refusal = str(e)
print(json.dumps({
    "blocked_loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED),
    "streaming": summary["streaming"], "peak_rss_mb": summary["peak_rss_mb"],
    "max_logit_diff": (logits - expected).abs().max().item(), "logit_scale": expected.abs().max().item(),
    "backends": sorted({m.active_backend for m in loaded.modules() if hasattr(m, "active_backend")}),
    "notices": [str(w.message) for w in caught], "triton_refusal": triton_refusal,
}))
'''


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".json") and p.name != "README.md"}


def test_quantize_without_resource_triton_sysconf_proc_or_glibc(tmp_path, tiny_llama_dir):
    import quantkit

    child = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama_dir), str(tmp_path / "degraded")],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["blocked_loaded"] == []
    assert got["streaming"] is False  # memory unknown: not streamed unasked ...
    assert any("does not report available memory" in n for n in got["notices"]), got["notices"]  # ... and said so
    rss = got["peak_rss_mb"]  # neither /proc nor resource: unknown (NaN, or None in strict JSON), not invented
    assert rss is None or rss != rss, rss
    assert got["backends"] == ["cpu"]  # auto on the CPU needs no triton
    assert got["max_logit_diff"] <= 1e-2 * got["logit_scale"], got  # bf16 packed kernels vs the fp32 reference
    assert "triton package" in got["triton_refusal"]

    quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, output=tmp_path / "full", progress=False)
    assert _digests(tmp_path / "degraded") == _digests(tmp_path / "full")


def test_peak_rss_units_per_platform(monkeypatch):
    """ru_maxrss is kilobytes on Linux and bytes on macOS (getrusage(2) of each)."""
    import types

    from quantkit import memory

    fake = types.SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(ru_maxrss=3 * 2**30))
    monkeypatch.setitem(sys.modules, "resource", fake)
    monkeypatch.setattr(memory, "_linux_hwm_mb", lambda: None)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert memory.peak_rss_mb() == pytest.approx(3 * 1024)  # 3 GiB in bytes
    monkeypatch.setattr(sys, "platform", "linux")
    assert memory.peak_rss_mb() == pytest.approx(3 * 2**20)  # the same number read as KiB: 3 TiB


def test_available_memory_is_unknown_not_an_error(monkeypatch):
    """Each probe answers None where its facility is missing; all missing means None, never a raise."""
    import builtins
    import os

    from quantkit import platform_support

    assert platform_support.available_memory_bytes() > 0  # this Linux box reports it
    real_open = builtins.open

    def no_proc(file, *args, **kwargs):
        if str(file).startswith("/proc/"):
            raise FileNotFoundError(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert platform_support.available_memory_bytes() > 0  # sysconf's SC_AVPHYS_PAGES still answers
    monkeypatch.setattr(os, "sysconf_names", {k: v for k, v in os.sysconf_names.items() if k != "SC_AVPHYS_PAGES"})
    assert platform_support.available_memory_bytes() is None  # macOS: no SC_AVPHYS_PAGES
    monkeypatch.delattr(os, "sysconf")
    assert platform_support.available_memory_bytes() is None  # Windows would ask GlobalMemoryStatusEx


HEAP_CHILD = r'''
import ctypes, json, sys

from quantkit.platform_support import glibc
from quantkit.streaming import bounded_heap

libc = glibc()
if libc is None or not hasattr(libc, "mallinfo2"):
    print("skip"); sys.exit(0)


class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


mallinfo2 = ctypes.CFUNCTYPE(MallInfo2)(("mallinfo2", libc))
malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(("malloc", libc))
free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(("free", libc))


def mmapped(nbytes):
    libc.malloc_trim(0)
    before = mallinfo2().hblks
    block = malloc(nbytes)
    grew = mallinfo2().hblks - before
    free(block)
    return grew == 1


with bounded_heap():
    with bounded_heap():  # nested: the outer scope still holds when the inner one ends
        pass
    inside = [mmapped(2 << 20), mmapped(512 << 10)]
print(json.dumps([inside, [mmapped(512 << 10), mmapped(200 << 10), mmapped(100 << 10)]]))
'''


def test_bounded_heap_is_scoped_to_the_run():
    """Inside, glibc serves a fresh 2 MiB block by mmap and a 512 KiB one from the heap (threshold
    1 MiB); after, its default fixed 128 KiB threshold: 512 and 200 KiB by mmap, 100 KiB from the
    heap. Read from glibc's own count of mmapped chunks (mallinfo2), with the heap trimmed before
    each request so that it must grow, which is where the threshold decides. In a fresh process:
    a heap that has seen a quantize holds free chunks big enough to serve any of these sizes."""
    child = subprocess.run([sys.executable, "-c", HEAP_CHILD], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    if child.stdout.strip() == "skip":
        pytest.skip("needs glibc >= 2.33 (mallinfo2); elsewhere bounded_heap is a no-op")
    inside, after = json.loads(child.stdout.strip().splitlines()[-1])
    assert inside == [True, False]
    assert after == [True, True, False]
