#!/usr/bin/env bash
# What activation checkpointing saves and costs on the CPU: training steps of the `small` model with LAVO and with
# softmax+RoPE at 1K and 4K tokens, each with and without checkpointing, in one run (fp32, two threads), into
# benchmarks/results/cpu_fp32_checkpointing.{json,md}.
source "$(dirname "$0")/common.sh"
bench_into benchmarks/results/cpu_fp32_checkpointing --sections model --model-attentions lavo,softmax \
    --model-lengths 1K,4K --model-checkpointing --threads 2
