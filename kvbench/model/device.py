"""Where and in which precision a model runs: `device=auto|cpu|cuda`, `dtype=auto|bfloat16|float16|float32` (auto:
bf16 where the hardware runs it natively, else fp32; KVBENCH_NO_BF16=1: fp32 as on a CPU without native bf16)."""

from __future__ import annotations

import os
import re

import torch

from kvbench import KvbenchError

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def resolve_device(device: str) -> torch.device:
    """`device` (auto, cpu, cuda, cuda:N) as torch's, or one line: a malformed string, no CUDA GPU visible to this
    torch (a CPU-only build), or a GPU index beyond the visible ones."""
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?|auto", str(device))
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise KvbenchError(f"device={device!r} is not a device; use device=auto, device=cpu, device=cuda or cuda:N")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if match.group(1) == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise KvbenchError(
                f"device={device} but no CUDA GPU is visible to torch {torch.__version__} ({build}); use device=cpu "
                "(or device=auto)"
            )
        index, count = int(match.group(2) or 0), torch.cuda.device_count()
        if index >= count:
            raise KvbenchError(f"device={device} but torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}; use one")
    return torch.device(device)


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86; aarch64 lists `bf16` in its Features


def cpu_flags() -> set[str]:
    """The CPU's feature flags: torch's own probe (torch.cpu.get_capabilities), else /proc/cpuinfo."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            return {name for name, present in get().items() if present is True}
        except Exception:  # an old or unusual build: fall back to the kernel's view
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` runs bf16 natively, and why: bf16 is ~2× faster than fp32 there, 4–5× slower elsewhere
    (emulated on AVX2-only CPUs). KVBENCH_NO_BF16=1 answers no on a CPU, so an AVX-512 machine runs (and CI tests)
    what an AVX2-only one does: fp32, twice the cache bytes."""
    if device.type == "cpu" and os.environ.get("KVBENCH_NO_BF16") == "1":
        return False, "KVBENCH_NO_BF16=1: as on a CPU without AVX512-BF16/AMX"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return True, f"{name} supports bf16"
        return False, f"{name} has no native bf16"
    flags = cpu_flags()
    found = [f for f in NATIVE_BF16_CPU_FLAGS if f in flags] + (["bf16"] if "bf16" in flags else [])
    if found:
        return True, f"the CPU has {'/'.join(found)}"
    return False, "the CPU has no AVX512-BF16/AMX (bf16 would be emulated, 4-5x slower than fp32)"


def resolve_dtype(dtype: str, device: torch.device | None = None) -> torch.dtype:
    """auto: bf16 where the hardware runs it natively (CUDA with bf16, CPU with AVX512-BF16/AMX, unless
    KVBENCH_NO_BF16=1), else fp32."""
    if dtype == "auto":
        native, why = native_bf16(device or torch.device("cpu"))
        chosen = torch.bfloat16 if native else torch.float32
        print(f"[kvbench] dtype=auto -> {str(chosen).removeprefix('torch.')} ({why})")
        return chosen
    if dtype not in DTYPES:
        raise KvbenchError(f"dtype={dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
