"""ServeConfig: the one validated description of a splitserve deployment.

`splitserve serve` builds it from flags / a YAML file, and the Helm chart renders the same
fields into the RayService's serveConfigV2 `args`; both go through splitserve.cluster.app.build_app.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RouterPolicy = Literal["kv", "round-robin", "least-loaded", "random"]
ROUTER_POLICIES: tuple[str, ...] = ("kv", "round-robin", "least-loaded", "random")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolResources(_Strict):
    """What one replica asks Ray for. Custom resources (e.g. {"prefill_gpu": 1}) pin a pool
    to the node type that advertises them, so prefill and decode land on different GPUs."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)


class AutoscalingConfig(_Strict):
    enabled: bool = False
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    step: int = Field(1, ge=1)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_stale_s: float = Field(10.0, gt=0)
    interval_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class PrefillAutoscalingConfig(AutoscalingConfig):
    target_queued_tokens_per_replica: int = Field(2048, ge=1)
    ttft_target_ms: float = Field(2000.0, gt=0)


class DecodeAutoscalingConfig(AutoscalingConfig):
    target_kv_usage: float = Field(0.8, gt=0, le=1)
    target_running_per_replica: int = Field(32, ge=1)
    itl_target_ms: float = Field(200.0, gt=0)


class EnginePoolConfig(_Strict):
    replicas: int = Field(1, ge=0)
    resources: PoolResources = Field(default_factory=PoolResources)
    num_kv_blocks: int = Field(1024, ge=2)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    torch_threads: int | None = Field(None, ge=1)


class PrefillPoolConfig(EnginePoolConfig):
    autoscaling: PrefillAutoscalingConfig = Field(default_factory=PrefillAutoscalingConfig)


class DecodePoolConfig(EnginePoolConfig):
    autoscaling: DecodeAutoscalingConfig = Field(default_factory=DecodeAutoscalingConfig)


class RouterConfig(_Strict):
    policy: RouterPolicy = "kv"
    prefix_weight: float = Field(1.0, ge=0)  # credit per cached prompt token
    queue_weight: float = Field(1.0, ge=0)  # cost per queued prefill token
    running_weight: float = Field(64.0, ge=0)  # cost per running request
    # Conditional disaggregation: when fewer uncached prompt tokens than this remain on
    # the chosen decode replica, it prefills them itself and no KV moves.
    local_prefill_threshold: int = Field(32, ge=0)


class ServeConfig(_Strict):
    model: str | None = None  # None: the cached `small` preset model
    served_model_name: str | None = None
    block_size: int = Field(16, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    prefill: PrefillPoolConfig = Field(default_factory=PrefillPoolConfig)
    decode: DecodePoolConfig = Field(default_factory=DecodePoolConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    http_host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)
    api_key: str | None = None
    max_queued_requests: int = Field(256, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    # Only with api_key set: without keys, clients are bounded by max_queued_requests alone.
    max_requests_per_key: int = Field(128, ge=1)
    # Address the KV rendezvous stores bind to and publish: "auto" = the node's IP (clusters).
    transport_host: str = "127.0.0.1"
    layerwise_transfer: bool = True  # send each layer's KV as soon as it is computed
    kv_transfer_lease_s: float = Field(20.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    max_retries: int = Field(1, ge=0)

    @model_validator(mode="after")
    def _check_block_size(self) -> ServeConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        return self
