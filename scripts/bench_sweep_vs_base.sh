#!/usr/bin/env bash
# The same CLI sweep timed with two checkouts, interleaved old/new/old/new, and their rows compared.
#
#   scripts/bench_sweep_vs_base.sh OLD_PYTHON NEW_PYTHON [OUT_DIR]
#   # e.g. the code when issue 11 was filed (a17a282) against today's:
#   git worktree add --detach /work/wt/r1base a17a282   # + a venv with kvbench installed -e from it
#   KVBENCH_THREADS=1 scripts/bench_sweep_vs_base.sh /work/wt/r1base/.venv/bin/python .venv/bin/python
#
# Each interpreter runs `python -m kvbench` of the checkout it has installed (editable), from that checkout's root,
# with the same overrides: the full cache + grid.method × grid.budget (11 configurations by default) on NIAH at
# LENGTHS × DEPTHS, report=false, an explicit dtype, a fresh results_dir per run (nothing reused). Knobs (env):
#   DTYPES="float32 bfloat16"  REPS=2  KVBENCH_THREADS=1  LENGTHS=[1024,2048,4096]  DEPTHS=[0.1,0.5,0.9]
#   METHODS=[snapkv,pyramidkv,h2o,streamingllm,random]  BUDGETS=[0.25,0.5]  LOCK=/tmp/kvbench-bench.lock
#   ANALYZE_ONLY=1 (no runs: compare the runs already in OUT_DIR again)
# Threads: older code (before KVBENCH_THREADS existed) calls torch.set_num_threads(os.cpu_count()) when it loads the
# model, so both runs go through one launcher that caps torch.set_num_threads at KVBENCH_THREADS and prints the
# thread count the run ended with (checked below: a run at another count is an error). No kvbench code is changed.
# Prints per run: wall seconds (whole command), sweep seconds (the examples loop, kvbench's "rows computed ... in N s"),
# their difference (start-up + model load + writing); then per dtype the new/old ratios of the medians, the sweep split
# into the plain forward (the full rows' prefill_s) and the rest, and how many rows (example × configuration) agree in
# prediction and score between old and new (the differing rows listed), and between repeats of each.
set -euo pipefail
OLD_PY=$(realpath -s "$1") # -s: a venv's python is a symlink, resolving it leaves the venv
NEW_PY=$(realpath -s "$2")
OUT=$(realpath -m "${3:-/tmp/bench_sweep_vs_base/$(date +%Y%m%d-%H%M%S)}")
DTYPES=${DTYPES:-float32 bfloat16}
REPS=${REPS:-2}
LENGTHS=${LENGTHS:-[1024,2048,4096]}
DEPTHS=${DEPTHS:-[0.1,0.5,0.9]}
METHODS=${METHODS:-[snapkv,pyramidkv,h2o,streamingllm,random]}
BUDGETS=${BUDGETS:-[0.25,0.5]}
LOCK=${LOCK:-/tmp/kvbench-bench.lock}
export KVBENCH_THREADS=${KVBENCH_THREADS:-1}
export OMP_NUM_THREADS=$KVBENCH_THREADS
mkdir -p "$OUT"

# python -m kvbench with torch.set_num_threads capped at KVBENCH_THREADS; the final count goes to stderr
LAUNCH='
import atexit, os, runpy, sys
import torch
cap, _set = int(os.environ["KVBENCH_THREADS"]), torch.set_num_threads
def capped(n):
    print(f"torch.set_num_threads({n}) called: {min(int(n), cap)} threads", file=sys.stderr)
    _set(min(int(n), cap))
torch.set_num_threads = capped
torch.set_num_threads(cap)
atexit.register(lambda: print(f"torch threads at exit: {torch.get_num_threads()}", file=sys.stderr))
sys.argv = ["kvbench", *sys.argv[1:]]
runpy.run_module("kvbench", run_name="__main__", alter_sys=True)
'

checkout() { # the root of the checkout an interpreter's kvbench comes from
  (cd / && "$1" -c 'import kvbench, pathlib; print(pathlib.Path(kvbench.__file__).resolve().parent.parent)')
}
OLD_ROOT=$(checkout "$OLD_PY")
NEW_ROOT=$(checkout "$NEW_PY")
echo "old: $OLD_ROOT @ $(git -C "$OLD_ROOT" rev-parse --short HEAD)   new: $NEW_ROOT @ $(git -C "$NEW_ROOT" rev-parse --short HEAD)"
echo "sweep: full + $METHODS x $BUDGETS on niah $LENGTHS x $DEPTHS; threads $KVBENCH_THREADS; dtypes $DTYPES; $REPS reps"
echo "out: $OUT"

