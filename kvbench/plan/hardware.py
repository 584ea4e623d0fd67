"""Hardware for the planner: published specs (conf/hardware/*.yaml) or this CPU, calibrated once and cached."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench import KvbenchError
from kvbench.store.results import write_atomic

GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    peak_flops: float  # dense bf16/fp16
    source: str  # "published" or "measured <date>"

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound (the roofline's ridge point)."""
        return self.peak_flops / self.bandwidth_bytes_s


def build_hardware(cfg) -> Hardware:
    if cfg.get("calibrate"):
        measured = calibrated_cpu(bool(cfg.get("recalibrate", False)))
        return Hardware(
            cfg.name,
            int((cfg.memory_gib or 0) * GIB) or measured["memory_bytes"],
            (cfg.bandwidth_gb_s or 0) * 1e9 or measured["bandwidth_bytes_s"],
            (cfg.peak_tflops or 0) * 1e12 or measured["peak_flops"],
            f"measured {measured['date']}",
        )
    missing = [k for k in ("memory_gib", "bandwidth_gb_s", "peak_tflops") if not cfg.get(k)]
    if missing:
        raise KvbenchError(
            f"hardware={cfg.get('name')} lacks {', '.join(missing)}; set them, e.g. "
            f"hardware.{missing[0]}=80, or use a preset in conf/hardware/"
        )
    return Hardware(cfg.name, int(cfg.memory_gib * GIB), cfg.bandwidth_gb_s * 1e9, cfg.peak_tflops * 1e12, "published")


def _cache_file():
    from kvbench import cache_root

    return cache_root() / "hardware-cpu.json"


def _cpu_key() -> str:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} × {torch.get_num_threads()} threads"


def calibrated_cpu(recalibrate: bool = False) -> dict:
    """This CPU's memory, copy bandwidth and bf16 matmul FLOP/s; measured once per CPU model and thread count."""
    path, key = _cache_file(), _cpu_key()
    cached = read_calibration(path)
    if key not in cached or recalibrate:
        from kvbench.model.device import NATIVE_BF16_CPU_FLAGS, cpu_flags

        # Without these flags bf16 is emulated, and its speed falls ~10x once the matrices leave the cache (2048²:
        # 0.2 GFLOP/s, 6 matmuls ~9 min on an AVX2-only EPYC): there the peak is measured in cache, at 512², seconds.
        native = bool(set(NATIVE_BF16_CPU_FLAGS + ("bf16",)) & cpu_flags())
        n = 2048 if native else 512
        print(
            f"[kvbench.plan] calibrating this CPU ({key}): about {_duration(calibration_seconds(matmul_n=n))} "
            f"({n}² bf16 matmuls, {'native' if native else 'emulated: no AVX512-BF16/AMX'}; estimated from a small "
            f"one); cached in {path}",
            flush=True,
        )
        cached[key] = {**measure_cpu(matmul_n=n), "date": time.strftime("%Y-%m-%d")}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(cached, indent=1)))
    return cached[key]


MEASURED = ("memory_bytes", "bandwidth_bytes_s", "peak_flops", "date")


def read_calibration(path: Path) -> dict:
    """The cached measurements, each entry checked: a damaged file is one line saying to delete it."""
    if not path.exists():
        return {}
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cached, dict):
            raise ValueError("not a JSON object")
        for entry in cached.values():
            bad = [k for k in MEASURED[:3] if not isinstance(entry.get(k), (int, float)) or not entry[k] > 0]
            if bad or not isinstance(entry.get("date"), str):
                raise ValueError(f"an entry lacks a positive {(bad or ['date'])[0]}")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise KvbenchError(
            f"the CPU calibration cache {path} is damaged ({str(error).splitlines()[0]}); delete it (rm {path}): "
            "the next plan measures this CPU again"
        ) from None
    return cached


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm up (page faults, thread pool)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def calibration_seconds(copy_mib: int = 256, matmul_n: int = 2048, repeats: int = 5) -> float:
    """What measure_cpu(copy_mib, matmul_n, repeats) will take, from a 16 MiB copy and a bf16 matmul at half its
    size or 512² (well under a second) scaled to its sizes: within ~2x where the measured sizes stay in one regime."""
    start = time.perf_counter()
    src = torch.ones(4 << 20)  # 16 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays the page faults, as measure_cpu's warm-up does
    first = time.perf_counter() - start
    copy_s = (first + repeats * _best_seconds(lambda: dst.copy_(src), 1)) * copy_mib / 16
    probe = min(512, matmul_n // 2)
    a = torch.randn(probe, probe, dtype=torch.bfloat16)
    matmul_s = _best_seconds(lambda: a @ a, 1) * (matmul_n / probe) ** 3
    return copy_s + (repeats + 1) * matmul_s  # measure_cpu warms up once, then takes the best of `repeats`


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def measure_cpu(copy_mib: int = 256, matmul_n: int = 2048, repeats: int = 5) -> dict:
    """Copy bandwidth (bytes read + written per second) of a tensor far larger than the caches, and dense bf16
    matmul FLOP/s — the two terms of decode's roofline. Best of `repeats` (the least-contended run)."""
    src = torch.ones(copy_mib * (1 << 20) // 4)  # fp32, copy_mib MiB
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16)  # (N, N)
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16)
    matmul_s = _best_seconds(lambda: a @ b, repeats)
    return {
        "memory_bytes": _mem_total(),
        "bandwidth_bytes_s": 2 * src.nbytes / copy_s,
        "peak_flops": 2 * matmul_n**3 / matmul_s,
        "threads": torch.get_num_threads(),
        "matmul_n": matmul_n,
    }


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def describe(hw: Hardware) -> str:
    return (
        f"{hw.name}: {hw.memory_bytes / GIB:.0f} GiB, {hw.bandwidth_bytes_s / 1e9:.0f} GB/s, "
        f"{hw.peak_flops / 1e12:.3g} TFLOP/s dense bf16 ({hw.source}); ridge {hw.ridge_intensity:.0f} FLOP/byte"
    )
