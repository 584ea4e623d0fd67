"""Latency and memory of compression methods on a real architecture with random weights (GPU benchmark).

    python scripts/bench_gpu.py [--model llama-3.1-8b-arch] [--lengths 4096 16384 32768]
                                [--methods full snapkv streamingllm h2o pyramidkv] [--budget 0.25]
                                [--decode-tokens 64] [--device cuda] [--out results.csv]

Per context length: one shared prefill (with the statistics every method needs), then per method: prefill_s
(shared prefill + compression), decode ms/token over a fixed number of greedy steps (EOS ignored), kv_bytes
held at the end, peak device memory. Random weights: the timings are real, the generated text is not. `kivi` in
--methods decodes on the packed groups with the Triton kernel (kernels/triton_kivi.py) on CUDA.

    python scripts/bench_gpu.py --kivi-attention [--lengths 4096 16384 32768] [--kivi-bits 4 2] [--out kivi.csv]

One decode step's attention alone, Llama-3.1-8B shapes (H_q=32, H_kv=8, D=128, bf16), KIVI at kvbench's defaults
(group 64, residual 64) on random K/V, per context and bit width: the Triton kernel on the packed groups
(kernels/triton_kivi.py), the torch version (kernels/kivi_attention.py), dequantize-then-sdpa (KIVI's path with
several queries) and sdpa on the full bf16 cache, in ms (median of --reps), and the kernel's max error against
dequantize-then-sdpa relative to the largest output (it must agree with the torch version to one bf16 step).
`--device cpu` with TRITON_INTERPRET=1 runs the same code interpreted: a smoke check, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvbench import conf_dir
from kvbench.attention import StatsRequest
from kvbench.engine import Engine
from kvbench.memory import read_peak, reset_peak, synchronize
from kvbench.methods import Budget, build_method
from kvbench.models import load_model
from kvbench.runner import method_config

CONF = conf_dir()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b-arch")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv", "streamingllm", "h2o", "pyramidkv"])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--kivi-attention", action="store_true", help="time KIVI decode attention alone (no model)")
    parser.add_argument("--kivi-bits", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--reps", type=int, default=50, help="timed calls per kernel (--kivi-attention)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.kivi_attention:
        return bench_kivi_attention(args)

    start = time.perf_counter()
    lm = load_model(OmegaConf.load(CONF / "model" / f"{args.model}.yaml"), args.device, args.dtype)
    print(f"loaded {args.model} ({sum(p.numel() for p in lm.model.parameters()) / 1e9:.2f} B params) on "
          f"{lm.device} in {time.perf_counter() - start:.1f} s", flush=True)
    engine = Engine(lm)
    engine.eos_ids = set()  # fixed-length decodes: random weights may emit EOS anywhere
    methods = [build_method(n, {k: v for k, v in method_config(n).items() if k != "name"}) for n in args.methods]
    request = StatsRequest()
    for m in methods:
        request = request | m.stats_request()
    gen = torch.Generator().manual_seed(0)
    engine.prefill(torch.randint(256, (256,), generator=gen).tolist(), request)  # warm-up (kernels, allocator)

    rows = []
    for length in args.lengths:
        ids = torch.randint(min(lm.config.vocab_size, 32000), (length,), generator=gen).tolist()
        plain = DynamicCache()  # prefill without statistics, to show what recording them costs
        reset_peak(lm.device)
        synchronize(lm.device)
        t0 = time.perf_counter()
        engine.forward(ids, list(range(length)), plain)
        synchronize(lm.device)
        plain_s, plain_peak = time.perf_counter() - t0, read_peak(lm.device)
        del plain
        prefill = engine.prefill(ids, request)
        for method in methods:
            budget = Budget.parse(args.budget) if method.has_budget else None
            out = engine.generate(prefill, method, budget, [], args.decode_tokens)
            rows.append(dict(model=args.model, context=length, method=method.name,
                             budget=budget.value if budget else 1.0, prefill_plain_s=plain_s,
                             prefill_with_stats_s=prefill.seconds, prefill_s=out.prefill_s,
                             decode_ms_per_token=out.decode_ms_per_token, kv_bytes=out.kv_bytes,
                             kv_ratio=out.kv_ratio, peak_mem_gib=out.peak_mem_bytes / 2**30,
                             plain_prefill_peak_gib=plain_peak / 2**30))
            print(f"{length:>6} {method.name:>12}: prefill {out.prefill_s:6.3f} s (plain {plain_s:.3f}, with stats "
                  f"{prefill.seconds:.3f}), decode {out.decode_ms_per_token:6.2f} ms/token, kv {out.kv_bytes / 2**20:8.1f}"
                  f" MiB (ratio {out.kv_ratio:.3f}), peak {out.peak_mem_bytes / 2**30:6.2f} GiB", flush=True)
        del prefill
        torch.cuda.empty_cache() if lm.device.type == "cuda" else None
    frame = pd.DataFrame(rows)
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.out:
        frame.to_csv(args.out, index=False)


def _median_ms(fn, reps: int, device: torch.device) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _kivi_row(query, keys, values, bits: int, group: int, residual: int, reps: int) -> dict:
    """One (context, bits) row of --kivi-attention: ms of each path, and the kernel's error."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kvbench.kernels.kivi_attention import packed_decode_attention
    from kvbench.kernels.triton_kivi import triton_kivi_decode_attention
    from kvbench.methods.kivi import _TENSORS, KiviLayer

    scale = query.shape[-1] ** -0.5
    layer = KiviLayer.from_kv(keys[:, :, :-1], values[:, :, :-1], bits, group, residual)
    view, _ = layer.update(keys[:, :, -1:], values[:, :, -1:])  # the storage one decode step attends to
    storage = [getattr(view, name) for name in _TENSORS]
    knobs = dict(key_bits=bits, value_bits=bits, group_size=group, scaling=scale)
    paths = {
        "triton_ms": lambda: triton_kivi_decode_attention(query, *storage, **knobs),  # (B, 1, H_q, D)
        "torch_packed_ms": lambda: packed_decode_attention(query, *storage, **knobs),
        "dequant_sdpa_ms": lambda: sdpa(query, *view.kv(), scale=scale, enable_gqa=True).transpose(1, 2),
        "full_sdpa_ms": lambda: sdpa(query, keys, values, scale=scale, enable_gqa=True).transpose(1, 2),
    }
    got, exact = paths["triton_ms"]().float(), paths["torch_packed_ms"]().float()
    assert (got - exact).abs().max() <= 2**-7 * exact.abs().max(), "triton and torch KIVI attention disagree"
    want = paths["dequant_sdpa_ms"]().float()  # rounds every dequantized element to bf16, then attends in bf16
    row = dict(context=keys.shape[2], bits=bits, group_size=group, residual_length=residual)
    row.update({name: _median_ms(fn, reps, query.device) for name, fn in paths.items()})
    return row | dict(rel_err=((got - want).abs().max() / want.abs().max()).item())


