#!/usr/bin/env bash
# Where the CPU goes at concurrency 32: each server is started first and left idle for
# IDLE_S seconds (each process's idle rate: pollers, probes, timers), then only the load
# phase (96 requests x 128 tokens, closed loop, concurrency 32) is profiled per process role,
# and per thread for the engine actors and the ingress replica (py-spy names the threads:
# the decode actor's engine loop vs its asyncio loop, which encodes and writes the frames).
set -u
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 VLLM_CPU_KVCACHE_SPACE=1
OUT=bench/results/splitserve_vs_vllm
M=${MODEL_DIR:-/tmp/splitserve-bench/bench}
VLLM_PY=${VLLM_PY:-/work/vllm-venv/bin/python}
# A vLLM venv whose torchvision/torchaudio are CUDA builds next to a CPU torch cannot even
# import transformers: hide them (bench/scripts/vllm_shim/sitecustomize.py); text models do not need them.
VLLM_ENV=""
"$VLLM_PY" -c "import torchvision, torchaudio" 2>/dev/null || VLLM_ENV="PYTHONPATH=$PWD/bench/scripts/vllm_shim"
IDLE_S=${IDLE_S:-10}
PREFIX=${PREFIX:-profile-c32}  # another name keeps an earlier run's files
SS=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --decode-replicas 1"
VL="$VLLM_PY -m vllm.entrypoints.openai.api_server --model $M --host 127.0.0.1 --port {port} --dtype float32 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 4096 --enable-prompt-tokens-details"
declare -A CMD=([splitserve-1t]="$SS --prefill-replicas 0 --decode-num-cpus 1" [vllm-1t]="$VLLM_ENV $VL"
                [splitserve-2t]="$SS --prefill-replicas 0 --decode-num-cpus 2" [vllm-2t]="$VLLM_ENV VLLM_CPU_OMP_THREADS_BIND=0-1 $VL"
                [splitserve-1p1d]="$SS --prefill-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1")
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
