#!/usr/bin/env bash
# Serving under a KV memory budget on a GPU (issue 35): the same commands as docs/serving.md, at GPU sizes, with
# absolute timings. No internet: it uses what is installed and names in one line what is missing, then runs the
# rest. About 5 minutes of device time on an H200 (SmolLM2-135M and Gemma 3 270M, 32 requests each).
#
#   bash scripts/gpu/serving.sh [OUT_DIR]          # default outputs/gpu-serving/<UTC time>
#
# Per model: kvbench's scheduler (full, SnapKV, StreamingLLM, KIVI) at two KV budgets, the first one where the full
# cache must queue; vLLM's continuous batching beside it where a CUDA build of vLLM is in .venv-vllm (the CPU build
# is skipped: it would time the CPU); then the prefix-caching table. Everything lands in OUT_DIR/<model>/.
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-outputs/gpu-serving/$(date -u +%Y%m%d-%H%M%S)}
PY=${PYTHON:-.venv/bin/python}
missing=()
command -v nvidia-smi >/dev/null 2>&1 || missing+=("nvidia-smi (no NVIDIA driver)")
[ -x "$PY" ] || { echo "serving.sh: missing: $PY (kvbench's venv: make install)"; exit 2; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null ||
  missing+=("a CUDA build of torch in $PY")
if [ ${#missing[@]} -gt 0 ]; then
  echo "serving.sh: missing: ${missing[*]}; nothing run"
  exit 2
fi
models=()
for m in smollm2-135m gemma3-270m; do
  "$PY" -c "import importlib.util, sys; from omegaconf import OmegaConf; \
sys.exit(0 if importlib.util.find_spec(OmegaConf.load('conf/model/$m.yaml').package) else 1)" 2>/dev/null &&
    models+=("$m") || echo "serving.sh: missing: model $m's package (see conf/model/$m.yaml); skipped"
done
engines="serving.engines=null"
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  engines="serving.engines=[vllm:full,vllm:fp8]"
else
  echo "serving.sh: missing: a CUDA build of vLLM in .venv-vllm; kvbench's scheduler only (the CPU engines would time the CPU)"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 | sed 's/^/serving.sh: GPU: /'
# per model: one 2K request's uncompressed K/V (bf16) -> budgets where the full cache holds ~4 and ~32 requests
declare -A per_token=([smollm2-135m]=23040 [gemma3-270m]=18432)
for m in "${models[@]}"; do
  small=$(( per_token[$m] * 2200 * 4 ))
  large=$(( per_token[$m] * 2200 * 32 ))
  echo "serving.sh: $m at KV budgets $small and $large bytes"
  timeout 900 "$PY" -m kvbench +experiment=serving model=$m device=cuda dtype=bfloat16 serving.hardware=h200 \
    'task.context_lengths=[1024,2048]' serving.requests=32 serving.rate=16 \
    "serving.kv_budget_bytes=[$small,$large]" 'grid.method=[snapkv,streamingllm,kivi]' 'grid.budget=[0.25]' \
    "$engines" "serving.out=$OUT/$m" hydra.run.dir="$OUT/$m/hydra" ||
    echo "serving.sh: the serving run of $m failed (exit $?); see above"
  prefix_engines=()
  [ "$engines" != "serving.engines=null" ] && prefix_engines=(--engines vllm) || prefix_engines=(--engines)
  timeout 600 "$PY" -m kvbench.serving.prefix --model "$m" --device cuda --requests 10 --context 2048 \
    "${prefix_engines[@]}" \
    --out "$OUT/$m" || echo "serving.sh: the prefix-caching table of $m failed (exit $?)"
done
echo "serving.sh: results in $OUT (serving_runs.parquet, serving.md, prefix_serving.md per model)"
