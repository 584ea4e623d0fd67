#!/usr/bin/env bash
# Every serving engine's KV options beside kvbench's own methods on the same examples, into one store, then the
# report (its "Serving engines" section: parity, the engines' plot, what each engine offers) (docs/engine.md).
#   bash scripts/engines.sh [MODEL] [OVERRIDE ...]     e.g. bash scripts/engines.sh gemma3-270m
# MODEL: a conf/model name (default smollm2-135m). OVERRIDEs go to every run (dtype, task.*, limit).
# TASKS (default "niah ruler"): NIAH at 2K over 5 depths (n=5 per option: the fewest that give an interval) and the
# official RULER at 2K, its 13 tasks with one sample each (n=13). ENGINES (default "kvbench llamacpp vllm openvino").
# GRID_<engine> replaces an engine's options, e.g. GRID_llamacpp="grid.method=[q8_0,q4_0,snapkv] grid.budget=[0.25]"
# (llama.cpp's 2K prefill, once per option, is the slow one here).
# An engine whose venv is not built, or that cannot run the model, says so in one line and the others go on.
# ENGINES_STORE (default outputs/engines-store) and ENGINES_REPORT move the store and the report (ENGINES_REPORT=none:
# no report, for a chain of calls into one store).
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-135m}
shift $(($# > 0 ? 1 : 0))
store=${ENGINES_STORE:-outputs/engines-store}
report=${ENGINES_REPORT:-$store/report}
py=${PYTHON:-.venv/bin/python}
failed=0

declare -A task_args=(
  [niah]="task=niah task.context_lengths=[2048] task.depths=[0.1,0.3,0.5,0.7,0.9]"
  [ruler]="task=ruler task.context_lengths=[2048] task.num_samples=1 task.max_new_tokens=32"
)
declare -A grids=(  # every option each engine runs on this CPU (`full` is always run: its baseline)
  [kvbench]="grid.method=[snapkv,streamingllm,kivi,{name:kivi,bits:8},{name:turboquant,preset:turboquant_k8v4}] grid.budget=[0.25]"
  [llamacpp]="grid.method=[q8_0,q4_0,k_q8_0,k_q8_0_v_q4_0,k_q4_0_v_q8_0,streamingllm,snapkv] grid.budget=[0.25]"
  [vllm]="grid.method=[fp8_e4m3,fp8_e5m2]"
  [openvino]="grid.method=[u8,u4,sum,norm_sum,kvcrush] grid.budget=[0.25]"
)

for task in ${TASKS:-niah ruler}; do
  [ -n "${task_args[$task]:-}" ] || { echo "engines.sh: TASKS=$task: use niah and/or ruler"; exit 2; }
done
for engine in ${ENGINES:-kvbench llamacpp vllm openvino}; do
  [ -n "${grids[$engine]:-}" ] || { echo "engines.sh: ENGINES=$engine: use kvbench, llamacpp, vllm and/or openvino"; exit 2; }
done

for task in ${TASKS:-niah ruler}; do
  for engine in ${ENGINES:-kvbench llamacpp vllm openvino}; do
    echo "[engines] $model $task $engine"
    grid_var="GRID_$engine"
    # shellcheck disable=SC2086  # the args are word lists on purpose
    "$py" -m kvbench "model=$model" ${task_args[$task]} "engine=$engine" ${!grid_var:-${grids[$engine]}} fidelity=false report=false \
      "results_dir=$store" "$@" || { echo "[engines] $model $task $engine: did not finish (exit $?)"; failed=1; }
  done
done
if [ "$report" != none ]; then "$py" -m kvbench.report "$store" --out "$report" || failed=1; fi
exit $failed
