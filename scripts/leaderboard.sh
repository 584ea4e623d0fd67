#!/usr/bin/env bash
# kvpress's leaderboard protocol on one model (docs/leaderboard.md): every part this machine can run, into one store,
# then the leaderboard page (sortable table + kvpress's plot) from that store.
#   bash scripts/leaderboard.sh [MODEL] [OVERRIDE ...]        e.g. bash scripts/leaderboard.sh gemma3-270m task.num_samples=2
# MODEL: a conf/model name (default smollm2-135m). OVERRIDEs go to every part (task.num_samples, task.tasks,
# grid.budget, device, dtype, model.*); not grid.method, which each part (conf/leaderboard/) sets itself.
#   1. kvbench's native methods, query-agnostic and query-aware (+experiment=leaderboard: two Hydra jobs);
#   2. kvpress's presses without a native counterpart, in .venv-kvpress (kvpress 0.5.5 pins transformers < 5.3, so
#      it cannot share the main venv): skipped in one line when that venv is not built (make test-kvpress);
#   3. the serving engines' own KV options (llama.cpp, vLLM, OpenVINO GenAI), each where its venv is built
#      (make engine-llamacpp|engine-vllm|engine-openvino);
#   4. python -m kvbench.report over the store: results/leaderboard/report/leaderboard.{html,md,csv}.
# A part a model cannot run (kvpress's hooks on sliding-window layers, a GGUF llama.cpp is not given) says so in one
# line and the others go on. LEADERBOARD_STORE / LEADERBOARD_REPORT move the store and the page.
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-135m}
shift $(($# > 0 ? 1 : 0))
store=${LEADERBOARD_STORE:-results/leaderboard/store}
report=${LEADERBOARD_REPORT:-results/leaderboard/report}
py=${PYTHON:-.venv/bin/python}
common=(+experiment=leaderboard "model=$model" "results_dir=$store" report=false "$@")
failed=0

part() {  # part NAME COMMAND...: run it; a refusal or failure is reported, the next part runs
  echo "[leaderboard] $1"
  "${@:2}" || { echo "[leaderboard] $1: did not finish (exit $?), see above"; failed=1; }
}

part "native methods, query-agnostic and query-aware" "$py" -m kvbench "${common[@]}"
if [ -x .venv-kvpress/bin/python ]; then
  part "kvpress's presses (.venv-kvpress)" env PYTHONPATH="$PWD" .venv-kvpress/bin/python -m kvbench "${common[@]}" \
    +leaderboard=kvpress_agnostic
else
  echo "[leaderboard] kvpress's presses skipped: .venv-kvpress is not built (make test-kvpress builds it)"
fi
for engine in llamacpp vllm openvino; do  # each engine's own options, in its own venv and process
  if [ -e ".venv-$engine/bin/python" ]; then
    part "$engine's options" "$py" -m kvbench "${common[@]}" "+leaderboard=$engine"
  else
    echo "[leaderboard] $engine's options skipped: .venv-$engine is not built (make engine-$engine builds it)"
  fi
done
"$py" -m kvbench.report "$store" --out "$report" || exit 1
echo "[leaderboard] page: $report/leaderboard.html (table: leaderboard.md, numbers: leaderboard.csv)"
exit $failed
