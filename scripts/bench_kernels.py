"""Triton attention-column-sums kernel vs the torch reference on CUDA: agreement and speed.

    python scripts/bench_kernels.py        (needs a CUDA GPU and triton)

Shapes of Llama-3.1-8B (H_q=32, H_kv=8, D=128), bf16; Q=T is H2O's prefill statistic, Q=32 SnapKV's window.
"""

import time

import torch

from kvbench.kernels import attention_column_sums
from kvbench.kernels import attention_column_sums_reference as reference
from kvbench.kernels.triton_stats import triton_attention_column_sums as triton_sums


def timeit(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'T':>6} {'Q':>6} {'triton ms':>10} {'torch ms':>10} {'speed-up':>9} {'err/max':>9}")
    for n_keys in (4096, 8192, 16384):
        for n_queries in (n_keys, 32):
            q = torch.randn(1, 32, n_keys, 128, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :, -n_queries:]
            k = torch.randn(1, 8, n_keys, 128, device="cuda", dtype=torch.bfloat16, generator=gen)  # (B, H_kv, T, D)
            scale = 128**-0.5
            want, got = reference(q, k, scale), triton_sums(q, k, scale)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert torch.equal(attention_column_sums(q, k, scale), got)  # the dispatcher picks Triton on CUDA
            err = ((got - want).abs().max() / want.abs().max()).item()
            t_triton = timeit(lambda: triton_sums(q, k, scale), 20)
            t_torch = timeit(lambda: reference(q, k, scale), 3 if n_queries == n_keys else 20)
            print(f"{n_keys:>6} {n_queries:>6} {t_triton:>10.3f} {t_torch:>10.2f} {t_torch / t_triton:>8.1f}x {err:>9.1e}")


if __name__ == "__main__":
    main()
