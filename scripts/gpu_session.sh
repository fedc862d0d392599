#!/usr/bin/env bash
# Both GPU jobs in one device call, so that the machine is started once: the Triton check (scripts/gpu_check.sh)
# into OUT_DIR/check, then one call of the scale experiment (experiments/gpu_scale/run_device.sh) into
# OUT_DIR/scale with the seconds that are left of CALL_S (default 590: give the device command a limit of at least
# CALL_S + 10). Between two device calls an idle machine may be handed back, and a fresh one takes minutes to start.
# Carry experiments/gpu_scale/data (`python experiments/gpu_scale/run.py --prepare`) and, for fla's anchor rows,
# .whl (`pip download --no-deps fla-core==0.6.0 -d .whl`). Extra arguments go to run.py.
# Usage: CALL_S=590 bash scripts/gpu_session.sh OUT_DIR [run.py arguments]
set -uo pipefail
out=${1:?usage: scripts/gpu_session.sh OUT_DIR [run.py arguments]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
call=${CALL_S:-590}
wheels=()
[ -d .whl ] && wheels=(--wheels .whl)
bash scripts/gpu_check.sh "$out/check" "${wheels[@]}" || echo "gpu_check.sh exited with status $?"
# run_device.sh ends run.py 50 s after its budget (SIGTERM), kills it 30 s later, then returns its files
budget=$((call - SECONDS - 50 - 30 - 10))
if [ "$budget" -lt 60 ]; then
    echo "only ${budget} s would be left for the scale experiment: not started"
    exit 0
fi
echo "the scale experiment gets ${budget} s"
OUT="$out/scale" BUDGET_S=$budget bash experiments/gpu_scale/run_device.sh "$@"
