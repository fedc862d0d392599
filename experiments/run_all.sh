#!/usr/bin/env bash
# All three experiments in queue order (1, 3, 2); each step skips what already finished.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
for e in lm_extrapolation ablation long_context; do
  echo "=== $e $(date -Is)"; bash $e/run.sh; echo "=== $e finished rc=$? $(date -Is)"
done