def bench_kivi_attention(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = method_config("kivi")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    print(f"{'T':>6} {'bits':>4} {'triton':>8} {'torch':>8} {'deq+sdpa':>9} {'full':>8} {'vs deq':>7} {'vs full':>8} "
          f"{'err/max':>8}   (ms)", flush=True)  # fmt: skip
    for length in args.lengths:
        keys, values = (torch.randn(1, 8, length, 128, device=device, dtype=dtype, generator=gen) for _ in "kv")
        query = torch.randn(1, 32, 1, 128, device=device, dtype=dtype, generator=gen)  # (B, H_q, 1, D)
        for bits in args.kivi_bits:
            r = _kivi_row(query, keys, values, bits, config["group_size"], config["residual_length"], args.reps)
            rows.append(r)
            speedup = r["dequant_sdpa_ms"] / r["triton_ms"], r["full_sdpa_ms"] / r["triton_ms"]
            print(f"{length:>6} {bits:>4} {r['triton_ms']:>8.3f} {r['torch_packed_ms']:>8.3f} "
                  f"{r['dequant_sdpa_ms']:>9.3f} {r['full_sdpa_ms']:>8.3f} {speedup[0]:>6.2f}x {speedup[1]:>7.2f}x "
                  f"{r['rel_err']:>8.1e}", flush=True)  # fmt: skip
    if args.out:
        pd.DataFrame(rows).to_csv(args.out, index=False)

if __name__ == "__main__":
    main()
