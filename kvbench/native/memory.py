"""Peak memory of a stretch of work, and the baseline it started from.

CUDA: `max_memory_allocated` since `reset_peak`, over `memory_allocated` at the reset (tensors only: the caching
allocator's reserve is not counted). CPU: the process's peak resident set (VmHWM), reset by writing 5 to
/proc/self/clear_refs (Linux ≥ 4.0), over the resident set (VmRSS) at the reset. RSS only drops when the allocator
returns freed memory to the OS, which glibc's malloc does lazily: `reset_peak` first calls `malloc_trim(0)`, so the
baseline is what is live now rather than what earlier work left in malloc's free lists — otherwise a configuration
that reuses those pages would show no growth. Everything the process touches counts (weights, activations, the
engine's statistics and score tensors), which is what decides whether a request fits.

Within a stretch, glibc keeps freed blocks of up to 32 MiB in its heap (its mmap threshold adapts upwards), and
fragmentation can then grow the resident set past the live tensors (a chunked prefill: ~38 MiB more per 2K-token
chunk on longctx-random). `KVBENCH_MMAP_THRESHOLD=131072` fixes the threshold (mallopt): every block above it is
its own mapping, returned to the OS when freed, so the peak RSS follows the live tensors; it costs time (~15 % on
prefill and decode of the bundled model at 4K, measured in one run), so it is for memory benchmarks
(`python -m kvbench.bench peak_memory` sets it), not the default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import resource

import torch


def _status(field: str) -> int | None:
    """A /proc/self/status field in bytes (VmRSS, VmHWM), None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"{field}:\s+(\d+) kB", f.read())
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _trim() -> None:
    """Give malloc's free memory back to the OS (glibc); a no-op elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def fix_mmap_threshold(threshold: int) -> bool:
    """glibc: serve every allocation above `threshold` bytes by its own mmap (freed = back to the OS)."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD


if os.environ.get("KVBENCH_MMAP_THRESHOLD"):
    fix_mmap_threshold(int(os.environ["KVBENCH_MMAP_THRESHOLD"]))


@functools.cache
def peak_resettable() -> bool:
    """Whether CPU peaks are per stretch of work (VmHWM resettable), not since the process started."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmHWM") is not None
    except OSError:
        return False


def in_use(device: torch.device) -> int:
    """Memory in use now: CUDA allocated bytes, or the process's resident set on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    rss = _status("VmRSS")
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak(device: torch.device) -> int:
    """Start a stretch of work: reset the peak; returns the memory in use now (the baseline of a delta)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    _trim()
    if peak_resettable():
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS
            f.write("5")
    return in_use(device)


def read_peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    peak = _status("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
