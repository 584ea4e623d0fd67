"""Decode ms/token of bounded caches vs the full cache, and H2O's prefill cost, measured in one run.

    python scripts/bench_decode.py [--model smollm2-135m] [--lengths 1024 4096] [--decode-tokens 16] [--repeats 2]
                                   [--dtype bfloat16] [--evict-every 32]

Per context length, on one random prompt: the prefill time with H2O's statistics (every query's attention column
sums) over the plain prefill's, and the decode ms/token of the full cache, StreamingLLM 0.5 and H2O 0.5 (per-step
eviction, evict_every=1, the originals; and in blocks, evict_every=K; StreamingLLM also in a ring buffer, ring=true:
per-step eviction's tokens, no per-step copy) and KIVI-4 (dequantize-then-attend, the
path before packed attention, and attention on the packed groups). Each figure is the best of `repeats`, the
configurations interleaved within each repeat; ratios are to the full cache measured in this run (the machines
here are shared: compare ratios, not absolute numbers across runs). Decoding never stops at EOS.
"""

from __future__ import annotations

import argparse
import platform
from contextlib import contextmanager

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.attention import StatsRequest
from kvbench.engine import Engine
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.methods.kivi import KiviLayer
from kvbench.models import load_model

CONFIGS = [  # (label, method, knobs, budget, packed KIVI attention)
    ("full", "full", {}, None, True),
    ("streamingllm 0.5, evict_every=1", "streamingllm", {"evict_every": 1}, 0.5, True),
    ("streamingllm 0.5, evict_every=K", "streamingllm", {}, 0.5, True),
    ("streamingllm 0.5, ring", "streamingllm", {"ring": True}, 0.5, True),
    ("h2o 0.5, evict_every=1", "h2o", {"evict_every": 1}, 0.5, True),
    ("h2o 0.5, evict_every=K", "h2o", {}, 0.5, True),
    ("kivi-4, dequantize then attend", "kivi", {"bits": 4}, None, False),
    ("kivi-4, packed attention", "kivi", {"bits": 4}, None, True),
]


@contextmanager
def kivi_path(packed: bool):
    """KIVI's attention on the packed groups, or (packed=False) the dense path it replaced: dequantize, then sdpa."""
    if packed:
        yield
        return
    real = KiviLayer.attend
    KiviLayer.attend = lambda self, query, scaling: None  # type: ignore[method-assign]  # None: the dense path
    try:
        yield
    finally:
        KiviLayer.attend = real  # type: ignore[method-assign]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--evict-every", type=int, default=32, help="K: the block size of the block-eviction rows")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kivi-group", type=int, default=64, help="KIVI group_size = residual_length (≤ head_dim)")
    parser.add_argument(
        "--only", nargs="+", default=None, help="run only the rows whose label contains one of these (full always runs)"
    )
    args = parser.parse_args()
    configs = [c for c in CONFIGS if c[0] == "full" or args.only is None or any(o in c[0] for o in args.only)]

    lm = load_model(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"), args.device, args.dtype)
    engine = Engine(lm)
    engine.eos_ids = set()  # always the same number of decode steps
    print(f"{args.model} {args.dtype} on {cpu_name()}, {torch.get_num_threads()} torch thread(s); shared machine")
    vocab = min(lm.config.vocab_size, len(lm.tokenizer))
    generator = torch.Generator().manual_seed(0)
    table = []
    for length in args.lengths:
        ids = torch.randint(vocab, (length,), generator=generator).tolist()
        prefill_s: dict[str, list[float]] = {"plain": [], "h2o": []}
        decode_ms: dict[str, list[float]] = {label: [] for label, *_ in configs}
        with_h2o = any(name == "h2o" for _, name, *_ in configs)  # its prefill (statistics) only when it runs
        for _ in range(args.repeats):
            plain = engine.prefill(ids, StatsRequest())
            h2o = engine.prefill(ids, StatsRequest(all_queries=True)) if with_h2o else plain
            prefill_s["plain"].append(plain.seconds)
            prefill_s["h2o"].append(h2o.seconds)
            for label, name, knobs, budget, packed in configs:
                knobs = {
                    **method_defaults(name),
                    **({"evict_every": args.evict_every} if "=K" in label else {}),
                    **knobs,
                }
                if name == "kivi":
                    knobs.update(group_size=args.kivi_group, residual_length=args.kivi_group)
                method = build_method(name, knobs)
                prefill = h2o if name == "h2o" else plain
                with kivi_path(packed):
                    gen = engine.generate(
                        prefill, method, Budget.parse(budget) if budget else None, [], args.decode_tokens + 1
                    )
                decode_ms[label].append(gen.decode_ms_per_token)
            del plain, h2o
        ratio = min(prefill_s["h2o"]) / min(prefill_s["plain"])
        full = min(decode_ms["full"])
        print(f"\n{length} tokens: prefill {min(prefill_s['plain']):.2f} s plain", end="", flush=True)
        print(f", {min(prefill_s['h2o']):.2f} s with H2O's statistics: ×{ratio:.2f}" if with_h2o else "", flush=True)
        for label, *_ in configs:
            best = min(decode_ms[label])
            shown = label.replace("=K", f"={args.evict_every}")
            print(f"  {shown:<36} {best:7.1f} ms/token  ×{best / full:.2f} of full", flush=True)
            table.append((length, shown, best, best / full))
        if with_h2o:
            table.append((length, "H2O prefill / plain prefill", ratio, None))
    print("\n| context | configuration | decode ms/token | vs full |\n|---|---|---|---|")
    for length, label, value, vs_full in table:
        if vs_full is None:
            print(f"| {length} | {label} | ×{value:.2f} (prefill time) | |")
        else:
            print(f"| {length} | {label} | {value:.1f} | ×{vs_full:.2f} |")


if __name__ == "__main__":
    main()
