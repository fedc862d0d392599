#!/usr/bin/env bash
# Optional, after run.sh: the longer-budget check. weather_nyc, input 96, seed 0, the five cross attentions and
# DLinear trained for at most 400 steps (5x the main run's 80; the same early-stopping rule), into
# results_400steps.json; report.py then sets it beside seed 0 of results.json. One core, one thread; cells
# already recorded are skipped. HORIZONS overrides the horizon list.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
E=experiments/forecasting
taskset -c "${CORE:-0}" $PY -m lavo.cli forecast --data weather_nyc --input 96 --horizon "${HORIZONS:-96,192,336,720}" \
  --cross softmax,lavo,abc,performer,cosformer --baseline dlinear --seed 0 --max-steps 400 \
  --results $E/results_400steps.json --quiet 2>&1 | tee -a $E/run_longer.log
$PY $E/report.py $E
