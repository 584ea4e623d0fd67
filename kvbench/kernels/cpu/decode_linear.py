"""The model's linear layers for the few rows of a decode step, on the CPU: csrc/decode_linear.c.

Why: a grid of configurations decodes as one batch (kvbench/native/grid_decode.py) only if each row comes out as it does
decoded alone, and torch's CPU products round a row by the batch's row count (MKL's float32 one-row gemv and
several-row gemm sum in different orders; oneDNN's bfloat16 kernels at some row counts). The C kernel computes every
output the same way whatever the row count and thread count (its contract is in its header), so in a decode step
of ≤ MAX_ROWS rows each row is bit for bit its batch-1 self, in float32 and bfloat16. It also streams the weights —
what a decode step is bound by — once per four rows, which is faster than torch's small-row products here (the
README's decode table).

`install(model)` swaps the class of every plain `nn.Linear` to `DecodeLinear` (weights untouched): forward passes of
more than MAX_ROWS rows (prefills, long suffixes), other dtypes, a bias, autograd or no C kernel
(KVBENCH_NO_CPU_EXT=1, no compiler) run `nn.Linear.forward` unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvbench.kernels.cpu import build

# rows (batch × tokens) a forward pass may have for the kernel: decode steps, short suffixes, a grid's decode batch
# (kvbench.native.grid_decode.MAX_ROWS, tested equal)
MAX_ROWS = 16
DTYPES = (torch.float32, torch.bfloat16)


def _kernel():
    """The C function, or None (KVBENCH_NO_CPU_EXT=1 — read at every call —, no compiler)."""
    return _loaded() if build.enabled() else None


@functools.cache
def _loaded():
    return build.function("decode_linear", "pppillli")


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes this call (else nn.Linear's own product). Called for every linear layer of every
    forward: the row count first (a prefill's calls end there)."""
    return (
        0 < x.numel() // max(weight.shape[1], 1) <= MAX_ROWS
        and takes_weight(weight, bias)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.shape[-1] == weight.shape[1]
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def takes_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The layer's side of `applies`: what decides whether its decode steps can go through the kernel at all."""
    return (
        bias is None
        and weight.device.type == "cpu"
        and weight.dtype in DTYPES
        and weight.dim() == 2
        and weight.shape[1] > 0
        and weight.is_contiguous()
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x (..., K) @ weight (N, K)ᵀ → (..., N) by the C kernel, or None (no kernel, or the scratch failed)."""
    kernel = _kernel()
    if kernel is None:
        return None
    n_out, k_in = weight.shape
    rows = x.reshape(-1, k_in).contiguous()  # (M, K)
    n_rows = rows.shape[0]
    out = torch.empty(x.shape[:-1] + (n_out,), dtype=x.dtype)  # (..., N): the same memory as (M, N)
    bf16 = x.dtype == torch.bfloat16
    threads = torch.get_num_threads()
    status = kernel(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), bf16, n_rows, n_out, k_in, threads)
    return out if status == 0 else None


class DecodeLinear(nn.Linear):
    """nn.Linear whose decode-step products go through the C kernel (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if applies(input, self.weight, self.bias):
            out = linear(input, self.weight)
            if out is not None:
                return out
        return super().forward(input)


def install(model: nn.Module) -> int:
    """Swap every plain nn.Linear of a CPU model to DecodeLinear when the C kernel builds; returns how many
    modules are DecodeLinear afterwards (0: the model keeps torch's products everywhere). Idempotent."""
    if _kernel() is None:
        return 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = DecodeLinear
    return sum(isinstance(module, DecodeLinear) for module in model.modules())


def rows_independent(model: nn.Module) -> bool:
    """Whether the model's decode steps are row-independent through the kernel: every linear layer swapped, each
    one the kernel takes (no bias, float32/bfloat16, on the CPU, contiguous), all of one dtype."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return (
        bool(linears)
        and all(isinstance(m, DecodeLinear) and takes_weight(m.weight, m.bias) for m in linears)
        and len({m.weight.dtype for m in linears}) == 1
        and _kernel() is not None
    )
