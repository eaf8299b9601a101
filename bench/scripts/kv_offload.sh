#!/usr/bin/env bash
# The host KV tier benchmark (bench/results/kv_offload.md): multi-turn chat whose working set is
# several times one replica's device KV, KV router, no tier vs the tier (and round-robin with the
# tier at 2P+2D), each topology in one `splitserve bench` run (same requests for every
# configuration). Run from the repo root: TOPOLOGY=1p1d (default) or 2p2d.
set -u
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
TOPOLOGY=${TOPOLOGY:-1p1d}
OUT=bench/results/kv_offload/run-$TOPOLOGY
M=${MODEL_DIR:-/tmp/splitserve-bench/small}
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset small
N=${TOPOLOGY:0:1}
SERVE=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --prefill-replicas $N --decode-replicas $N \
  --prefill-num-cpus 1 --decode-num-cpus 1 --prefill-num-kv-blocks 64 --decode-num-kv-blocks 256"
COMPARE=(--compare "no-tier=$SERVE --router kv" --compare "tier=$SERVE --router kv --kv-offloading-size 0.05")
if [ "$N" != 1 ]; then
  COMPARE+=(--compare "tier-round-robin=$SERVE --router round-robin --kv-offloading-size 0.05")
fi
echo "== start $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/splitserve bench --workload multi-turn --num-conversations 16 --num-turns 6 --first-turn-len 512 \
  --user-turn-len 32 --max-tokens 16 --ignore-eos --vocab-range 10:2000 --concurrency 4 --max-seconds 400 \
  --no-progress --out "$OUT" "${COMPARE[@]}"
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
