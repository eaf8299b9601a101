"""Model and engine configuration dataclasses, validated in __post_init__."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from splitserve.engine.model.architectures import (
    ARCHITECTURES,
    FULL,
    SLIDING,
    Architecture,
    gemma3_fields,
    moe_fields,
    unsupported_feature,
    window_fields,
)

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


LAYER_KINDS = {SLIDING, FULL}  # config.json's layer_types


class ConfigError(ValueError):
    """A model directory or configuration value that splitserve cannot use."""


# The scripted CPU decode step's switch (engine/model/scripted_decode.py); torch-free here, so
# the tensor-parallel start-up check (engine/parallel/shard_plan.py) reads it too.
CPU_DECODE_FORWARD_ENV = "SPLITSERVE_CPU_DECODE_FORWARD"


def async_scheduling_pays(device: str, scripted_decode: bool = False) -> bool:
    """Where async scheduling is on unless configured: a CUDA device, and a CPU engine whose
    decode steps run as one TorchScript call that holds no GIL (scripted_decode:
    engine/model/scripted_decode.py; an fp32 unquantized model and cache). An eager CPU forward
    needs the GIL back after every torch op, so the host work the overlap was meant to hide
    delays it instead (bench/results/overlap.md measured it slower there)."""
    return str(device).startswith("cuda") or scripted_decode


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
class ModelConfig:
    """The subset of a Hugging Face config.json that a Llama-family decoder needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention (engine/model/architectures.py, window_fields): a windowed
    # layer's query sees itself and the sliding_window - 1 tokens before it (transformers'
    # mask); which layers are windowed is layer_types. None: every layer sees everything.
    sliding_window: int | None = None
    # A pre-quantized checkpoint's config.json quantization_config (engine/quant/checkpoint_scheme.py).
    quantization_config: dict[str, Any] | None = None
    # Each layer's kind, sliding or full attention (set where some layer is windowed). Gemma 3
    # (gemma3_fields): also the sliding layers' own rope base, the attention scale's
    # denominator (query_pre_attn_scalar ** -0.5) and tanh soft-capping of the final logits.
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None
    local_rope_type: str = "default"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (engine/model/architectures.py, moe_fields; engine/model/moe.py):
    # 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None  # the layers whose MLP is the experts

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        from splitserve.engine.quant.checkpoint_scheme import UnsupportedQuantization

        try:
            self.checkpoint_scheme  # noqa: B018  (a checkpoint we cannot run fails here, in the preflight too)
        except UnsupportedQuantization as exc:
            raise ConfigError(str(exc)) from None
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", "linear", None):
                raise ConfigError(f"unsupported rope_scaling type {kind!r}")
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= LAYER_KINDS
        ):
            raise ConfigError(
                f"layer_types must name {self.num_hidden_layers} layers, each one of {sorted(LAYER_KINDS)}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in 1..{self.num_experts} (the experts), got {self.num_experts_per_tok}"
            )
        if self.local_rope_type != "default":
            raise ConfigError(f"unsupported rope type {self.local_rope_type!r} for the sliding-window layers")

    @property
    def max_context_len(self) -> int:
        """The longest context the model serves (its positions; a sliding window is computed, not a cap)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The tokens layer `layer`'s queries see (themselves included); None: the whole context."""
        if self.sliding_window and self.layer_types is not None and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """Where every layer is windowed: the window, past which no layer reads a token's KV
        again (the scheduler frees such blocks, engine/core/kv_cache_manager.py). None where
        some layer sees the whole context (Gemma 3's global layers): every block stays."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return None if None in windows else self.sliding_window

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context length to serve: `requested`, or the model's own when None. More than
        the model computes exactly is refused, as vLLM refuses it."""
        if requested is None:
            return self.max_context_len
        if requested > self.max_context_len:
            raise ConfigError(
                f"max_model_len {requested} exceeds the model's context of {self.max_context_len} tokens"
                " (max_position_embeddings)"
            )
        return requested

    @property
    def registered(self) -> Architecture:
        """This architecture's registry entry (engine/model/architectures.py)."""
        return ARCHITECTURES[self.architecture]

    @property
    def qk_norm(self) -> bool:
        return self.registered.qk_norm

    @property
    def checkpoint_scheme(self):
        """The pre-quantized checkpoint's CheckpointScheme, or None (full precision)."""
        from splitserve.engine.quant.checkpoint_scheme import checkpoint_scheme

        return checkpoint_scheme(self.quantization_config)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        arch = archs[0]
        refused = unsupported_feature(arch, raw) if arch in ARCHITECTURES else None
        if refused is not None:
            raise ConfigError(refused)
        missing = [k for k in ("num_attention_heads", "hidden_size") if k not in raw]
        if missing:
            raise ConfigError(f"config.json is missing required key {missing[0]!r}")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        # transformers 5 nests rope settings under rope_parameters.
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") not in ("default", None):
                rope_scaling = rope_params
        try:
            fields: dict[str, Any] = dict(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias; the others only when attention_bias is set.
                attention_bias=bool(
                    raw.get("attention_bias", arch in ARCHITECTURES and ARCHITECTURES[arch].attention_bias)
                ),
                dtype=dtype,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quantization_config=raw.get("quantization_config"),
            )
            if arch in ARCHITECTURES:
                fields.update(window_fields(ARCHITECTURES[arch], raw))
            if arch == "Gemma3ForCausalLM":
                fields.update(gemma3_fields(raw))
            if arch in ARCHITECTURES and ARCHITECTURES[arch].moe_weight_names is not None:
                fields.update(moe_fields(raw))
        except KeyError as exc:
            raise ConfigError(f"config.json is missing required key {exc.args[0]!r}") from None
        return cls(**fields)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


@dataclass
class EngineConfig:
    """Sizes of the KV cache and the batch; shared by the colocated engine and the workers."""

    model: str
    block_size: int = 16
    num_kv_blocks: int = DEFAULT_NUM_KV_BLOCKS  # blocks in the preallocated cache tensor (any device)
    max_num_seqs: int = 64  # sequences in one running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
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
    # decoding steps synchronously whatever this says. None (the default): where it pays, i.e.
    # on a CUDA device, whose forward runs off the host; on CPU the synchronous step, because
    # there the forward thread and the host work share one GIL and the overlap measured slower
    # (bench/results/overlap.md). __post_init__ resolves it to a bool.
    async_scheduling: bool | None = None
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

        if self.async_scheduling is None and async_scheduling_pays(self.device):
            self.async_scheduling = True  # on CPU it depends on the model: PagedEngine decides

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
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be >= block_size")
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
        from splitserve.engine.lora.lora_config import check_lora_settings

        check_lora_settings(self)
