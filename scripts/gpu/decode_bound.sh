#!/usr/bin/env bash
# A sweep at the physical limit on a GPU (docs/benchmarks.md "A sweep at the physical limit"): Llama-3.1-8B's
# architecture (random weights) at 4K, batch 1 — the CUDA graph decode's exactness test (tokens and bytes equal to
# eager), one row's step eager and captured (decode_graph=true) against the bandwidth bound, a grid step of B rows
# against one row's, and the statistics' cost; then the bundled model's sweep against the full cache and plain
# transformers. A few minutes on an H100/H200. No internet: it uses what is installed.
#
#   bash scripts/gpu/decode_bound.sh [OUT_FILE]       # default outputs/gpu-decode-bound/<UTC time>.txt
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-outputs/gpu-decode-bound/$(date -u +%Y%m%d-%H%M%S).txt}
[ -x "$PY" ] || { echo "decode_bound.sh: missing: $PY (kvbench's venv: make install)"; exit 2; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null ||
  { echo "decode_bound.sh: missing: a CUDA build of torch in $PY; nothing run"; exit 2; }
mkdir -p "$(dirname "$OUT")"
arch=(model=llama-3.1-8b-arch device=cuda dtype=bfloat16 'task.context_lengths=[4096]' 'task.depths=[0.5]')
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  "$PY" -m pytest -q tests/native/test_graph_decode.py -k "captured or replayed" -rs
  "$PY" -m kvbench.bench decode "${arch[@]}"
  "$PY" -m kvbench.bench stats "${arch[@]}"
  "$PY" -m kvbench.bench sweep device=cuda dtype=float32
} 2>&1 | grep -v "example/s" | tee "$OUT"
