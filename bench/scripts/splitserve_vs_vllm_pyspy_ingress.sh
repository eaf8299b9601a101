#!/usr/bin/env bash
# Where the relay's CPU goes inside the ingress replica (and the decode actor): py-spy samples
# both for 25 s while two 96-request, concurrency-32 loads run against splitserve-1t, then
# splitserve.bench.serving.pyspy_summary prints the self and inclusive shares of each function. Needs py-spy
# (`pip install py-spy`). Raw stacks go to $SPY_OUT (default /tmp). Run from the repo root.
set -u
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
M=${MODEL_DIR:-/tmp/splitserve-bench/bench}
SPY_OUT=${SPY_OUT:-/tmp}
PORT=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
setsid .venv/bin/splitserve serve --model "$M" --http-port "$PORT" --grpc-port 0 --prefill-replicas 0 \
  --decode-replicas 1 --decode-num-cpus 1 > "$SPY_OUT/pyspy-server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
# This server's own actors (other clusters may run on the machine): its descendants by title.
own() {
  .venv/bin/python -c "import psutil, sys
for p in psutil.Process($SERVER).children(recursive=True):
    title = ' '.join(p.cmdline())
    if sys.argv[1] in title and 'splitserve-controller' not in title:
        print(p.pid)
        break" "$1"
}
INGRESS=$(own "ray::ServeReplica:splitserve:splitserve")
DECODE=$(own "ray::DecodeWorker")
echo "server $SERVER ingress $INGRESS decode $DECODE"
.venv/bin/py-spy record -p "$INGRESS" -d 25 -r 200 -f raw -o "$SPY_OUT/pyspy-ingress.txt" --nonblocking &
SPY1=$!
.venv/bin/py-spy record -p "$DECODE" -d 25 -r 100 -f raw -o "$SPY_OUT/pyspy-decode.txt" --nonblocking &
SPY2=$!
sleep 1
for k in 1 2; do
  .venv/bin/splitserve bench --url "http://127.0.0.1:$PORT" --workload mixed --num-requests 96 --short-len 128 \
    --long-fraction 0 --length-jitter 0 --max-tokens 128 --vocab-range 10:2000 --ignore-eos --concurrency 32 \
    --no-progress --out "$SPY_OUT/pyspy-bench$k" | grep "concurrency=32 |"
done
wait $SPY1 $SPY2
kill -INT "$SERVER"; sleep 10; kill -TERM -- -"$SERVER" 2> /dev/null
.venv/bin/python -m splitserve.bench.serving.pyspy_summary "$SPY_OUT/pyspy-ingress.txt"
.venv/bin/python -m splitserve.bench.serving.pyspy_summary "$SPY_OUT/pyspy-decode.txt"
