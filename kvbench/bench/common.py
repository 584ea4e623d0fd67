"""What every benchmark shares: the configuration composed and checked as `python -m kvbench` does, the machine named,
best-of timing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from kvbench import KvbenchError, conf_dir


def compose(overrides: list[str], *defaults: str):
    """kvbench's configuration with `defaults` then the user's `overrides` (theirs win); a refused override is one
    line. `report=false`: a benchmark's runs write no plots."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=["report=false", *defaults, *overrides])
    except (HydraException, OmegaConfBaseException) as error:
        raise KvbenchError(f"{str(error).splitlines()[0]} (overrides: {' '.join(overrides) or 'none'})") from None


def machine(device: torch.device) -> str:
    """The device, as rows name it, with what decides its speed: the torch threads and, on a CPU, whether it has
    native bf16 (AVX512-BF16 / AMX) — without it `dtype=auto` is fp32."""
    from kvbench.model.device import NATIVE_BF16_CPU_FLAGS, cpu_flags
    from kvbench.store.results import device_name

    if device.type == "cuda":
        return device_name(device)
    bf16 = "native bf16" if set((*NATIVE_BF16_CPU_FLAGS, "bf16")) & cpu_flags() else "no native bf16 (AVX2-class)"
    forced = ", KVBENCH_NO_BF16=1" if os.environ.get("KVBENCH_NO_BF16") == "1" else ""
    return f"{device_name(device)}, {bf16}{forced}, {torch.get_num_threads()} torch threads"


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The least-contended of `repeats` timed calls (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
