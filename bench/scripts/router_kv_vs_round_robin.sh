#!/usr/bin/env bash
# KV-aware vs round-robin routing: 2 prefill replicas + 1 decode replica (1 CPU each) on
# prefix-repetition (12 prefixes x 1024 tokens, 6 requests per prefix with 64-token suffixes).
# Repeats alternate the order; within a repeat both policies get the same seed. Run from the
# repo root.
#   Scenario A (default): kv-local (threshold 128: the decode replica prefills the suffix
#     itself when it holds the prefix) runs once, in repeat 0; rates 1, 2, 3 req/s.
#   Scenario B (SCENARIO=cache_pressure): each prefill replica holds 512 KV blocks (8,192
#     tokens) while one load point's 12 prefixes need 768 blocks: the two caches together
#     hold them only if each prefix stays on one replica. Rates 2, 4, 6 req/s; 4 repeats.
set -u
source bench/scripts/common.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=bench/results/router_kv_vs_round_robin
M=${MODEL_DIR:-/tmp/splitserve-bench/small}
SCENARIO=${SCENARIO:-default}
FIRST_REPEAT=${FIRST_REPEAT:-0}  # to add repeats to an earlier run
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset small
SERVE=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --prefill-replicas 2 --decode-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1"
if [ "$SCENARIO" = cache_pressure ]; then
  REPEATS=${REPEATS:-4}; RATES=2,4,6; TAG=pressure-
  SERVE="$SERVE --prefill-num-kv-blocks 512"
  declare -A CMD=([kv]="$SERVE --router kv --local-prefill-threshold 32" [round-robin]="$SERVE --router round-robin --local-prefill-threshold 32")
else
  REPEATS=${REPEATS:-3}; RATES=1,2,3; TAG=
  declare -A CMD=(
    [kv]="$SERVE --router kv --local-prefill-threshold 32"
    [round-robin]="$SERVE --router round-robin --local-prefill-threshold 32"
    [kv-local]="$SERVE --router kv --local-prefill-threshold 128"
  )
fi
BENCH="--workload prefix-repetition --num-prefixes 12 --prefix-len 1024 --suffixes-per-prefix 6 --suffix-len 64
  --max-tokens 16 --vocab-range 10:2000 --ignore-eos --rate $RATES --max-seconds 120
  --ttft-slo-ms 1000 --itl-slo-ms 100 --no-progress"
for ((rep = FIRST_REPEAT; rep < REPEATS; rep++)); do
  if ((rep % 2 == 0)); then profiled_bench $rep kv; profiled_bench $rep round-robin; else profiled_bench $rep round-robin; profiled_bench $rep kv; fi
  ((rep == 0)) && [ -n "${CMD[kv-local]:-}" ] && profiled_bench 0 kv-local
done
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
