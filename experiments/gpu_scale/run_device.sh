#!/usr/bin/env bash
# One GPU call of the scale experiment: trains and scores the next unfinished runs of plan.json for at most
# BUDGET_S seconds of work (default 390, for an 8-minute call), and leaves the results in $OUT as results.tar
# (unpack it into experiments/gpu_scale/ and commit results/) beside the log run.log.
# The GPU machine has no network: the corpus is prepared beforehand (`python experiments/gpu_scale/run.py
# --prepare`, 30 MiB) and carried as experiments/gpu_scale/data; lavo comes from this source tree.
# WORKERS=N trains N runs at once, each in a process of its own; the default, auto, takes the number a probe
# measured (see REPORT.md, "Running it").
# LIMIT_S (default BUDGET_S + 50: run.py's start-up and a scoring that overruns its estimate) ends the call with
# SIGTERM, then SIGKILL 30 s later: run.py then writes what it was doing and what that measured into calls.jsonl
# (later calls plan with it) and packs, so give the device command a limit of at least LIMIT_S + 40 s: 480 s, the
# 8 minutes, with the defaults.
# Extra arguments go to run.py (e.g. --only lavo-s0,local-s0).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-experiments/gpu_scale/out}"
mkdir -p "$OUT"
E=experiments/gpu_scale
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# run.py rewrites results.tar after every finished run, so a call cut off at its time limit still returns them
budget=${BUDGET_S:-390}
timeout -s TERM -k 30 "${LIMIT_S:-$((budget + 50))}" \
    python3 "$E/run.py" --budget "$budget" --workers "${WORKERS:-auto}" --pack "$OUT/results.tar" "$@" 2>&1 \
    | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
