"""`splitserve serve [MODEL]`: check the model, start (or join) a Ray cluster, serve until Ctrl-C.

Exit status: 0 after Ctrl-C / SIGTERM, 2 for a bad flag, config or model (found before Ray
starts), 1 when the server fails to start (its root cause printed once), 130 on Ctrl-C
during start-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

import yaml

from splitserve.cluster.cli.front_door import FrontDoor, resolve_http_listener
from splitserve.cluster.cli.preflight import PreflightError, check_imports, check_model, check_ports, check_tenants
from splitserve.cluster.cli.serve_flags import SERVE_USAGE, ServeFlagsError, add_serve_flags, config_from_args
from splitserve.cluster.config import ServeConfig

PROG = "splitserve serve"
APP_NAME = "splitserve"
EPILOG = """\
Every ServeConfig field is a flag (see above); --config FILE.yaml holds the same fields and
flags override it. The model id clients send is --served-model-name, else MODEL exactly as
given. The local Ray cluster runs with Ray's token authentication (RAY_AUTH_MODE=token, token
in ~/.ray/auth_token); set RAY_AUTH_MODE=disabled to turn it off. SPLITSERVE_LOG_LEVEL=DEBUG
also logs /metrics and /health requests. On CPU (float32), decode steps and a fresh prompt's
prefill each run as one TorchScript call; SPLITSERVE_CPU_DECODE_FORWARD=eager and
SPLITSERVE_CPU_PREFILL_FORWARD=eager, in the replicas' environment, keep the eager forward
(the A/B switches). With one ingress replica (the default) on a local cluster, that replica
answers HTTP on --http-port itself and Serve runs no proxy; otherwise HTTP goes through Ray's
HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1); --http-listener chooses. The
throughput-optimized Serve settings are set before Ray starts; your own values of those
variables win."""


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model: prefill and decode pools, router, OpenAI HTTP and gRPC",
        usage=SERVE_USAGE,
        description="Start a local Ray cluster (or join one with --address) and serve MODEL (a local "
        "Hugging Face checkpoint directory) with separate prefill and decode pools.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # The short form --router replaces pydantic-settings' hidden `--router JSON` flag.
        conflict_handler="resolve",
    )
    add_serve_flags(p)
    own = p.add_argument_group("splitserve serve itself")
    own.add_argument("--address", help="join an existing Ray cluster ('auto' or host:port); default: start a local one")
    own.add_argument("--num-cpus", type=int, help="CPUs of the local Ray cluster (default: enough for the pools)")
    own.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server to be ready")
    own.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run_serve)


def fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return status


def run_serve(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ServeFlagsError as exc:
        return fail(str(exc), 2)
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
        return 0
    local = not args.address
    # "auto" decided here, once: the replicas read the resolved value from the config they get.
    cfg = cfg.model_copy(update={"http_listener": resolve_http_listener(cfg, local)})
    front_door = FrontDoor(local=local, listener=cfg.http_listener)
    # Before anything imports ray: Ray and Serve read them once.
    front_door_env = _ray_environment(front_door, cfg)
    try:
        try:
            check_tenants(cfg)
            model_dirs = {name: check_model(one) for name, one in cfg.model_deployments()}
            check_imports()
            if not args.address:
                check_ports(cfg)
        except PreflightError as exc:
            return fail(str(exc), 2)
        # The replicas load the resolved directory; clients keep sending the id as the user gave it.
        cfg = _with_resolved_models(cfg, model_dirs)
        return _serve(cfg, args, front_door.controller_options(front_door_env), front_door.proxy_location)
    finally:
        front_door.cleanup()


def _with_resolved_models(cfg: ServeConfig, model_dirs: dict[str, str]) -> ServeConfig:
    """cfg with every model's checkpoint as the absolute directory found, its served name kept."""
    if not cfg.models:
        (model_dir,) = model_dirs.values()
        return cfg.model_copy(update={"served_model_name": cfg.model_id, "model": os.path.abspath(model_dir)})
    entries = [
        entry.model_copy(update={"served_model_name": name, "model": os.path.abspath(model_dirs[name])})
        for entry, name in zip(cfg.models, model_dirs)
    ]
    return cfg.model_copy(update={"models": entries})


def _ray_environment(front_door: FrontDoor, cfg) -> dict[str, str]:
    """Set the process environment Ray starts with; returns the front door's variables (a
    local cluster gets them here, a joined one through Serve's controller options)."""
    local = front_door.local
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray Serve's own logs (controller, proxy, replica start-up tracebacks) go to its files
    # under /tmp/ray/session_latest/logs/serve; the console gets splitserve's lines.
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    if local:
        # Ray turns token auth on for every new local cluster and warns so on each start;
        # choosing it explicitly keeps the protection and drops the warning.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    env = front_door.environment(cfg)
    if local:
        os.environ.update(env)
    return env


