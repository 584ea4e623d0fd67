"""Decode ms/token of bounded caches vs the full cache, and H2O's prefill cost, measured in one run.

    python scripts/bench_decode.py [--model smollm2-135m] [--lengths 1024 4096] [--decode-tokens 16] [--repeats 2]
                                   [--dtype bfloat16] [--evict-every 32]

Per context length, on one random prompt: the prefill time with H2O's statistics (every query's attention column
sums) over the plain prefill's, and the decode ms/token of the full cache, StreamingLLM 0.5 and H2O 0.5 (per-step
eviction, evict_every=1, the originals; and in blocks, evict_every=K; StreamingLLM also in a ring buffer, ring=true:
per-step eviction's tokens, no per-step copy) and KIVI-4 (dequantize-then-attend, the
path before packed attention, and attention on the packed groups: by the torch version, and by the dispatcher's
choice — the C kernel on the CPU); and the full cache with torch's products and sdpa in the decode step instead of the
C decode kernels (what every row paid before them). Each figure is the best of `repeats`, the
configurations interleaved within each repeat; ratios are to the full cache measured in this run (the machines
here are shared: compare ratios, not absolute numbers across runs). Decoding never stops at EOS.
"""

from __future__ import annotations

import argparse
import os
from contextlib import ExitStack, nullcontext
from unittest import mock

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.engine.engine import Engine
from kvbench.kernels import decode_attention, decode_linear
from kvbench.methods import Budget, build_method
from kvbench.methods.kivi import KiviLayer
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.store.results import device_name


def bench_rows(evict_every: int, kivi_group: int) -> list[tuple[str, str, dict, float | None, str]]:
    """(label, method, knobs, budget, KIVI attention path: kivi_path) per row; a label's "=K" is shown as
    evict_every."""
    block = {"evict_every": evict_every}
    kivi = {"bits": 4, "group_size": kivi_group, "residual_length": kivi_group}
    return [
        ("full", "full", {}, None, "packed"),
        ("full, torch products + sdpa", "full", {}, None, "torch-decode"),
        ("streamingllm 0.5, evict_every=1", "streamingllm", {"evict_every": 1}, 0.5, "packed"),
        ("streamingllm 0.5, evict_every=K", "streamingllm", block, 0.5, "packed"),
        ("streamingllm 0.5, ring", "streamingllm", {"ring": True}, 0.5, "packed"),
        ("h2o 0.5, evict_every=1", "h2o", {"evict_every": 1}, 0.5, "packed"),
        ("h2o 0.5, evict_every=K", "h2o", block, 0.5, "packed"),
        ("kivi-4, dequantize then attend", "kivi", kivi, None, "dense"),
        ("kivi-4, packed attention, torch", "kivi", kivi, None, "torch"),
        ("kivi-4, packed attention", "kivi", kivi, None, "packed"),
    ]


def kivi_path(path: str):
    """KIVI's attention on the packed groups by the dispatcher's choice (path="packed": the C kernel on the CPU), by
    the torch version (path="torch": C kernels off), or the dense path they replaced (path="dense": dequantize, then
    sdpa); path="torch-decode": the decode step's linear layers and attention by torch (nn.Linear, sdpa) instead of
    the C decode kernels (kvbench/kernels/decode_linear.py, kvbench/kernels/decode_attention.py), everything else as is."""
    if path == "torch-decode":
        stack = ExitStack()
        for module in (decode_linear, decode_attention):
            stack.enter_context(mock.patch.object(module, "applies", lambda *a: False))
        return stack
    if path == "dense":
        return mock.patch.object(KiviLayer, "attend", lambda *a: None)  # None: the attention function's dense path
    return mock.patch.dict(os.environ, {"KVBENCH_NO_CPU_EXT": "1"}) if path == "torch" else nullcontext()


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
    rows = bench_rows(args.evict_every, args.kivi_group)
    rows = [r for r in rows if r[0] == "full" or args.only is None or any(o in r[0] for o in args.only)]
    # each row's prefill records what its method asks for; rows asking the same share one prefill per repeat
    requests = {label: build_method(name, knobs).stats_request() for label, name, knobs, *_ in rows}
    plain = StatsRequest()
    distinct = list(dict.fromkeys([plain, *requests.values()]))  # the plain prefill first
    h2o = next((requests[label] for label, name, *_ in rows if name == "h2o"), None)  # its ratio when an H2O row runs

    lm = load_model(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"), args.device, args.dtype)
    engine = Engine(lm)
    engine.eos_ids = set()  # always the same number of decode steps
    threads = torch.get_num_threads()
    print(f"{args.model} {args.dtype} on {device_name(lm.device)}, {threads} torch thread(s); shared machine")
    vocab = min(lm.config.vocab_size, len(lm.tokenizer))
    generator = torch.Generator().manual_seed(0)
    table: list[tuple[int, str, float, float | None]] = []
    for length in args.lengths:
        ids = torch.randint(vocab, (length,), generator=generator).tolist()
        prefill_s: dict[StatsRequest, list[float]] = {request: [] for request in distinct}
        decode_ms: dict[str, list[float]] = {label: [] for label, *_ in rows}
        for _ in range(args.repeats):
            prefills = {request: engine.prefill(ids, request) for request in distinct}
            for request, prefill in prefills.items():
                prefill_s[request].append(prefill.seconds)
            for label, name, knobs, budget, path in rows:
                method, prefill = build_method(name, knobs), prefills[requests[label]]
                with kivi_path(path):
                    gen = engine.generate(
                        prefill, method, Budget.parse(budget) if budget else None, [], args.decode_tokens + 1
                    )
                decode_ms[label].append(gen.decode_ms_per_token)
            del prefills
        full = min(decode_ms["full"])
        line, ratio = f"\n{length} tokens: prefill {min(prefill_s[plain]):.2f} s plain", None
        if h2o is not None:
            ratio = min(prefill_s[h2o]) / min(prefill_s[plain])
            line += f", {min(prefill_s[h2o]):.2f} s with H2O's statistics: ×{ratio:.2f}"
        print(line, flush=True)
        for label, *_ in rows:
            best = min(decode_ms[label])
            shown = label.replace("=K", f"={args.evict_every}")
            print(f"  {shown:<36} {best:7.1f} ms/token  ×{best / full:.2f} of full", flush=True)
            table.append((length, shown, best, best / full))
        if ratio is not None:
            table.append((length, "H2O prefill / plain prefill", ratio, None))
    print("\n| context | configuration | decode ms/token | vs full |\n|---|---|---|---|")
    for length, label, value, vs_full in table:
        if vs_full is None:
            print(f"| {length} | {label} | ×{value:.2f} (prefill time) | |")
        else:
            print(f"| {length} | {label} | {value:.1f} | ×{vs_full:.2f} |")


if __name__ == "__main__":
    main()
