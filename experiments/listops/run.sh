#!/usr/bin/env bash
# ListOps (LRA's task, in a shorter length window): one non-causal encoder per mechanism, same size, data, steps
# and batch; accuracy on the seeded test split. A rerun skips finished runs (runs/NAME/results.json), then
# rewrites results.json, tables.md, the plot and REPORT.md's tables.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
listops_run lavo               --attention lavo --set attention_options.window=32
listops_run lavo-no-dissection --attention lavo --set attention_options.window=32 \
                               --set attention_options.dissection=false
listops_run softmax            --attention softmax
listops_run local              --attention local --set attention_options.window=32
listops_run performer          --attention performer --set attention_options.features=64
listops_run cosformer          --attention cosformer
listops_run abc                --attention abc --set attention_options.slots=12
listops_run s4d                --attention s4d --set attention_options.state_size=42
# a second seed (other splits, initialisation and batches) for LAVO: how much of its result is the seed
listops_run lavo-seed1         --attention lavo --set attention_options.window=32 --seed 1
listops_run longshort          --attention longshort --set attention_options.window=32 \
                               --set attention_options.landmarks=8
# LAVO with its relative-position bias only (no sinusoidal positions), as in the language-model experiments
listops_run lavo-no-positions  --attention lavo --set attention_options.window=32 --set position=none
PYTHONPATH="$ROOT" python experiments/listops/report.py experiments/listops
