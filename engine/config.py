"""EngineConfig, validated in __post_init__, and the value types, defaults and ConfigError it
shares with ModelConfig (engine/model_config.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

# The one list of supported dtypes (torch.<name>); everything else derives from it.
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
# KV-cache storage: auto = the model's dtype; fp8 (float8_e4m3fn) and int8 store one byte per
# value plus a float16 scale per (token, kv head) (engine/ops/quantized_kv.py).
KvCacheDtype = Literal["auto", "fp8", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
# Decimal (K, M, G, T) and binary (Ki, Mi, Gi, Ti) multipliers, as Kubernetes quantities.
_BYTE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BYTE_UNITS.update({f"{unit}i": 1024 ** (i + 1) for i, unit in enumerate("KMGT")})
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?|)B?\s*$", re.IGNORECASE)
# Weight quantization of the decoder layers' matmuls at load time (engine/quant).
Quantization = Literal["none", "int8", "fp8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
EngineKind = Literal["real", "simulated"]
ENGINES: tuple[str, ...] = get_args(EngineKind)
# KV blocks per engine unless configured: engine, ServeConfig pools and `generate` share it.
DEFAULT_NUM_KV_BLOCKS = 1024


class ConfigError(ValueError):
    """A model directory or configuration value that splitserve cannot use."""


# The scripted CPU decode step's switch (engine/model/scripted_decode.py); torch-free here, so
# the tensor-parallel start-up check (engine/parallel/shard_plan.py) reads it too.
CPU_DECODE_FORWARD_ENV = "SPLITSERVE_CPU_DECODE_FORWARD"
# The scripted prefill of one fresh prompt (engine/model/prefill_graph.py): scripted or eager.
CPU_PREFILL_FORWARD_ENV = "SPLITSERVE_CPU_PREFILL_FORWARD"


def async_scheduling_pays(scripted_decode: bool) -> bool:
    """Where async scheduling is on unless configured: a CPU engine whose decode steps run as
    one TorchScript call that holds no GIL (scripted_decode: engine/model/scripted_decode.py; an
    fp32 unquantized model and cache). An eager forward needs the GIL back after every torch op,
    so the host work the overlap was meant to hide delays it instead: on CPU
    (bench/results/overlap.md) and on CUDA too, where without CUDA graphs each step is Python
    launching ~300 kernels. gpu_check check 9 on an H200 (bench/results/gpu_check.md, 3 runs,
    ~1B Llama, bf16) measured the overlap 0.48-0.74x the synchronous step at batch 1 and 0.87x
    over batches 1-256 (geometric mean). CUDA graphs, which would take the forward off the GIL,
    would change that."""
    return scripted_decode


def parse_memory_bytes(value: int | str, name: str = "kv_cache_memory_bytes") -> int:
    """Bytes from an int or a size such as "512Mi", "4G", "1.5Gi" (K/M/G/T = 1000^n,
    Ki/Mi/Gi/Ti = 1024^n, an optional trailing B). Anything else, or < 1, is a ConfigError."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte count such as 4294967296 or 4Gi, got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = _BYTE_SIZE.match(str(value))
        if match is None:
            raise ConfigError(f"{name} must be a byte count such as 4294967296 or 4Gi, got {value!r}")
        unit = match.group(2)[:1].upper() + match.group(2)[1:].lower()
        number = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if number < 1:
        raise ConfigError(f"{name} must be >= 1 byte, got {value!r}")
    return number


