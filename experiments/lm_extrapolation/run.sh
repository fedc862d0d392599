#!/usr/bin/env bash
# Experiment 1: extrapolation. Eight models of six mechanisms, same model size, data, steps, batch and tokens;
# trained at L=256, scored at 1x .. 16x L on the same held-out tokens. Re-running skips finished runs and resumes
# interrupted ones.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
E=experiments/lm_extrapolation
train_run $E lavo            --set model.attention=lavo --set model.attention_options.window=32
train_run $E softmax-sin     --set model.attention=softmax --set model.position=sinusoidal
train_run $E softmax-rope    --set model.attention=softmax --set model.position=rope
train_run $E local           --set model.attention=local --set model.attention_options.window=32
train_run $E abc             --set model.attention=abc --set model.attention_options.slots=32
train_run $E longshort       --set model.attention=longshort --set model.attention_options.window=32
train_run $E longshort-noln  --set model.attention=longshort --set model.attention_options.window=32 \
                             --set model.attention_options.dual_ln=false
train_run $E s4d             --set model.attention=s4d --set model.attention_options.state_size=128
# N = 24576 scored tokens: a multiple of every length (384 = 1.5 L included)
eval_runs $E all --lengths 256,384,512,1024,2048,4096 --max-tokens 24576 --batch-size 16 --chunk-size 1024 -- \
  $E/runs/lavo $E/runs/softmax-sin $E/runs/softmax-rope $E/runs/local $E/runs/abc $E/runs/longshort \
  $E/runs/longshort-noln $E/runs/s4d
python experiments/report_tools.py results $E
