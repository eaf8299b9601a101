# Sourced by splitserve_vs_vllm.sh and splitserve_vs_vllm_profile_c32.sh: the five servers they
# compare, as CMD[name] for `splitserve bench --compare name=COMMAND` ({port}: a free port).
# splitserve colocated (1 replica, 1 and 2 torch threads) and disaggregated 1P+1D (1 thread
# each); vLLM-CPU with 1 and 2 OpenMP threads, both with the same scheduler limits as
# splitserve (64 sequences, a 2,048-token step).
source bench/scripts/common.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 VLLM_CPU_KVCACHE_SPACE=1
OUT=bench/results/splitserve_vs_vllm
M=${MODEL_DIR:-/tmp/splitserve-bench/bench}
vllm_env
SS=".venv/bin/splitserve serve --model $M --http-port {port} --grpc-port 0 --decode-replicas 1"
VL="$VLLM_PY -m vllm.entrypoints.openai.api_server --model $M --host 127.0.0.1 --port {port} --dtype float32
  --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 4096 --enable-prompt-tokens-details"
VL=$(echo $VL)  # one line
declare -A CMD=(
  [splitserve-2t]="$SS --prefill-replicas 0 --decode-num-cpus 2"
  [vllm-2t]="$VLLM_ENV VLLM_CPU_OMP_THREADS_BIND=0-1 $VL"
  [splitserve-1t]="$SS --prefill-replicas 0 --decode-num-cpus 1"
  [vllm-1t]="$VLLM_ENV $VL"
  [splitserve-1p1d]="$SS --prefill-replicas 1 --prefill-num-cpus 1 --decode-num-cpus 1"
)