@dataclass
class EngineConfig:
    """Sizes of the KV cache and the batch; shared by the colocated engine and the workers."""

    model: str
    block_size: int = 16
    num_kv_blocks: int = DEFAULT_NUM_KV_BLOCKS  # blocks in the preallocated cache tensor (any device)
    max_num_seqs: int = 64  # sequences in one running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    # The prompt tokens a step that also decodes may compute (the scheduler's cap on a mixed
    # step's prompt chunks, so they stretch the running sequences' ITL less); a step with no
    # decode row still takes max_num_batched_tokens. 0: no cap (bench/results/vs_vllm_bench.md).
    mixed_step_prefill_tokens: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # GiB of host memory per engine for the host KV tier (blocks the device evicts); 0 = off.
    kv_offloading_size: float = 0.0
    dtype: str | None = None  # defaults to the checkpoint's dtype
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8 or int8 (quantized, with scales)
    # When set, the KV cache gets as many blocks as fit these bytes (scales included) and
    # num_kv_blocks is ignored; LLMEngine resolves it once it knows the model's shape.
    kv_cache_memory_bytes: int | str | None = None
    quantization: str = "none"  # none|int8|fp8|int4, the matmul weights (also the draft model's)
    device: str = "cpu"
    seed: int = 0
    # Async scheduling (engine/step_pipeline.py): the next step is scheduled and submitted
    # while one runs on the forward thread, with placeholders for its tokens. Speculative
    # decoding steps synchronously whatever this says. None (the default): where it pays
    # (async_scheduling_pays: a scripted CPU decode step); elsewhere the synchronous step,
    # because an eager forward and the host work share one GIL and the overlap measured slower,
    # on CPU (bench/results/overlap.md) and on an H200 (bench/results/gpu_check.md).
    # PagedEngine resolves it to a bool.
    async_scheduling: bool | None = None
    # A CPU step computing fewer tokens than this runs its forward on one torch thread, a
    # larger one on all of the engine's (engine/step_threads.py: a small step's second thread
    # waits for a core the replica's neighbours hold); 0: every step on all of them.
    threaded_step_min_tokens: int = 0
    # Speculative decoding (engine/speculative): a SpeculativeConfig, or its dict (how Ray ships it).
    speculative: Any = None
    # Structured-output bounds and cache size (engine/structured_output/grammar_config.py), or their dict.
    grammar: Any = None
    # "real" runs the model; "simulated" (engine/simulated) replaces the forward by a wait from
    # the step-time profile (a YAML/JSON file; None: the shipped CPU-fitted one), slowed
    # speed_factor times, and never loads the weights.
    engine: str = "real"
    profile: str | None = None
    speed_factor: float = 1.0
    # Seeds the block-hash chain (engine/core/block_hash.root_hash): a deployment of several
    # models gives each its served name, so their prefix hashes never coincide; None: unseeded.
    hash_seed: str | None = None
    # Tensor parallelism (engine/parallel/): the model sharded over this many ranks, rank 0 in
    # this process, the rest spawned processes on this node (gloo on CPU, NCCL on CUDA); 1
    # runs none of it. The timeout bounds each rank's start, join and load and every collective.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0
    # On CPU the ranks' collectives go over a shared-memory segment of their node
    # (engine/parallel/shm_collectives.py), gloo carrying only tensors too large for its slots;
    # False keeps them all on gloo. CUDA ranks use NCCL whatever this says.
    tensor_parallel_shm_collectives: bool = True
    # True: on CPU each rank's forward thread is pinned to cores of its own (rank r: the r-th
    # block of cores / size of the node's), where the node has at least as many cores as ranks
    # (engine/parallel/rank_cpus.py). Off by default: on a shared 2-core machine it did not
    # measurably shorten the step or the ranks' waiting (bench/results/tensor_parallel.md).
    tensor_parallel_pin_cpus: bool = False
    # LoRA (engine/lora/): enable_lora serves the PEFT adapters of lora_modules (name -> adapter
    # directory), any number of them: max_loras device slots of rank up to max_lora_rank hold
    # those the running requests use, an LRU host cache of max_cpu_loras (None: max_loras)
    # the recently used, and a miss reads the directory again. A request names its adapter in
    # SamplingParams.lora_adapter.
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        from splitserve.engine.speculative.speculative_config import SpeculativeConfig
        from splitserve.engine.structured_output.grammar_config import GrammarConfig

        if self.grammar is None or isinstance(self.grammar, dict):
            try:
                self.grammar = GrammarConfig.model_validate(self.grammar or {})
            except ValueError as exc:
                raise ConfigError(f"invalid grammar config: {exc}") from None
        elif not isinstance(self.grammar, GrammarConfig):
            raise ConfigError(f"grammar must be a GrammarConfig or a dict, got {self.grammar!r}")

        if self.speculative is None or isinstance(self.speculative, dict):
            try:
                self.speculative = SpeculativeConfig.model_validate(self.speculative or {})
            except ValueError as exc:
                raise ConfigError(f"invalid speculative config: {exc}") from None
        elif not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig or a dict, got {self.speculative!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.threaded_step_min_tokens < 0:
            raise ConfigError(f"threaded_step_min_tokens must be >= 0, got {self.threaded_step_min_tokens}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be >= block_size")
        if self.mixed_step_prefill_tokens < 0:
            raise ConfigError(f"mixed_step_prefill_tokens must be >= 0, got {self.mixed_step_prefill_tokens}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_memory_bytes(self.kv_cache_memory_bytes)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if not self.kv_offloading_size >= 0:
            raise ConfigError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not self.speed_factor > 0:
            raise ConfigError(f"speed_factor must be > 0, got {self.speed_factor}")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if not self.tensor_parallel_timeout_s > 0:
            raise ConfigError(f"tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}")
        if not isinstance(self.tensor_parallel_shm_collectives, bool):
            raise ConfigError(
                f"tensor_parallel_shm_collectives must be true or false, got {self.tensor_parallel_shm_collectives!r}"
            )
        if not isinstance(self.tensor_parallel_pin_cpus, bool):
            raise ConfigError(f"tensor_parallel_pin_cpus must be true or false, got {self.tensor_parallel_pin_cpus!r}")
        from splitserve.engine.lora.lora_config import check_lora_settings

        check_lora_settings(self)
