#!/usr/bin/env bash
# ListOps (LRA's task, in a shorter length window): one non-causal encoder per mechanism, same size, data, steps
# and batch; accuracy on the seeded test split. Every model trains on seeds 0, 1 and 2 (the seed draws the
# splits, the initialisation and the batches) into runs/NAME/seedS, all of seed 0 first, then seed 1, then
# seed 2. A rerun skips finished runs (runs/NAME/seedS/results.json), then rewrites results.json, tables.md,
# the plot and REPORT.md's tables.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
SEEDS=(0 1 2)
# one model a line: NAME, then its arguments to `lavo listops` (no argument contains a space)
MODELS=(
  "lavo               --attention lavo --set attention_options.window=32"
  "lavo-no-dissection --attention lavo --set attention_options.window=32 --set attention_options.dissection=false"
  "softmax            --attention softmax"
  "local              --attention local --set attention_options.window=32"
  "performer          --attention performer --set attention_options.features=64"
  "cosformer          --attention cosformer"
  "abc                --attention abc --set attention_options.slots=12"
  "s4d                --attention s4d --set attention_options.state_size=42"
  "longshort          --attention longshort --set attention_options.window=32 --set attention_options.landmarks=8"
  # LAVO with its relative-position bias only (no sinusoidal positions), as in the language-model experiments
  "lavo-no-positions  --attention lavo --set attention_options.window=32 --set position=none"
)
for seed in "${SEEDS[@]}"; do
  for model in "${MODELS[@]}"; do
    read -r -a words <<< "$model"
    listops_run "${words[0]}/seed$seed" "${words[@]:1}" --seed "$seed"
  done
done
PYTHONPATH="$ROOT" python experiments/listops/report.py experiments/listops
