#!/usr/bin/env bash
# Issue 14, part 1: multivariate forecasting, input 96 (and 336 for weather_nc), horizons 96..720, five cross
# attentions and three baselines on three datasets; seed by seed (every cell of seed 0 first), one thread. Cells
# already in results.json are skipped, so an interrupted run resumes. Then the tables and the plots.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
E=experiments/forecasting
for seed in 0 1 2; do
  for data in weather_nc weather_nyc elecdemand; do
    $PY -m lavo.cli forecast --data "$data" --input 96 --horizon 96,192,336,720 \
      --cross softmax,lavo,abc,performer,cosformer --baseline repeat_last,seasonal_naive,dlinear \
      --seed "$seed" --results $E/results.json --quiet 2>&1 | tee -a $E/run.log
  done
done
# the protocol's second input length, for one dataset (the CPU time allowed no more)
for seed in 0 1 2; do
  $PY -m lavo.cli forecast --data weather_nc --input 336 --horizon 96,192,336,720 \
    --cross softmax,lavo,abc,performer,cosformer --baseline repeat_last,seasonal_naive,dlinear \
    --seed "$seed" --results $E/results.json --quiet 2>&1 | tee -a $E/run.log
done
$PY $E/report.py $E
# Optional last step, separate because it is a check rather than part of the grid: 5x the training budget for
# seed 0 of weather_nyc, into results_400steps.json (report.py adds the 80-against-400-steps table)
# bash experiments/forecasting/run_longer.sh
