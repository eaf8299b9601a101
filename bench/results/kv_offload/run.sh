#!/usr/bin/env bash
# The host KV tier benchmark (bench/results/kv_offload.md): multi-turn chat whose working set is
# several times one replica's device KV, 1 prefill + 1 decode, KV router, no tier vs the tier,
# in one `splitserve bench` run (same requests for both). Run from the repo root.
set -u
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=bench/results/kv_offload/run
M=${MODEL_DIR:-/tmp/splitserve-bench/small}
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset small
SERVE=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --prefill-replicas 1 --decode-replicas 1 \
  --prefill-num-cpus 1 --decode-num-cpus 1 --prefill-num-kv-blocks 64 --decode-num-kv-blocks 128 --router kv"
echo "== start $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/splitserve bench --workload multi-turn --num-conversations 16 --num-turns 6 --first-turn-len 128 \
  --user-turn-len 32 --max-tokens 16 --ignore-eos --vocab-range 10:2000 --concurrency 4 --max-seconds 400 \
  --no-progress --out "$OUT" \
  --compare "no-tier=$SERVE" \
  --compare "tier=$SERVE --kv-offloading-size 0.05"
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
