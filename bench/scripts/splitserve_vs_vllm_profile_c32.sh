#!/usr/bin/env bash
# Where the CPU goes at concurrency 32: each server is started first and left idle for
# IDLE_S seconds (each process's idle rate: pollers, probes, timers), then only the load
# phase (96 requests x 128 tokens, closed loop, concurrency 32) is profiled per process role,
# and per thread for the engine actors and the ingress replica (py-spy names the threads:
# the decode actor's engine loop vs its asyncio loop, which encodes and writes the frames).
set -u
source bench/scripts/splitserve_vs_vllm_servers.sh
IDLE_S=${IDLE_S:-10}
PREFIX=${PREFIX:-profile-c32}  # another name keeps an earlier run's files
for name in ${CONFIGS:-splitserve-1t vllm-1t splitserve-1p1d splitserve-2t vllm-2t}; do
  echo "== $name $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
  .venv/bin/python -m splitserve.bench.serving.process_cpu_profile --out "$OUT/$PREFIX-$name.cpu.md" \
    --idle-s "$IDLE_S" --threads "worker \(engine\)" --threads "ingress replica" --threads "API server" \
    --server "${CMD[$name]}" --server-log "/tmp/$PREFIX-$name.server.log" -- \
    .venv/bin/splitserve bench --url {url} --workload mixed --num-requests 96 --short-len 128 --long-fraction 0 \
      --length-jitter 0 --max-tokens 128 --vocab-range 10:2000 --ignore-eos --concurrency 32 --no-progress \
      --out "$OUT/$PREFIX-$name"
done
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
