#!/usr/bin/env bash
# The reduced CPU run committed as benchmarks/results/cpu_fp32_{decode,attention}*: the decoding table at 1K to
# 64K, and the attention table (fwd+bwd) at 1K to 16K, fp32, one thread. It is what a shared 2-core machine
# finishes in well under an hour; run_cpu.sh is the full run. See benchmarks/RESULTS.md for how to read it.
source "$(dirname "$0")/common.sh"
bench_into benchmarks/results/cpu_fp32_decode --sections decode --threads 1 --decode-lengths 1K,4K,16K,64K \
    --repeats 3
bench_into benchmarks/results/cpu_fp32_attention --sections attention --passes fwd+bwd --threads 1 \
    --lengths 1K,4K,16K --repeats 2 --time-limit 60
