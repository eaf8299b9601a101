#!/usr/bin/env bash
# Disaggregated 1P+1D vs colocated 2 replicas, 1 CPU (1 torch thread) per replica, on the mixed
# long/short workload. Repeats rotate the configuration order; every configuration of a
# repeat gets the same seed (identical requests), repeats differ in seed. Run from the repo root.
set -u
source bench/scripts/common.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=bench/results/disagg_vs_colocated
M=${MODEL_DIR:-/tmp/splitserve-bench/small}
REPEATS=${REPEATS:-3}
FIRST_REPEAT=${FIRST_REPEAT:-0}  # to add repeats to an earlier run
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset small
SERVE=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0"
declare -A CMD=(
  [disagg]="$SERVE --prefill-replicas 1 --decode-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1"
  [disagg-cd512]="$SERVE --prefill-replicas 1 --decode-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1 --local-prefill-threshold 512"
  [colocated]="$SERVE --prefill-replicas 0 --decode-replicas 2 --decode-num-cpus 1"
  [colocated-chunk512]="$SERVE --prefill-replicas 0 --decode-replicas 2 --decode-num-cpus 1 --decode.max-num-batched-tokens 512"
)
ORDER=(disagg colocated disagg-cd512 colocated-chunk512)
BENCH="--workload mixed --num-requests 36 --short-len 128 --long-len 2048 --long-fraction 0.1 --length-jitter 0.25
  --max-tokens 64 --vocab-range 10:2000 --ignore-eos --rate 1,1.5,2,2.5,3 --max-seconds 90
  --ttft-slo-ms 2000 --itl-slo-ms 100 --no-progress"
for ((rep = FIRST_REPEAT; rep < REPEATS; rep++)); do
  for ((i = 0; i < ${#ORDER[@]}; i++)); do
    name=${ORDER[$(( (i + rep) % ${#ORDER[@]} ))]}
    profiled_bench "$rep" "$name"
  done
done
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
