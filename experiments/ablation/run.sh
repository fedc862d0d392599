#!/usr/bin/env bash
# Experiment 3: ablation of LAVO at L=256 (same budget as experiment 1). Full LAVO (fixed basis) and the local
# branch alone are the `lavo` and `local` runs of experiment 1 (identical settings); trained there if missing.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
E=experiments/ablation
X=experiments/lm_extrapolation
train_run $X lavo            --set model.attention=lavo --set model.attention_options.window=32
train_run $X local           --set model.attention=local --set model.attention_options.window=32
train_run $E lavo-no-posbias --set model.attention=lavo --set model.attention_options.window=32 \
                             --set model.attention_options.position_bias=false
train_run $E lavo-no-dissection --set model.attention=lavo --set model.attention_options.window=32 \
                             --set model.attention_options.dissection=false
train_run $E lavo-learned-basis --set model.attention=lavo --set model.attention_options.window=32 \
                             --set model.attention_options.basis=learned
eval_runs $E all --lengths 256,2048 --max-tokens 24576 --batch-size 16 --chunk-size 1024 -- \
  $X/runs/lavo $E/runs/lavo-no-posbias $E/runs/lavo-no-dissection $E/runs/lavo-learned-basis $X/runs/local
python experiments/report_tools.py results $E
