"""`splitserve serve`: start (or join) a Ray cluster and serve the app until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request

import yaml

from splitserve.cluster.config import ROUTER_POLICIES, ServeConfig


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model: prefill and decode pools, router, OpenAI HTTP and gRPC",
        description="Start a local Ray cluster (or join one with --address) and serve a model with "
        "separate prefill and decode pools. Every flag can also come from --config FILE.yaml "
        "(a ServeConfig mapping); flags given on the command line win.",
    )
    p.add_argument("--config", help="YAML file with ServeConfig fields")
    p.add_argument("--address", help="join an existing Ray cluster ('auto' or host:port); default: start a local one")
    p.add_argument("--model", help="checkpoint directory (default: the `small` preset, made once)")
    p.add_argument("--served-model-name")
    p.add_argument("--prefill-replicas", type=int)
    p.add_argument("--decode-replicas", type=int)
    for pool in ("prefill", "decode"):
        p.add_argument(f"--{pool}-num-cpus", type=float, help=f"CPUs per {pool} replica")
        p.add_argument(f"--{pool}-num-gpus", type=float, help=f"GPUs per {pool} replica")
        p.add_argument(
            f"--{pool}-resources", help=f"custom Ray resources per {pool} replica, JSON, e.g. '{{\"{pool}_gpu\": 1}}'"
        )
        p.add_argument(f"--{pool}-num-kv-blocks", type=int)
        p.add_argument(f"--{pool}-min-replicas", type=int, help=f"autoscaling floor ({pool})")
        p.add_argument(f"--{pool}-max-replicas", type=int, help=f"autoscaling ceiling ({pool}); enables autoscaling")
    p.add_argument("--max-num-seqs", type=int, help="running sequences per replica (both pools)")
    p.add_argument("--router", choices=ROUTER_POLICIES, help="routing policy (default kv)")
    p.add_argument(
        "--local-prefill-threshold", type=int, help="uncached prompt tokens below which decode prefills itself"
    )
    p.add_argument("--block-size", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--http-host")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-host")
    p.add_argument("--grpc-port", type=int)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (env SPLITSERVE_API_KEY)",
    )
    p.add_argument("--max-queued-requests", type=int)
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray cluster (default: enough for the pools)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run_serve)


def _set(d: dict, path: str, value) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    raw: dict = {}
    if args.config:
        with open(args.config) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{args.config} must hold a mapping of ServeConfig fields")
    flat = {
        "model": "model",
        "served_model_name": "served_model_name",
        "prefill_replicas": "prefill.replicas",
        "decode_replicas": "decode.replicas",
        "router": "router.policy",
        "local_prefill_threshold": "router.local_prefill_threshold",
        "block_size": "block_size",
        "dtype": "dtype",
        "device": "device",
        "http_host": "http_host",
        "http_port": "http_port",
        "grpc_host": "grpc_host",
        "grpc_port": "grpc_port",
        "api_key": "api_key",
        "max_queued_requests": "max_queued_requests",
    }
    for attr, path in flat.items():
        value = getattr(args, attr)
        if value is not None:
            _set(raw, path, value)
    for pool in ("prefill", "decode"):
        for attr, path in (
            (f"{pool}_num_cpus", "resources.num_cpus"),
            (f"{pool}_num_gpus", "resources.num_gpus"),
            (f"{pool}_num_kv_blocks", "num_kv_blocks"),
            (f"{pool}_min_replicas", "autoscaling.min_replicas"),
            (f"{pool}_max_replicas", "autoscaling.max_replicas"),
        ):
            value = getattr(args, attr)
            if value is not None:
                _set(raw, f"{pool}.{path}", value)
        if getattr(args, f"{pool}_max_replicas") is not None:
            _set(raw, f"{pool}.autoscaling.enabled", True)
        res = getattr(args, f"{pool}_resources")
        if res:
            _set(raw, f"{pool}.resources.resources", json.loads(res))
        if args.max_num_seqs is not None:
            _set(raw, f"{pool}.max_num_seqs", args.max_num_seqs)
    return ServeConfig.model_validate(raw)


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except Exception as exc:  # not up yet
            last = str(exc)
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy at {url} after {timeout_s:.0f} s ({last})")


def run_serve(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        print(f"splitserve serve: error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        return 0
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from splitserve.cluster.app import build_app
    from splitserve.cluster.default_model import resolve_model

    cfg = cfg.model_copy(update={"model": resolve_model(cfg.model)})
    if args.address:
        ray.init(address=args.address, logging_level="WARNING")
    else:
        need = (
            int(
                cfg.prefill.replicas * cfg.prefill.resources.num_cpus
                + cfg.decode.replicas * cfg.decode.resources.num_cpus
            )
            + 2
        )
        ray.init(
            address="local",
            num_cpus=args.num_cpus or max(os.cpu_count() or 2, need),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="WARNING",
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
        serve.run(build_app(cfg.model_dump()), name="splitserve", route_prefix="/", blocking=False)
        _wait_healthy(f"http://{_client_host(cfg.http_host)}:{cfg.http_port}/health", args.startup_timeout)
        print(f"splitserve: model {cfg.model}", flush=True)
        print(f"splitserve: OpenAI HTTP on http://{cfg.http_host}:{cfg.http_port}/v1", flush=True)
        print(f"splitserve: gRPC on {cfg.grpc_host}:{cfg.grpc_port}", flush=True)
        print("splitserve: ready (Ctrl-C to stop)", flush=True)
        while not stop.wait(1.0):
            pass
        print("splitserve: shutting down", flush=True)
        return 0
    except Exception as exc:
        print(f"splitserve serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
