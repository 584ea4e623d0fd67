"""Optional kernel backends, by name: the one way kvbench's core (and kvbench.kernels' own torch code) reaches them.

`backend("cpu")` is kvbench.kernels.cpu — C kernels for the CPU, built with the machine's C compiler — or None: the
folder is not there (an install without it), or KVBENCH_NO_CPU_EXT=1 (read at every call: benchmarks switch it within
a process). None, or an operation answering None / False, means the caller runs its torch path, which is the
reference: the backend only ever makes a CPU run faster (and, for the decode step, row-independent).

Nothing outside kvbench.kernels.cpu imports it (tests/test_layout.py): this module loads it by name, so deleting the
folder leaves every CPU path working (tests/kernels/test_backend.py runs the tiny model so).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvbench.kernels.kivi_attention import KiviStorage

ENGINES = {"cpu": "kvbench.kernels.cpu"}  # name -> the module that implements it


class CpuKernels(Protocol):
    """What kvbench.kernels.cpu offers (its module docstring says which kernels and why). Each operation takes what
    its kernel can take and answers None / False / 0 otherwise (or where the kernel did not build): then torch."""

    def enabled(self) -> bool: ...

    def install(self, model: nn.Module) -> int:
        """Build every kernel (no first build inside a timed step); route the model's decode-step linear layers
        through the row-independent kernel. Returns how many layers it took."""
        ...

    def rows_independent(self, model: nn.Module) -> bool:
        """Whether the model's decode steps give each row its batch-1 bits (installed, and every layer taken)."""
        ...

    def decode_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        lengths: list[int] | None = None,
    ) -> torch.Tensor | None:
        """One query per row: softmax(q·kᵀ·scale)·v over each row's first lengths[b] tokens → (B, 1, H_q, D)."""
        ...

    def causal_column_sums(self, rows: torch.Tensor, key: torch.Tensor, out: torch.Tensor) -> bool:
        """out (B, H_kv, G, T) += Σ_i causal softmax(rows_i·Kᵀ), rows (B, H_kv, G, Q, D) in log2 units."""
        ...

    def bf16_column_sums(self) -> bool:
        """Whether bf16 rows' column sums take AVX512-BF16 dot products (summed in their own order) on this build."""
        ...

    def compact_tokens(self, tensor: torch.Tensor, index: torch.Tensor) -> bool:
        """Keep positions `index` (1, H, N) of `tensor` (1, H, T, D) in its slots [0, N), in place."""
        ...

    def kivi_decode_attention(self, query: torch.Tensor, storage: KiviStorage, scaling: float) -> torch.Tensor | None:
        """kvbench/kernels/kivi_attention.packed_decode_attention (to fp32 summation order)."""
        ...


def backend(name: str) -> CpuKernels | None:
    """The backend `name` (a key of ENGINES) when it is installed and switched on, else None."""
    try:
        module = importlib.import_module(ENGINES[name])
    except ImportError:  # the folder is not there (or cannot import here): the torch paths
        return None
    # the module's functions are the interface's operations (tests/kernels/test_backend.py checks every signature)
    return cast(CpuKernels, module) if module.enabled() else None