one() { # one timed run: one LABEL PYTHON ROOT DTYPE -> $OUT/LABEL/{log,time,rows.parquet}
  local label=$1 py=$2 root=$3 dtype=$4 dir=$OUT/$1
  mkdir -p "$dir"
  (cd "$root" && flock "$LOCK" /usr/bin/time -f "%e %P" -o "$dir/time" "$py" -c "$LAUNCH" \
    "grid.method=$METHODS" "grid.budget=$BUDGETS" "task.context_lengths=$LENGTHS" "task.depths=$DEPTHS" \
    "dtype=$dtype" report=false "results_dir=$dir/store" "hydra.run.dir=$dir" >"$dir/log" 2>&1) || {
    tail -5 "$dir/log"
    echo "$label failed"
    exit 1
  }
  local threads sweep
  threads=$(grep -o 'torch threads at exit: [0-9]*' "$dir/log" | grep -o '[0-9]*$')
  sweep=$(grep -o 'reused from the store, in [0-9]* s' "$dir/log" | grep -o '[0-9]* s$' | cut -d' ' -f1)
  [ "$threads" = "$KVBENCH_THREADS" ] || { echo "$label ran $threads torch threads, not $KVBENCH_THREADS"; exit 1; }
  local wall cpu
  read -r wall cpu <"$dir/time" # cpu: (user + system) / wall, 100% = one core busy
  printf '%-18s wall %7.1f s   sweep %5d s   start-up+load+write %5.1f s   threads %s   cpu %s\n' \
    "$label" "$wall" "$sweep" "$(echo "$wall - $sweep" | bc)" "$threads" "$cpu"
  echo "$sweep" >"$dir/sweep"
}

for dtype in $DTYPES; do
  [ -n "${ANALYZE_ONLY:-}" ] && break # ANALYZE_ONLY=1: only the comparison, of the runs already in OUT_DIR
  for rep in $(seq 1 "$REPS"); do
    one "$dtype-old-$rep" "$OLD_PY" "$OLD_ROOT" "$dtype"
    one "$dtype-new-$rep" "$NEW_PY" "$NEW_ROOT" "$dtype"
  done
done

"$NEW_PY" - "$OUT" "$REPS" $DTYPES <<'EOF'
import statistics, sys
from pathlib import Path

import pandas as pd

out, reps, dtypes = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
key = ["example_id", "method", "budget"]


def rows(label):
    frame = pd.read_parquet(out / label / "rows.parquet")
    return frame.set_index(key)[["prediction", "score", "kv_bytes"]].sort_index()


def agree(a, b):
    a, b = rows(a), rows(b)
    both = a.merge(b, left_index=True, right_index=True, suffixes=("_a", "_b"))
    same = (both.prediction_a == both.prediction_b) & (both.score_a == both.score_b)
    differ = both[~same].reset_index()
    text = f"{int(same.sum())}/{len(a)} rows agree in prediction and score"
    if not len(a) == len(b) == len(both):
        text += f" ({len(a)} vs {len(b)} rows, {len(both)} in both)"
    bytes_differ = both[both.kv_bytes_a != both.kv_bytes_b]  # the kept tokens (+ the generated ones) differ
    text += f"; kv_bytes equal in {len(both) - len(bytes_differ)}"
    if len(bytes_differ):
        ratio = bytes_differ.kv_bytes_b / bytes_differ.kv_bytes_a
        per_method = bytes_differ.groupby(level="method").size().to_dict()
        text += f" (differ: {per_method}, second/first {ratio.min():.4f}..{ratio.max():.4f})"
    return text, differ


def seconds(label, what):
    return float((out / label / what).read_text().split()[0])


print()
for dtype in dtypes:
    old = [f"{dtype}-old-{r}" for r in range(1, reps + 1)]
    new = [f"{dtype}-new-{r}" for r in range(1, reps + 1)]
    for what, name in (("time", "wall"), ("sweep", "sweep")):
        o = statistics.median(seconds(x, what) for x in old)
        n = statistics.median(seconds(x, what) for x in new)
        pairs = " ".join(f"{seconds(b, what) / seconds(a, what):.2f}" for a, b in zip(old, new))
        print(f"{dtype:8s} {name:5s}: old {o:6.1f} s  new {n:6.1f} s  new/old {n / o:.2f}x (medians; per pair {pairs})")
    # the plain forward = the full cache's prefill_s (a row's prefill_s = the shared forward + its own statistics and
    # compression); what the sweep spends besides it: statistics, compression, decoding, rows
    for side, labels in (("old", old), ("new", new)):
        forward = [pd.read_parquet(out / x / "rows.parquet").query("method == 'full'").prefill_s.sum() for x in labels]
        rest = [seconds(x, "sweep") - f for x, f in zip(labels, forward)]
        print(f"{dtype:8s} {side}: plain forward {statistics.median(forward):6.1f} s, the rest of the sweep "
              f"{statistics.median(rest):6.1f} s (medians)")
    for a, b in [(old[0], new[0])] + [(x, y) for x, y in zip(old, old[1:])] + [(x, y) for x, y in zip(new, new[1:])]:
        text, differ = agree(a, b)
        print(f"{dtype:8s} {a} vs {b}: {text}")
        for _, r in differ.iterrows():
            print(f"    {r.example_id} {r.method} {r.budget}: {r.prediction_a!r} ({r.score_a}) vs {r.prediction_b!r} ({r.score_b})")
EOF