def _serve(cfg, args: argparse.Namespace, controller_options: dict | None, proxy_location: str | None) -> int:
    import ray
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # "Started Serve", "Application is ready"...
    try:
        failure = _start(ray, serve, cfg, args, controller_options, proxy_location)
    except KeyboardInterrupt:
        print("splitserve: interrupted during start-up; shutting down", flush=True)
        _shutdown(ray, serve)
        return 130
    if failure is not None:
        _shutdown(ray, serve)  # first, so that no forwarded log line follows ours
        return fail(failure, 1)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for name, one in cfg.model_deployments():
        print(f"splitserve: model {name} ({one.model})", flush=True)
    print(f"splitserve: OpenAI HTTP on http://{cfg.http_host}:{cfg.http_port}/v1", flush=True)
    if cfg.grpc_port:
        print(f"splitserve: gRPC on {cfg.grpc_host}:{cfg.grpc_port}", flush=True)
    else:  # each ingress replica bound a port of its own; no one address to announce
        print(f"splitserve: gRPC on {cfg.grpc_host}, a free port per ingress replica (--grpc-port 0)", flush=True)
    print("splitserve: ready (Ctrl-C to stop)", flush=True)
    watch = _AppWatch(serve)
    while not stop.wait(1.0):
        watch.check()
    print("splitserve: shutting down", flush=True)
    # A second Ctrl-C while the replicas drain must not interrupt the clean-up half-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _shutdown(ray, serve)
    return 0


def _start(
    ray, serve, cfg, args: argparse.Namespace, controller_options: dict | None, proxy_location: str | None
) -> str | None:
    """Start Ray, Serve and the app, and wait until it is healthy; the failure, if any.
    proxy_location: "Disabled" where the ingress replica listens on the HTTP port itself."""
    from splitserve.cluster.app import build_app

    try:
        if args.address:
            ray.init(address=args.address, logging_level="WARNING")
        else:
            need = int(cfg.prefill.replicas * cfg.prefill.resources.num_cpus)
            need += int(cfg.decode.replicas * cfg.decode.resources.num_cpus) + 2
            ingress = cfg.ingress
            need += int(ingress.num_cpus * max(ingress.replicas, ingress.autoscaling.max_replicas))
            ray.init(
                address="local",
                num_cpus=args.num_cpus or max(os.cpu_count() or 2, need),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                logging_level="WARNING",
            )
        serve.start(
            # keep_alive_timeout_s: uvicorn's idle keep-alive and HAProxy's `timeout http-keep-alive`.
            http_options={
                "host": cfg.http_host,
                "port": cfg.http_port,
                "keep_alive_timeout_s": cfg.http_keep_alive_timeout_s,
            },
            logging_config={"log_level": "WARNING"},
            controller_options=controller_options,
            proxy_location=proxy_location,
        )
    except Exception as exc:
        return f"cannot start Ray Serve: {exc}"
    try:
        serve.run(build_app(cfg.model_dump(), fail_fast=True), name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as exc:
        return f"the server failed to start: {_deployment_failure(serve) or exc}"
    try:
        _wait_healthy(f"http://{_client_host(cfg.http_host)}:{cfg.http_port}/health", args.startup_timeout)
    except TimeoutError as exc:
        return str(exc)
    return None


def _deployment_failure(serve) -> str | None:
    """The root cause from the failed deployments' status: the controller's or the
    ingress's StartupError line."""
    from splitserve.cluster.app import CONTROLLER_DEPLOYMENT_NAME, DEPLOYMENT_NAME
    from splitserve.cluster.startup_error import root_cause, startup_error_in

    try:
        app = serve.status().applications[APP_NAME]
    except Exception:
        return None
    deployments = [app.deployments.get(name) for name in (CONTROLLER_DEPLOYMENT_NAME, DEPLOYMENT_NAME)]
    messages = [d.message for d in deployments if d is not None and d.message] + [app.message]
    for message in messages:
        found = startup_error_in(message or "")
        if found:
            return found
    return next((root_cause(RuntimeError(m)) for m in messages if m), None)


class _AppWatch:
    """Says on the console when the application leaves RUNNING (its replica died, ...): Serve's
    own logs go to files, so nothing else would."""

    def __init__(self, serve, interval_s: float = 5.0):
        self.serve, self.interval_s = serve, interval_s
        self.last_status, self.next_check = "RUNNING", time.monotonic() + interval_s

    def check(self) -> None:
        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + self.interval_s
        try:
            status = getattr(self.serve.status().applications[APP_NAME].status, "value", "UNKNOWN")
        except Exception:
            return
        if status != self.last_status:
            detail = _deployment_failure(self.serve) if status != "RUNNING" else None
            print(f"splitserve: the application is {status}" + (f": {detail}" if detail else ""), flush=True)
            self.last_status = status


def _shutdown(ray, serve) -> None:
    """Delete the app (the controller kills the pools, the ingresses stop the gRPC server),
    reap any pool actor still named in the app's namespace (one whose controller was killed
    and could not), then leave Ray: a local cluster ends with it. serve.shutdown() is not
    used: it kills Serve's controller while its graceful_shutdown task runs, and the raylet
    then logs that task as failed."""
    from splitserve.cluster.control.worker_pool import app_namespaces, reap_namespace

    try:
        if ray.is_initialized() and APP_NAME in serve.status().applications:
            serve.delete(APP_NAME)
    except Exception as exc:
        print(f"splitserve: could not stop the app cleanly: {exc}", file=sys.stderr, flush=True)
    finally:
        try:
            if ray.is_initialized():  # after the delete: no controller left to restart them
                # the app's namespace, and each model's where it serves several
                reaped = [name for ns in app_namespaces(APP_NAME) for name in reap_namespace(ns)]
                if reaped:
                    print(f"splitserve: removed {len(reaped)} pool actor(s) left running", flush=True)
        except Exception as exc:
            print(f"splitserve: could not remove the pool actors: {exc}", file=sys.stderr, flush=True)
        ray.shutdown()


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


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
