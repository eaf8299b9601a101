"""The prefill and decode pools' settings (replicas, resources, KV cache, autoscaling): fields
of ServeConfig and of each entry of its `models` list (cluster/model_entry_config.py), so both
import them from here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.engine.config import DEFAULT_NUM_KV_BLOCKS, ConfigError, EngineKind, KvCacheDtype, parse_memory_bytes

# A served CPU step below this many tokens runs on one torch thread (engine/step_threads.py):
# measured colocated on 2 cores (bench/results/vs_vllm_bench.md), decode steps up to batch 32
# and 200-token prompts ran faster on one thread, 1,000-token prompts on two.
THREADED_STEP_MIN_TOKENS = 512


class StrictConfig(BaseModel):
    """Settings that refuse unknown keys; each field's docstring is its help and schema text."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class PoolResources(StrictConfig):
    """What one replica asks Ray for. Custom resources (e.g. {"prefill_gpu": 1}) pin a pool
    to the node type that advertises them, so prefill and decode land on different GPUs."""

    num_cpus: float = Field(1.0, ge=0)
    """CPUs per replica."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per replica (device "auto" runs on CUDA when > 0)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per replica, e.g. {"prefill_gpu": 1}."""


class AutoscalingConfig(StrictConfig):
    enabled: bool = False
    """Scale this pool between min_replicas and max_replicas from its load."""
    policy: Literal["reactive", "sla"] = "reactive"
    """reactive: scale on this pool's load and latency against its targets; sla: size both pools together from the forecast arrival rate and lengths with `splitserve plan`'s queue model (`planner` settings; every autoscaled pool must then use it)."""
    min_replicas: int = Field(1, ge=0)
    """Autoscaling floor."""
    max_replicas: int = Field(1, ge=1)
    """Autoscaling ceiling."""
    step: int = Field(1, ge=1)
    """Replicas added or removed per decision."""
    upscale_delay_s: float = Field(5.0, ge=0)
    """How long the load must stay high before a scale-up."""
    downscale_delay_s: float = Field(30.0, ge=0)
    """How long the load must stay low before a scale-down."""
    metrics_stale_s: float = Field(10.0, gt=0)
    """Replica metrics older than this are not acted on."""
    interval_s: float = Field(1.0, gt=0)
    """Seconds between autoscaling decisions."""

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class PrefillAutoscalingConfig(AutoscalingConfig):
    target_queued_tokens_per_replica: int = Field(2048, ge=1)
    """Queued prompt tokens per prefill replica to aim for."""
    ttft_target_ms: float = Field(2000.0, gt=0)
    """p90 time to first token above which prefill scales up."""


class DecodeAutoscalingConfig(AutoscalingConfig):
    target_kv_usage: float = Field(0.8, gt=0, le=1)
    """KV-cache usage per decode replica to aim for."""
    target_running_per_replica: int = Field(32, ge=1)
    """Running sequences per decode replica to aim for."""
    itl_target_ms: float = Field(200.0, gt=0)
    """p90 inter-token latency above which decode scales up."""


class EnginePoolConfig(StrictConfig):
    replicas: int = Field(1, ge=0)
    """Replicas at start (prefill 0: decode prefills locally)."""
    resources: PoolResources = Field(default_factory=PoolResources)
    """What one replica asks Ray for."""
    num_kv_blocks: int = Field(DEFAULT_NUM_KV_BLOCKS, ge=2)
    """KV-cache blocks per replica (block_size tokens each)."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """KV-cache storage: auto = the model dtype; fp8 (e4m3) or int8 = 1 byte per value plus a float16 scale per token and head. Prefill and decode must agree."""
    kv_cache_memory_bytes: int | str | None = None
    """KV-cache bytes per replica, e.g. 4Gi or 500M (K/M/G = 1000^n, Ki/Mi/Gi = 1024^n); sets the block count from the bytes one block takes (scales included) and overrides num_kv_blocks; unset: num_kv_blocks."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences in one running batch."""
    max_num_batched_tokens: int = Field(2048, ge=16)
    """Token budget of one engine step (chunked prefill)."""
    mixed_step_prefill_tokens: int = Field(0, ge=0)
    """Prompt tokens a step that also decodes may compute (a step with no decode row takes max_num_batched_tokens): a smaller cap stretches the time between the running requests' tokens less while prompts arrive; 0: no cap."""
    torch_threads: int | None = Field(None, ge=1)
    """torch threads per replica; unset: its num_cpus."""
    threaded_step_min_tokens: int = Field(THREADED_STEP_MIN_TOKENS, ge=0)
    """On CPU, an engine step computing fewer tokens runs on one torch thread, a larger one on all torch_threads (a small step's second thread waits for a core that the node's ingress, proxy and Ray hold); 0: every step on all."""
    engine: EngineKind | None = None
    """This pool's engine (real or simulated); unset: the top-level `engine`."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per replica (one CPU or GPU each, on one node); 1: one actor per replica. Prefill and decode may differ: each decode rank receives its KV heads from the prefill ranks holding them."""

    @field_validator("kv_cache_memory_bytes")
    @classmethod
    def _parse_kv_cache_memory_bytes(cls, value: int | str | None) -> int | None:
        if value is None:
            return None
        try:
            return parse_memory_bytes(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None


class PrefillPoolConfig(EnginePoolConfig):
    autoscaling: PrefillAutoscalingConfig = Field(default_factory=PrefillAutoscalingConfig)
    """Prefill autoscaling (on queued prompt tokens and TTFT)."""


class DecodePoolConfig(EnginePoolConfig):
    autoscaling: DecodeAutoscalingConfig = Field(default_factory=DecodeAutoscalingConfig)
    """Decode autoscaling (on KV usage, running sequences and ITL)."""
