"""What `splitserve serve` checks before it starts Ray: a bad model directory, config.json,
tokenizer, weights or --max-model-len, a server module that does not import, or a taken port
(naming the process that holds it), is reported in one line in a second, instead of as a
failed Ray Serve deployment a minute later."""

from __future__ import annotations

import importlib
import socket

from splitserve.cluster.config import ServeConfig

# What the ingress replica imports (splitserve.cluster.app's builder): importing them here
# first turns a broken install into one line instead of a replica that never starts.
INGRESS_MODULES = (
    "splitserve.cluster.app",
    "splitserve.cluster.frontend.backend",
    "splitserve.cluster.frontend.http.api",
    "splitserve.cluster.frontend.grpc.server",
)


class PreflightError(Exception):
    """A problem found before start-up, phrased as the one line the user sees."""


def check_model(cfg: ServeConfig) -> str:
    """The checkpoint directory to serve (the default one is made if needed), after checking
    its directory, config.json, weights, tokenizer and cfg.max_model_len against it."""
    from splitserve.cluster.default_model import resolve_model
    from splitserve.engine.config import ConfigError
    from splitserve.engine.io.tokenizer import Tokenizer, TokenizerError
    from splitserve.engine.model.checkpoint import CheckpointError, require_model_dir, weight_files
    from splitserve.engine.model_config import ModelConfig

    model_dir = resolve_model(cfg.model)
    try:
        require_model_dir(model_dir)
        model_config = ModelConfig.from_pretrained(model_dir)
        max_model_len = model_config.resolve_max_model_len(cfg.max_model_len)
        _check_head_map(cfg, model_config)
        for name, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            _check_kv_cache(name, pool, cfg, model_config, max_model_len)
            _check_tensor_parallel(name, pool, cfg, model_dir, model_config)
        _check_weight_headers(weight_files(model_dir))
        Tokenizer.from_pretrained(model_dir)
        _check_lora_adapters(cfg, model_config)
    except (CheckpointError, ConfigError, TokenizerError) as exc:
        hint = "" if cfg.model else " (the default model; delete it to have it made again)"
        raise PreflightError(f"model {model_dir}{hint}: {exc}") from None
    stored = model_config.checkpoint_scheme
    if stored is not None and cfg.quantization not in ("none", stored.scheme):
        raise PreflightError(
            f"model {model_dir} is quantized as {stored.scheme} ({stored.method} {stored.format}); "
            f"--quantization {cfg.quantization} disagrees (leave it unset)"
        )
    draft_model = cfg.speculative.draft_model
    if cfg.speculative.method == "draft" and draft_model:  # SpeculativeConfig requires it for "draft"
        _check_draft_model(draft_model, model_config.vocab_size)
    return model_dir


def _check_kv_cache(name, pool, cfg: ServeConfig, model_config, max_model_len: int) -> None:
    """A kv_cache_memory_bytes that cannot hold one max_model_len sequence fails here, not in
    every replica."""
    from splitserve.engine.config import ConfigError
    from splitserve.engine.kv_cache_sizing import kv_cache_summary

    try:
        kv_cache_summary(
            model_config,
            cfg.block_size,
            pool.kv_cache_dtype,
            cfg.dtype,
            pool.num_kv_blocks,
            pool.kv_cache_memory_bytes,
            max_model_len,
        )
    except ConfigError as exc:
        raise PreflightError(f"{name}: {exc}") from None


def _check_tensor_parallel(name, pool, cfg: ServeConfig, model_dir: str, model_config) -> None:
    """A TP size that cannot split the model (or that a setting does not support) fails here,
    naming the numbers, not in every rank of every replica."""
    from splitserve.cluster.control.worker_pool import engine_config_for
    from splitserve.engine.config import ConfigError, EngineConfig
    from splitserve.engine.parallel.shard_plan import (
        check_quantized_split,
        check_tensor_parallel_size,
        refuse_unsupported,
    )

    try:
        check_tensor_parallel_size(model_config, pool.tensor_parallel_size)
        engine_config = EngineConfig(**engine_config_for(cfg, pool, model_dir))
        refuse_unsupported(engine_config)
        check_quantized_split(model_config, pool.tensor_parallel_size, engine_config.quantization)
    except ConfigError as exc:
        raise PreflightError(f"{name}: {exc}") from None


