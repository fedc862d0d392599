#!/usr/bin/env bash
# The full CPU run into benchmarks/results/cpu_fp32.{json,md} and its plots: every section, fp32, both cores of
# an otherwise idle 2-core machine. Not re-run on the current code (benchmarks/RESULTS.md says what is quoted).
source "$(dirname "$0")/common.sh"
out=benchmarks/results/cpu_fp32
mkdir -p "$out"
bench_into "$out" --threads 2 --repeats 3 --time-limit 30 --lengths 1K,4K,16K,64K --decode-lengths 1K,4K,16K,64K \
    --model-lengths 1K,4K --plots "$out"
