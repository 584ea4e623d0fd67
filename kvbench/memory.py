"""Peak memory of a stretch of work: CUDA max allocated, or the process's peak RSS (VmHWM) on CPU."""

from __future__ import annotations

import re
import resource

import torch


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak RSS (VmHWM) to the current RSS (Linux ≥ 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not resettable here: the peak then covers the whole process so far


def read_peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    peak = _vm_hwm()
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
