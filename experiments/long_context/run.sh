#!/usr/bin/env bash
# Experiment 2: LAVO with windows 16, 32, 64 trained at L=128 and scored at 128 .. 131072 tokens on the held-out
# book (persuasion: 131,148 tokens, so N = 131,072 targets fit without concatenation).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
E=experiments/long_context
for w in 16 32 64; do
  train_run $E lavo-w$w --set model.attention=lavo --set model.attention_options.window=$w
done
eval_runs $E all --lengths 128,256,512,1024,2048,4096,8192,16384,32768,65536,131072 --batch-size 32 \
  --chunk-size 2048 -- $E/runs/lavo-w16 $E/runs/lavo-w32 $E/runs/lavo-w64
python experiments/report_tools.py results $E