def _check_lora_adapters(cfg: ServeConfig, model_config) -> None:
    """Every adapter of --lora-modules read and checked against the model (a missing
    directory or file, a rank above --max-lora-rank, another base's shapes), not in every
    replica."""
    if not cfg.lora_modules:
        return
    from splitserve.engine.lora.peft_checkpoint import LoraAdapterError, load_peft_adapter

    for name, path in cfg.lora_modules.items():
        try:
            load_peft_adapter(name, path, model_config, cfg.max_lora_rank)
        except LoraAdapterError as exc:
            raise PreflightError(str(exc)) from None


def _check_head_map(cfg: ServeConfig, model_config) -> None:
    """With a prefill pool, each decode rank receives its KV heads from the prefill ranks that
    hold them (kvtransfer/head_map.py): two TP sizes that cannot share the model's KV heads
    fail here, naming both and the heads."""
    from splitserve.engine.config import ConfigError
    from splitserve.kvtransfer.head_map import check_head_map

    if not (cfg.prefill.replicas or cfg.prefill.autoscaling.enabled):
        return  # no KV moves: each decode replica prefills its own prompts
    prefill, decode = cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size
    try:
        check_head_map(model_config.num_key_value_heads, prefill, decode)
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None


def _check_draft_model(draft_dir: str, vocab_size: int) -> None:
    """The draft checkpoint loads and shares the served model's vocabulary (decode replicas
    would otherwise fail one by one at start-up)."""
    from splitserve.engine.config import ConfigError
    from splitserve.engine.model.checkpoint import CheckpointError, require_model_dir, weight_files
    from splitserve.engine.model_config import ModelConfig

    try:
        require_model_dir(draft_dir)
        draft_vocab = ModelConfig.from_pretrained(draft_dir).vocab_size
        _check_weight_headers(weight_files(draft_dir))
    except (CheckpointError, ConfigError) as exc:
        raise PreflightError(f"draft model {draft_dir}: {exc}") from None
    if draft_vocab != vocab_size:
        raise PreflightError(
            f"draft model {draft_dir} has a vocabulary of {draft_vocab} tokens, the served model {vocab_size}: "
            "the draft must use the same tokenizer"
        )


def _check_weight_headers(paths) -> None:
    """Open every safetensors file (reads its header only): a truncated or foreign file fails
    here, not in every worker."""
    from safetensors import safe_open

    from splitserve.engine.model.checkpoint import CheckpointError

    for path in paths:
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except Exception as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None


def check_tenants(cfg: ServeConfig) -> None:
    """The tenants file and every api_keys_file read and valid (an error names the line)."""
    if not cfg.tenants and not cfg.tenants_file:
        return
    from splitserve.cluster.tenants.tenant_directory import TenantDirectory
    from splitserve.cluster.tenants.tenants_file import TenantsFileError

    try:
        TenantDirectory.load(cfg.tenants, cfg.tenants_file, cfg.api_key)
    except TenantsFileError as exc:
        raise PreflightError(f"tenants: {exc}") from None


def check_imports() -> None:
    for name in INGRESS_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise PreflightError(f"cannot import {name}: {type(exc).__name__}: {exc}") from None


def check_ports(cfg: ServeConfig) -> None:
    """The HTTP and gRPC ports are free on this machine (for a local cluster, where they are
    bound): taken ports would otherwise fail inside Ray Serve, far from the cause."""
    for what, host, port in (("HTTP", cfg.http_host, cfg.http_port), ("gRPC", cfg.grpc_host, cfg.grpc_port)):
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                flag = "--port" if what == "HTTP" else "--grpc-port"
                holder = port_holder(port)
                raise PreflightError(
                    f"cannot listen for {what} on {host}:{port}: {exc.strerror}{holder}; choose another with {flag}"
                ) from None


def port_holder(port: int) -> str:
    """` (held by NAME, pid PID)` for the process on this host listening on port, or "" when
    none is seen (another user's process, or one outside this network namespace). A stale
    HAProxy (Ray's, outliving `ray stop`) is named as such, with how to stop it."""
    import psutil

    try:
        pids = {c.pid for c in psutil.net_connections(kind="inet") if c.laddr and c.laddr.port == port and c.pid}
    except psutil.Error:  # e.g. not permitted on this platform
        return ""
    for pid in sorted(pids):
        try:
            name = psutil.Process(pid).name()
        except psutil.Error:
            name = "a process"
        hint = f": a stale Ray HAProxy? stop it with `kill {pid}`" if "haproxy" in name.lower() else ""
        return f" (held by {name}, pid {pid}{hint})"
    return ""
