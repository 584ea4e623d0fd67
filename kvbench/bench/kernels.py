"""Triton kernels vs their torch versions on CUDA: agreement and speed (no model loads).

    python -m kvbench.bench kernels                  attention column sums (needs a CUDA GPU and triton)
    python -m kvbench.bench kernels bench.kivi=true [bench.lengths=[4096,16384,32768]] [bench.kivi_bits=[4,2]]
                                    [bench.reps=50] [bench.out=kivi.csv]

Shapes of Llama-3.1-8B (H_q=32, H_kv=8, D=128), bf16. Column sums: Q=T is H2O's prefill statistic, Q=32 SnapKV's
window. bench.kivi=true: one decode step's attention alone, KIVI at kvbench's defaults (group 64, residual 64) on
random K/V, per context and bit width: the Triton kernel on the packed groups (kvbench/kernels/triton/kivi.py), the
torch version (kvbench/kernels/kivi_attention.py), dequantize-then-sdpa (KIVI's path with several queries) and sdpa on
the full bf16 cache, in ms (median of bench.reps), and the kernel's max error against dequantize-then-sdpa relative to
the largest output (it must agree with the torch version to one bf16 step). `device=cpu` with TRITON_INTERPRET=1 runs
the same KIVI code interpreted: a smoke check, its timings mean nothing. Without a CUDA device (or triton) the run is
refused in one line.
"""

from __future__ import annotations

import importlib.util
import os
import time
from functools import partial

import torch

from kvbench import KvbenchError
from kvbench.bench.common import checked, machine, options

OPTIONS = {"kivi": False, "lengths": [4096, 16384, 32768], "kivi_bits": [4, 2], "reps": 50, "out": None}


def timeit(fn, reps: int, device: torch.device) -> float:
    """Median ms of `reps` calls after one warm-up (compilation) call, synchronised on `device`."""
    from kvbench.native.memory import synchronize

    fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def bench_column_sums(device: torch.device) -> None:
    from kvbench.kernels import attention_column_sums
    from kvbench.kernels import attention_column_sums_reference as reference
    from kvbench.kernels.triton.stats import triton_attention_column_sums as triton_sums

    gen = torch.Generator(device=device).manual_seed(0)
    print(f"{'T':>6} {'Q':>6} {'triton ms':>10} {'torch ms':>10} {'speed-up':>9} {'err/max':>9}")
    for n_keys in (4096, 8192, 16384):
        for n_queries in (n_keys, 32):
            q = torch.randn(1, 32, n_keys, 128, device=device, dtype=torch.bfloat16, generator=gen)[:, :, -n_queries:]
            k = torch.randn(1, 8, n_keys, 128, device=device, dtype=torch.bfloat16, generator=gen)  # (B, H_kv, T, D)
            scale = 128**-0.5
            want, got = reference(q, k, scale), triton_sums(q, k, scale)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert torch.equal(attention_column_sums(q, k, scale), got)  # the dispatcher picks Triton on CUDA
            err = ((got - want).abs().max() / want.abs().max()).item()
            t_triton = timeit(partial(triton_sums, q, k, scale), 20, device)
            t_torch = timeit(partial(reference, q, k, scale), 3 if n_queries == n_keys else 20, device)
            speedup = t_torch / t_triton
            print(f"{n_keys:>6} {n_queries:>6} {t_triton:>10.3f} {t_torch:>10.2f} {speedup:>8.1f}x {err:>9.1e}")


def kivi_row(query, keys, values, bits: int, group: int, residual: int, reps: int) -> dict:
    """One (context, bits) row of bench.kivi: ms of each path, and the kernel's error."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kvbench.kernels.kivi_attention import packed_decode_attention
    from kvbench.kernels.triton.kivi import triton_kivi_decode_attention
    from kvbench.methods.kivi import KiviLayer

    scale = query.shape[-1] ** -0.5
    layer = KiviLayer.from_kv(keys[:, :, :-1], values[:, :, :-1], bits, group, residual)
    view, _ = layer.update(keys[:, :, -1:], values[:, :, -1:])  # the storage one decode step attends to
    storage = view.storage()
    paths = {
        "triton_ms": lambda: triton_kivi_decode_attention(query, storage, scale),  # (B, 1, H_q, D)
        "torch_packed_ms": lambda: packed_decode_attention(query, storage, scale),
        "dequant_sdpa_ms": lambda: sdpa(query, *view.kv(), scale=scale, enable_gqa=True).transpose(1, 2),  # type: ignore[misc]
        "full_sdpa_ms": lambda: sdpa(query, keys, values, scale=scale, enable_gqa=True).transpose(1, 2),
    }
    got, exact = paths["triton_ms"]().float(), paths["torch_packed_ms"]().float()
    assert (got - exact).abs().max() <= 2**-7 * exact.abs().max(), "triton and torch KIVI attention disagree"
    want = paths["dequant_sdpa_ms"]().float()  # rounds every dequantized element to bf16, then attends in bf16
    row = dict(context=keys.shape[2], bits=bits, group_size=group, residual_length=residual)
    row.update({name: timeit(fn, reps, query.device) for name, fn in paths.items()})
    return row | dict(rel_err=((got - want).abs().max() / want.abs().max()).item())


def bench_kivi_attention(device: torch.device, opts: dict) -> None:
    import pandas as pd

    from kvbench.rows.configuration import method_config

    config = method_config("kivi")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    print(f"{'T':>6} {'bits':>4} {'triton':>8} {'torch':>8} {'deq+sdpa':>9} {'full':>8} {'vs deq':>7} {'vs full':>8} "
          f"{'err/max':>8}   (ms)", flush=True)  # fmt: skip
    for length in opts["lengths"]:
        shape = (1, 8, length, 128)  # (B, H_kv, T, D)
        keys, values = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in "kv")
        query = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16, generator=gen)  # (B, H_q, 1, D)
        for bits in opts["kivi_bits"]:
            r = kivi_row(query, keys, values, bits, config["group_size"], config["residual_length"], opts["reps"])
            rows.append(r)
            speedup = r["dequant_sdpa_ms"] / r["triton_ms"], r["full_sdpa_ms"] / r["triton_ms"]
            print(f"{length:>6} {bits:>4} {r['triton_ms']:>8.3f} {r['torch_packed_ms']:>8.3f} "
                  f"{r['dequant_sdpa_ms']:>9.3f} {r['full_sdpa_ms']:>8.3f} {speedup[0]:>6.2f}x {speedup[1]:>7.2f}x "
                  f"{r['rel_err']:>8.1e}", flush=True)  # fmt: skip
    if opts["out"]:
        pd.DataFrame(rows).to_csv(opts["out"], index=False)


def main(overrides: list[str]) -> None:
    from kvbench.model.device import resolve_device

    opts, overrides = options(overrides, OPTIONS, "kernels")
    spec, _ = checked(overrides, "device=cuda", "method=full")  # device=cuda without a GPU: one line
    device = resolve_device(spec.device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not (opts["kivi"] and interpreted):
        raise KvbenchError("the Triton kernels run on CUDA: device=cuda on a GPU (or bench.kivi=true device=cpu with "
                           "TRITON_INTERPRET=1, a smoke check)")  # fmt: skip
    if importlib.util.find_spec("triton") is None:
        raise KvbenchError("the Triton kernels need triton: pip install -e '.[kernels]'")
    print(f"kernels benchmark: {'KIVI decode attention' if opts['kivi'] else 'column sums'} on {machine(device)}")
    bench_kivi_attention(device, opts) if opts["kivi"] else bench_column_sums(device)
