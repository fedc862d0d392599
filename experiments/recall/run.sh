#!/usr/bin/env bash
# Probe 1, multi-query associative recall: every model of config.json trained and scored on one core with one
# thread (about 30 minutes in all); models already in results.json are skipped, so an interrupted run resumes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
E=experiments/recall
# the load sweep (1..64 pairs), then one pair alone, where every step trains the distance
taskset -c 1 $PY $E/recall.py --config $E/config.json --out $E 2>&1 | tee -a $E/train.log
taskset -c 1 $PY $E/recall.py --config $E/single/config.json --out $E/single 2>&1 | tee -a $E/single/train.log
[ -f $E/speed.json ] || taskset -c 1 $PY $E/speed.py --out $E/speed.json
$PY $E/report.py $E
$PY $E/report.py $E/single $E/REPORT.md
