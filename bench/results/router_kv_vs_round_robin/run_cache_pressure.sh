#!/usr/bin/env bash
# Scenario B of the router comparison: the same prefix-repetition workload, but each prefill
# replica holds 512 KV blocks (8,192 tokens) while one load point's 12 prefixes need 768
# blocks: the two caches together hold them only if each prefix stays on one replica.
# Higher rates (2, 4, 6 req/s). Repeats alternate the order. Run from the repo root.
set -u
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=bench/results/router_kv_vs_round_robin
M=${MODEL_DIR:-/tmp/splitserve-bench/small}
REPEATS=${REPEATS:-4}
FIRST_REPEAT=${FIRST_REPEAT:-0}  # to add repeats to an earlier run
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset small
SERVE=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --prefill-replicas 2 --decode-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1 --prefill-num-kv-blocks 512 --local-prefill-threshold 32"
declare -A CMD=([kv]="$SERVE --router kv" [round-robin]="$SERVE --router round-robin")
BENCH="--workload prefix-repetition --num-prefixes 12 --prefix-len 1024 --suffixes-per-prefix 6 --suffix-len 64
  --max-tokens 16 --vocab-range 10:2000 --ignore-eos --rate 2,4,6 --max-seconds 120
  --ttft-slo-ms 1000 --itl-slo-ms 100 --no-progress"
run() {  # repeat name
  echo "== repeat $1 $2 $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
  .venv/bin/python -m splitserve.bench.process_cpu_profile --out "$OUT/pressure-rep$1-$2.cpu.md" -- \
    .venv/bin/splitserve bench $BENCH --seed "$1" --out "$OUT/pressure-rep$1-$2" --compare "$2=${CMD[$2]}"
}
for ((rep = FIRST_REPEAT; rep < REPEATS; rep++)); do
  if ((rep % 2 == 0)); then run $rep kv; run $rep round-robin; else run $rep round-robin; run $rep kv; fi
done
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
