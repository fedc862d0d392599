# Shared by the experiments' run.sh scripts: pinned, single-threaded, resumable training and evaluation.
# Every process runs on one core (core 0, or LAVO_CORE) with one thread, so two experiments can share two cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/.venv/bin/activate"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
PIN="taskset -c ${LAVO_CORE:-0}"

# timed EXP_DIR WHAT LOG COMMAND...: COMMAND on the pinned core, its output into LOG, its wall time appended to
# EXP_DIR/wall_times.jsonl as WHAT; a stopped attempt (Ctrl-C saves a checkpoint, and lavo exits 130) is
# appended as unfinished, so that the time of a step resumed later counts in full, then the queue stops.
timed() {
  local exp="$1" what="$2" log="$3" status=0; shift 3
  local t0=$(date +%s)
  $PIN "$@" > "$log" 2>&1 || status=$?
  local t1=$(date +%s) finished=true
  [ "$status" = 0 ] || finished=false
  echo "{\"what\": \"$what\", \"wall_s\": $((t1 - t0)), \"finished\": $finished}" >> "$exp/wall_times.jsonl"
  if [ "$status" != 0 ]; then echo "[stopped] $what after $((t1 - t0)) s (exit $status)"; exit "$status"; fi
  echo "[done] $what in $((t1 - t0)) s"
}

# train_run EXP_DIR NAME [--set key=value ...]: trains EXP_DIR/runs/NAME unless it already finished;
# an interrupted run resumes from its last checkpoint.
train_run() {
  local exp="$1" name="$2"; shift 2
  local dir="$exp/runs/$name"
  if [ -f "$dir/metrics.jsonl" ] && grep -q '"final": true' "$dir/metrics.jsonl"; then
    echo "[skip] $dir already trained"; return 0
  fi
  mkdir -p "$dir"
  timed "$exp" "train $name" "$dir/train.log" lavo train --config "$exp/base.json" --set "train.out_dir=$dir" "$@" \
    --resume
}

# eval_runs EXP_DIR OUT_NAME EVAL_ARGS... -- RUN_DIRS...: skipped when EXP_DIR/eval/OUT_NAME/results.json exists.
eval_runs() {
  local exp="$1" out="$2"; shift 2
  local args=()
  while [ "$1" != "--" ]; do args+=("$1"); shift; done; shift
  if [ -f "$exp/eval/$out/results.json" ]; then echo "[skip] $exp/eval/$out evaluated"; return 0; fi
  mkdir -p "$exp/eval/$out"
  timed "$exp" "eval $out" "$exp/eval/$out/eval.log" lavo eval "$@" "${args[@]}" --device cpu --quiet \
    --out "$exp/eval/$out"
}

# listops_run NAME ARGS...: `lavo listops` with experiments/listops/base.json and ARGS into
# experiments/listops/runs/NAME, unless it has results.json already; an interrupted run resumes from its
# checkpoint.pt. This checkout's code runs (PYTHONPATH).
listops_run() {
  local exp=experiments/listops name="$1"; shift
  local dir="$exp/runs/$name"
  if [ -f "$dir/results.json" ]; then echo "[skip] $dir done"; return 0; fi
  mkdir -p "$dir"
  PYTHONPATH="$ROOT" timed "$exp" "listops $name" "$dir/train.log" python -m lavo.cli listops \
    --config "$exp/base.json" --out "$dir" --quiet "$@"
}
