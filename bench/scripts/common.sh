# Sourced by the bench/scripts drivers, which run from the repo root.

# vllm_env: sets VLLM_PY (the vLLM venv's python) and VLLM_ENV, the environment its server
# command needs. A vLLM venv whose torchvision/torchaudio are CUDA builds next to a CPU torch
# cannot even import transformers: VLLM_ENV then hides them (vllm_shim/sitecustomize.py); a
# text model needs neither.
vllm_env() {
  VLLM_PY=${VLLM_PY:-/work/vllm-venv/bin/python}
  VLLM_ENV=""
  "$VLLM_PY" -c "import torchvision, torchaudio" 2>/dev/null || VLLM_ENV="PYTHONPATH=$PWD/bench/scripts/vllm_shim"
}

# profiled_bench REPEAT NAME: one `splitserve bench $BENCH` run of configuration NAME (the
# command ${CMD[NAME]}) with seed REPEAT, under the per-process CPU profiler; its output goes
# to $OUT/${TAG}repREPEAT-NAME and its profile beside it.
profiled_bench() {
  echo "== repeat $1 $2 $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"
  # $BENCH unquoted: it is a list of flags.
  .venv/bin/python -m splitserve.bench.serving.process_cpu_profile --out "$OUT/${TAG:-}rep$1-$2.cpu.md" -- \
    .venv/bin/splitserve bench $BENCH --seed "$1" --out "$OUT/${TAG:-}rep$1-$2" --compare "$2=${CMD[$2]}"
}
