"""Each decode row's share of the bandwidth bound: is a step as fast as the machine's memory allows?

A decode step reads the model's weights and the K/V (and a hybrid's states) it attends over; a grid step of B rows
reads the weights once and every row's cache. `step_bytes` over the measured step time, against the machine's memory
read bandwidth, is `bandwidth_share`: near 1, the step is at the physical floor and methods differ only by the
bytes they hold; well below 1, the step is bound by compute or overhead, and a latency difference between two
methods may be neither's cache.

The bandwidth is measured once per machine (a sum over a tensor far larger than the caches, best of a few: the
rate a step can read at) and cached in $KVBENCH_CACHE/bandwidth.json, keyed by the device's name and, on a CPU,
the torch thread count (a decode reads with that many threads). `KVBENCH_BANDWIDTH_GBS` sets it instead (a
published figure, or to skip the probe).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from kvbench import KvbenchError, cache_root

PROBE_BYTES = {"cpu": 512 << 20, "cuda": 2 << 30}  # far past the last-level cache (GPUs: past L2)


def machine_key(device: torch.device) -> str:
    from kvbench.store.results import device_name

    name = device_name(device)
    return name if device.type == "cuda" else f"{name} × {torch.get_num_threads()} threads"


def _cache_file() -> Path:
    return cache_root() / "bandwidth.json"


def read_cache(path: Path) -> dict:
    """{machine key: {"bytes_s", "date"}}; a damaged file is one line saying to delete it."""
    if not path.exists():
        return {}
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cached, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes_s"), (int, float)) and v["bytes_s"] > 0
            for v in cached.values()
        ):
            raise ValueError("an entry lacks a positive bytes_s")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise KvbenchError(
            f"the bandwidth cache {path} is damaged ({str(error).splitlines()[0]}); delete it (rm {path}): the next "
            "run measures this machine again"
        ) from None
    return cached


def measure(device: torch.device, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: a sum over PROBE_BYTES of fp32, best of `repeats` after one warm-up."""
    x = torch.ones(PROBE_BYTES[device.type] // 4, device=device)  # (N,) fp32

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        x.sum().item()  # .item(): the read has finished
        return time.perf_counter() - start

    once()
    return x.nbytes / min(once() for _ in range(repeats))


def memory_bandwidth(device: torch.device) -> float:
    """This machine's memory read bandwidth (bytes/s): KVBENCH_BANDWIDTH_GBS, else the cached probe, else probed
    now (well under a second on a CPU, milliseconds on a GPU) and cached."""
    setting = os.environ.get("KVBENCH_BANDWIDTH_GBS")
    if setting:
        try:
            value = float(setting) * 1e9
        except ValueError:
            value = math.nan
        if not value > 0 or math.isinf(value):
            raise KvbenchError(
                f"KVBENCH_BANDWIDTH_GBS={setting!r} is not a positive number of GB/s; e.g. 4800 for an H200"
            )
        return value
    path, key = _cache_file(), machine_key(device)
    cached = read_cache(path)
    if key not in cached:
        print(f"[kvbench] measuring this machine's memory bandwidth ({key}, under a second), cached in {path}")
        cached[key] = {"bytes_s": measure(device), "date": time.strftime("%Y-%m-%d")}
        try:
            from kvbench.store.results import write_atomic

            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(cached, indent=1)))
        except OSError:
            pass  # an unwritable cache: measured again next run, never a failed run
    return float(cached[key]["bytes_s"])


def weight_bytes(model) -> int:
    """The bytes of weights one decode step reads: every parameter once (tied ones once), the input embedding's
    table left out unless it is the output projection too (a step reads one row of it)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()  # a transformers PreTrainedModel
    table, output = getattr(embed, "weight", None), getattr(head, "weight", None)
    if isinstance(table, torch.Tensor):
        tied = isinstance(output, torch.Tensor) and output.data_ptr() == table.data_ptr()
        total -= 0 if tied else table.numel() * table.element_size()
    return total


def share_columns(weights: int, kv_bytes: int, step_s: float, bandwidth: float) -> dict:
    """A decode row's `step_bytes` (the weights + the K/V a step reads: for a grid step every row's) and its
    `bandwidth_share` (those bytes over the step time, over the machine's bandwidth); NaN without a decode step."""
    step_bytes = weights + kv_bytes
    share = step_bytes / step_s / bandwidth if step_s > 0 and bandwidth > 0 else math.nan
    return {"step_bytes": step_bytes, "bandwidth_share": share}
