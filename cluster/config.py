"""ServeConfig: the one validated description of a splitserve deployment.

`splitserve serve` derives its flags from it (cluster/cli/serve_flags.py) and reads the same
fields from a YAML file; the Helm chart renders them into the RayService's serveConfigV2
`args` and validates them with values.schema.json, which is generated from these models.
Every field's docstring is its description: the `--help` text and the schema's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from splitserve.cluster.control_plane_config import ControllerConfig, IngressConfig, ReplicaStateConfig
from splitserve.cluster.default_model import DEFAULT_MODEL_NAME
from splitserve.cluster.grpc_connection_config import GrpcConnectionConfig
from splitserve.cluster.lora_serve_config import check_lora_settings
from splitserve.cluster.migration_config import MigrationConfig
from splitserve.cluster.model_entry_config import ModelEntryConfig, check_unique_served_names, deep_merge
from splitserve.cluster.model_route_config import (
    AliasTarget,
    ModelRouteConfig,
    check_model_routes,
)
from splitserve.cluster.planner_config import PlannerConfig
from splitserve.cluster.pool_config import (  # noqa: F401 (re-exported: ServeConfig's field types)
    AutoscalingConfig,
    DecodeAutoscalingConfig,
    DecodePoolConfig,
    EnginePoolConfig,
    PoolResources,
    PrefillAutoscalingConfig,
    PrefillPoolConfig,
)
from splitserve.cluster.pool_config import (
    StrictConfig as _Strict,
)
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.cluster.tenants.tenant_config import TenantConfig, check_unique_names
from splitserve.engine.config import ConfigError, Dtype, EngineKind, Quantization
from splitserve.engine.simulated.step_time_profile import StepTimeProfile
from splitserve.engine.speculative.speculative_config import SpeculativeConfig
from splitserve.engine.structured_output.grammar_config import GrammarConfig


class PriorityConfig(_Strict):
    """Priority classes: `interactive` (the default) and `batch` (the Batch API's lines, or a
    request with the header x-splitserve-priority-class: batch). A request's `priority`
    (vLLM's field; lower runs first) overrides its class's default in the engines."""

    policy: Literal["priority", "fcfs"] = "priority"
    """priority: engines order and preempt by priority, batch work only goes where there is headroom; fcfs: every request is equal (first come, first served)."""
    interactive: int = 0
    """Default priority of interactive requests (lower runs first)."""
    batch: int = 100
    """Default priority of batch requests (lower runs first)."""
    batch_max_kv_usage: float = Field(0.7, gt=0, le=1)
    """Batch work goes only to decode replicas whose KV-cache usage is below this (else 429; the batch runner retries later)."""
    batch_max_running_fraction: float = Field(0.4, gt=0, le=1)
    """...and whose running requests are below this fraction of decode.max_num_seqs."""
    autoscale_on_batch: bool = False
    """Let batch requests' latencies drive autoscaling (by default only interactive ones do, so batch backlog never scales up)."""

    @model_validator(mode="after")
    def _check_order(self) -> PriorityConfig:
        if self.batch < self.interactive:
            raise ValueError("batch must not rank ahead of interactive: priority.batch must be >= priority.interactive")
        return self


class BatchConfig(_Strict):
    """The OpenAI Batch API (/v1/files, /v1/batches) and its runner, in every ingress replica."""

    enabled: bool = True
    """Serve /v1/files and /v1/batches and run batch jobs."""
    max_file_bytes: int = Field(64 << 20, ge=1024)
    """Largest /v1/files upload (400 above)."""
    max_lines: int = Field(50_000, ge=1)
    """Most lines (requests) in one batch input file."""
    max_concurrency: int = Field(16, ge=1)
    """Most lines of batch jobs in flight at once; the runner stays below it while requests are refused."""
    lease_s: float = Field(10.0, gt=0)
    """One ingress replica at a time runs the batches, holding a lease in the state store; another takes over this long after it stops renewing."""
    poll_interval_s: float = Field(2.0, gt=0)
    """Seconds between the runner's looks at the store for work changed by other replicas and for expiry (it also renews its lease then: keep it well under lease_s); work changed in its own replica (a batch created or cancelled, a line done) it looks at immediately."""
    retention_s: float = Field(30 * 86400.0, gt=0)
    """Finished batches and their input, output and error files are deleted this long after the batch was created."""


# Fields of the deployment, not of one model: a models entry's own config leaves them out
# (aliases and routes name several models).
DEPLOYMENT_WIDE = {"models", "aliases", "model_routes"}


class ServeConfig(_Strict):
    model: str | None = None
    """Checkpoint directory; unset: the `small` preset, made once. Given more than once: several models (`models`), one per --model."""
    served_model_name: str | None = None
    """Model id clients send; unset: the model exactly as given. Given more than once: the served name of each --model, by position."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length to serve, prompt + output; unset: the model's."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block (a power of two)."""
    dtype: Dtype | None = None
    """Weights and KV-cache dtype; unset: the checkpoint's."""
    quantization: Quantization = "none"
    """Quantize the decoder layers' matmul weights at load, layer by layer (also the draft model's): int8 (weights only, per channel), fp8 (e4m3 W8A8), int4 (weights only, groups of 128)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Engine device: auto = cuda for pools with num_gpus > 0."""
    kv_offloading_size: float = Field(0.0, ge=0)
    """GiB of host memory per prefill and decode replica for a host KV tier: blocks evicted
    from the device cache are kept there and loaded back on a prefix hit; 0 = off."""
    engine: EngineKind = "real"
    """Engine of every pool: real runs the model; simulated keeps the scheduler, KV cache, events and handoff but replaces the forward and the KV transfer by waits from `engine_profile` (torch-free, weights never read)."""
    engine_profile: str | None = None
    """Step-time profile of simulated engines: a shipped name (cpu-fitted, llama-8b-h200, llama-70b-h200) or a YAML/JSON file; unset: cpu-fitted."""
    speed_factor: float = Field(1.0, gt=0)
    """Simulated engines wait speed_factor times the profile's step and transfer times (> 1: a fast cluster in slow motion)."""
    prefill: PrefillPoolConfig = Field(default_factory=PrefillPoolConfig)
    """The prefill pool."""
    decode: DecodePoolConfig = Field(default_factory=DecodePoolConfig)
    """The decode pool."""
    enable_lora: bool = False
    """Serve LoRA adapters on the model (as vLLM's flag of this name does): each is a model of its own in /v1/models (`parent`: the base), and every request's tokens go through its own adapter in one batch with the others and the base."""
    lora_modules: dict[str, str] = Field(default_factory=dict)
    """LoRA adapters to serve as name=path, each a directory as `peft` saves it (adapter_config.json, adapter_model.safetensors): `--lora-modules sql=/adapters/sql chat=/adapters/chat`, or a JSON object; clients select one by its name as `model`. Needs enable_lora."""
    max_loras: int = Field(4, ge=1)
    """LoRA adapter slots per replica on the device: at most this many adapters run in one step; more adapters are served, each copied into a slot (evicting the least recently used idle one) when its requests run."""
    max_lora_rank: int = Field(16, ge=1)
    """Largest LoRA rank served: the slots are sized for it, and an adapter of a higher rank is refused."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """LoRA adapters each replica keeps in host memory (an LRU cache; a miss reads the adapter's directory again); unset: max_loras. At least max_loras."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """The router."""
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    """Speculative decoding in the decode pool (and in decode replicas that prefill locally)."""
    grammar: GrammarConfig = Field(default_factory=GrammarConfig)
    """Structured output: bounds on grammars, schemas and regexes, caches, isolated compiles."""
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    """The ingress replicas (HTTP, gRPC, routing)."""
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    """The controller of the prefill and decode pools."""
    replica_state: ReplicaStateConfig = Field(default_factory=ReplicaStateConfig)
    """How each ingress follows the replicas' KV events and load: pushed (default) or polled."""
    http_host: str = "127.0.0.1"
    """OpenAI HTTP address (0.0.0.0: all interfaces)."""
    http_port: int = Field(8000, ge=0, le=65535)
    """OpenAI HTTP port."""
    http_listener: Literal["auto", "ingress", "haproxy"] = "auto"
    """Who listens on the HTTP port: ingress (the one ingress replica's own uvicorn; Serve runs no
    proxy), haproxy (Ray's HAProxy in front of every ingress replica), auto (`splitserve serve`:
    ingress for one fixed ingress replica on a local cluster, else haproxy; the Helm chart: haproxy)."""
    grpc_host: str = "127.0.0.1"
    """gRPC address."""
    grpc_port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0: each ingress replica listens on a free port of its own)."""
    grpc: GrpcConnectionConfig = Field(default_factory=GrpcConnectionConfig)
    """gRPC connection limits: handshake and request-message timeout, idle timeout, keepalive, caps."""
    api_key: str | None = None
    """Require 'Authorization: Bearer KEY' (env SPLITSERVE_API_KEY)."""
    max_queued_requests: int = Field(256, ge=1)
    """Requests in flight before new ones get 429."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body accepted (413 above)."""
    http_request_timeout_s: float = Field(30.0, gt=0)
    """Seconds a client has to send a request's headers, and again its body; the connection is closed
    past either (a response, however long it streams, is never timed). Also HAProxy's `timeout client`."""
    http_keep_alive_timeout_s: int = Field(15, ge=1)
    """Seconds an idle keep-alive HTTP connection stays open (uvicorn and HAProxy)."""
    http_max_connections: int = Field(4096, ge=1)
    """HTTP connections HAProxy accepts per node (its maxconn); more wait in the kernel's backlog."""
    max_requests_per_key: int = Field(128, ge=1)
    """Requests in flight per API key before 429 (only with api_key set; keyless clients share max_queued_requests)."""
    transport_host: str = "127.0.0.1"
    """Address the KV rendezvous stores bind to and publish (auto: the node's IP)."""
    layerwise_transfer: bool = True
    """Send each layer's KV as soon as it is computed."""
    early_first_token: bool = False
    """A remote prefill's first token streams to the client as soon as the prefill replica has
    sampled it, while its KV still moves (the decode replica starts decoding once it lands). A
    transfer that then fails moves the stream (migration) instead of retrying it, so a request
    with migration off waits for its KV as without this."""
    async_scheduling: bool | None = None
    """Async scheduling: the next engine step is scheduled and prepared while one runs on a forward thread (placeholders for its tokens), and its outputs are built while the next runs, hiding that host work behind the forward pass; speculative decoding always steps synchronously. Unset: on where it pays: a CUDA device, and a CPU decode replica whose decode steps run as one TorchScript call that holds no GIL (fp32, unquantized weights and KV); otherwise (a CPU prefill replica, quantized or bf16 on CPU) the synchronous step, as an eager forward shares the GIL with the host work and measured slower. true forces it on, false off."""
    kv_transfer_lease_s: float = Field(20.0, gt=0)
    """How long prefill pins a request's KV blocks without an ack, and the KV transfer timeout."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Server-side deadline of a request (clients may ask for less)."""
    max_retries: int = Field(1, ge=0)
    """Retries on other replicas while no token has reached the client."""
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    """Streams that outlive their decode replica: moved mid-stream to another one as a continuation."""
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    """The live `sla` autoscaling policy (autoscaling.policy: sla): its profile, GPU budget, lead time and window."""
    priority: PriorityConfig = Field(default_factory=PriorityConfig)
    """Priority classes (interactive, batch) in the engines and admission."""
    batch: BatchConfig = Field(default_factory=BatchConfig)
    """The OpenAI Batch API and its runner."""
    state_dir: str | None = None
    """Directory of the state store (batch files and jobs; SQLite); unset: $SPLITSERVE_CACHE/state, default ~/.cache/splitserve/state."""
    state_url: str | None = None
    """Database of the state store instead of state_dir, e.g. postgresql+psycopg://user:pass@host/db (every ingress replica and the controller reach it)."""
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Tenants: API keys with rate limits, token budgets, allowed models and a default priority (docs/FEATURES.md: Tenants); api_key, if set, is then the unlimited tenant `operator` (the Batch API's lines run under it)."""
    tenants_file: str | None = None
    """A YAML file of tenants (a list, or {tenants: [...]}) added to `tenants`, re-read when it changes (a malformed file keeps the old tenants)."""
    tenants_reload_s: float = Field(2.0, gt=0)
    """How often the tenants file (and api_keys_files) is checked for changes: a revoked key is refused within this."""
    tenant_lease_fraction: float = Field(0.1, gt=0, le=1)
    """Share of a tenant's limit an ingress replica leases from the state store at a time (fewer round trips vs. capacity idle in other replicas)."""
    tenant_lease_s: float = Field(15.0, gt=0)
    """A lease of tenant capacity expires this long after its ingress replica last renewed it (a lost replica's unused capacity returns)."""
    tenant_sync_s: float = Field(1.0, gt=0)
    """How often an ingress replica renews its leases and writes its tenants' usage to the state store."""
    admin_api_key: str | None = None
    """Key of the admin endpoints (/admin/usage, /admin/reload); unset: they answer 404."""
    models: list[ModelEntryConfig] = Field(default_factory=list)
    """Several models in one deployment (docs/FEATURES.md: Several models): each entry its own weights, served name, pools, KV sizing, quantization and speculative config; what an entry leaves unset it takes from the top-level fields. Empty: one model, the top-level fields."""
    aliases: dict[str, AliasTarget] = Field(default_factory=dict)
    """Served names that point at a model ({"chat": "m1"}) or split traffic by weight between models ({"chat": {"m1": 0.9, "m2": 0.1}}, canary / A-B); the response's `model` and the x-splitserve-model header say which answered (docs/FEATURES.md: Model routing)."""
    model_routes: list[ModelRouteConfig] = Field(default_factory=list)
    """Virtual models (e.g. `auto`) whose policy picks a served model per request: rules, cascade (small first, large when its confidence is low) or scorer (docs/FEATURES.md: Model routing)."""

    @property
    def model_id(self) -> str:
        """The id clients send as `model`: served_model_name, else the model exactly as given
        (a path stays a path, as in vLLM), else the default model's name."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    def model_deployments(self) -> list[tuple[str, ServeConfig]]:
        """(served name, that model's own single-model ServeConfig) for every model served: the
        `models` entries over the top-level fields, or this config itself when it has none."""
        if not self.models:
            return [(self.model_id, self)]
        base = self.model_dump(exclude=DEPLOYMENT_WIDE | {"served_model_name"})
        out = []
        for entry in self.models:
            name = entry.served_name(self.model_id)
            merged = deep_merge(base, entry.overrides(), ServeConfig)
            out.append((name, ServeConfig.model_validate({**merged, "served_model_name": name})))
        return out

    @model_validator(mode="after")
    def _check_models(self) -> ServeConfig:
        """Duplicate served names, and an entry whose merged settings do not hold together, are
        startup errors naming the entry."""
        if self.models:
            check_unique_served_names([entry.served_name(self.model_id) for entry in self.models])
            for index, entry in enumerate(self.models):
                try:
                    ServeConfig.model_validate(
                        deep_merge(self.model_dump(exclude=DEPLOYMENT_WIDE), entry.overrides(), ServeConfig)
                    )
                except ValidationError as exc:
                    problems = "; ".join(
                        f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                        for e in exc.errors()
                    )
                    raise ValueError(f"models[{index}] ({entry.served_name(self.model_id)!r}): {problems}") from None
        return self

    @field_validator("state_url")
    @classmethod
    def _check_state_url(cls, url: str | None) -> str | None:
        if url is not None:
            try:
                make_url(url)
            except ArgumentError as e:
                raise ValueError(f"not a database URL (e.g. postgresql+psycopg://user@host/db): {e}") from None
        return url

    @field_validator("tenants")
    @classmethod
    def _check_tenants(cls, tenants: list[TenantConfig]) -> list[TenantConfig]:
        return check_unique_names(tenants)

    @model_validator(mode="after")
    def _check_model_routes(self) -> ServeConfig:
        """A route or alias naming a model (or LoRA adapter) that is not served is a startup
        error naming both."""
        adapters = set(self.lora_modules) if self.enable_lora else set()
        check_model_routes(self.served_model_names() | adapters, self.aliases, self.model_routes)
        return self

    def served_model_names(self) -> set[str]:
        """The model ids served by a real model (aliases and routes point at these)."""
        if not self.models:
            return {self.model_id}
        return {entry.served_name(self.model_id) for entry in self.models}

    @model_validator(mode="after")
    def _check_lora(self) -> ServeConfig:
        check_lora_settings(self)
        return self

    @model_validator(mode="after")
    def _check_http_listener(self) -> ServeConfig:
        if self.http_listener == "ingress" and not self.ingress_is_single():
            raise ValueError("http_listener 'ingress' needs one ingress replica (ingress.replicas 1, no autoscaling)")
        return self

    def ingress_is_single(self) -> bool:
        """Exactly one ingress replica, always: the one that can own the HTTP port itself."""
        return self.ingress.replicas == 1 and not self.ingress.autoscaling.enabled

    @model_validator(mode="after")
    def _check_block_size(self) -> ServeConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        return self

    @model_validator(mode="after")
    def _check_kv_cache_dtype(self) -> ServeConfig:
        # Prefill's blocks land in decode's cache byte for byte: both must store the same format.
        if self.prefill.kv_cache_dtype != self.decode.kv_cache_dtype:
            raise ValueError(
                f"prefill.kv_cache_dtype {self.prefill.kv_cache_dtype!r} and decode.kv_cache_dtype "
                f"{self.decode.kv_cache_dtype!r} differ: KV blocks move from prefill to decode as they are "
                "stored, so both pools must use one KV-cache dtype (--kv-cache-dtype sets both)"
            )
        return self

    @model_validator(mode="after")
    def _check_sla_policy(self) -> ServeConfig:
        """`sla` sizes both pools together: every autoscaled pool uses it, and its profile loads."""
        scaled = [pool.autoscaling for pool in (self.prefill, self.decode) if pool.autoscaling.enabled]
        policies = {cfg.policy for cfg in scaled}
        if "sla" not in policies:
            return self
        if len(policies) > 1:
            raise ValueError("autoscaling.policy sla sizes both pools together: set it on every autoscaled pool")
        try:
            profile = StepTimeProfile.load(self.planner.profile or self.engine_profile)
            for pool in (self.prefill, self.decode):
                profile.for_tensor_parallel(pool.tensor_parallel_size)
        except ConfigError as exc:
            raise ValueError(f"planner.profile: {exc}") from None
        return self

    @model_validator(mode="after")
    def _check_simulation(self) -> ServeConfig:
        """A bad profile is a startup error, not one per replica."""
        simulated = [pool for pool in (self.prefill, self.decode) if (pool.engine or self.engine) == "simulated"]
        if simulated:
            try:
                profile = StepTimeProfile.load(self.engine_profile)
                for pool in simulated:  # each simulated pool's TP size needs the profile's figures
                    profile.for_tensor_parallel(pool.tensor_parallel_size)
            except ConfigError as exc:
                raise ValueError(f"engine_profile: {exc}") from None
            if self.speculative.enabled and (self.decode.engine or self.engine) == "simulated":
                raise ValueError("speculative decoding is not simulated: disable it or use the real decode engine")
            if self.kv_offloading_size > 0:
                raise ValueError("kv_offloading_size: the host KV tier is not simulated; set it to 0")
        return self
