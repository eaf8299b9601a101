"""FrontDoor: the environment that puts Ray's HAProxy ingress in front of the ingress replicas.

HTTP reaches each ingress replica's own uvicorn straight from HAProxy (a C process on every
node) instead of crossing Serve's Python proxy actor per token: RAY_SERVE_ENABLE_HA_PROXY=1,
with what RAY_SERVE_THROUGHPUT_OPTIMIZED=1 implies, so the handlers run on the replica's main
loop (no thread hop per chunk; the frontends move tokenization to a thread). Ray reads these once, at
import, in the controller, proxies and replicas, so they are set before Ray starts: in this
process's environment for a local cluster, or in the Serve controller's runtime_env when
joining one (`--address`), which the proxies and replicas it creates inherit.

With one fixed ingress replica on a local cluster (http_listener "ingress", the default there)
there is nothing to balance: no HAProxy, Serve starts no proxy (proxy_location Disabled), and
the replica serves HTTP from its own listener (cluster/frontend/http/ingress_listener.py);
only the throughput-optimized settings are set.

HAProxy's defaults are fixed ports (stats 8404, metrics 9101, fallback proxy 8500/9500) and
files under /tmp/haproxy-serve; a local cluster gets free ports and a private folder instead,
so several clusters on one machine (parallel test runs) never collide. docs/ARCHITECTURE.md
says why this mechanism and what it measured.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

from splitserve.cluster.cli.free_port import free_port

# The replicas' listeners close this long after a replica starts draining. Ray's default,
# 30 s, is every Ctrl-C's wait (deleting the app drains each ingress replica); behind Ray's
# own HAProxy a short window is enough, since HAProxy retries a refused connect on another
# replica. A Kubernetes load balancer in front needs its deregistration delay (Helm: 30 s).
CLI_DRAINING_PERIOD_S = "2"
# RAY_SERVE_THROUGHPUT_OPTIMIZED=1 spelled out: exactly the settings it implies (Ray 2.60,
# ray/serve/_private/constants.py), without the Serve controller's multi-line INFO banner,
# which reaches the console on every start before Serve's logging config applies. The Helm
# chart, whose logs go to files, sets the flag itself.
THROUGHPUT_OPTIMIZED = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}
# Serve's controller kills a proxy whose readiness check times out 3 times in a row (5 s each by
# default); on a node busy loading models the HAProxy proxy's start (its imports, then HAProxy)
# can take longer, and the app then fails to start ("HAProxyManager ... killed by ray.kill",
# seen on a 2-core CI box). A slow proxy is not a broken one: give its checks room.
PROXY_CHECK_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
FLAGS = {"RAY_SERVE_ENABLE_HA_PROXY": "1", **THROUGHPUT_OPTIMIZED, **PROXY_CHECK_TIMEOUTS}


def haproxy_seconds(seconds: float) -> int:
    """Ray reads HAProxy's timeouts as whole seconds; round up, never to 0 (no timeout)."""
    return max(1, math.ceil(seconds))


def resolve_http_listener(cfg, local: bool) -> str:
    """cfg.http_listener with "auto" decided: the ingress replica's own listener for one fixed
    ingress replica on a local cluster (nothing to balance, and HAProxy's hop and Serve's
    fallback proxy cost CPU per token and idle), else HAProxy (several replicas share the port;
    a joined cluster may place the replica on any node, where HAProxy runs on each)."""
    if cfg.http_listener != "auto":
        return cfg.http_listener
    return "ingress" if local and cfg.ingress_is_single() else "haproxy"


class FrontDoor:
    def __init__(self, local: bool, listener: str = "haproxy"):
        """listener: "haproxy" (Ray's HAProxy in front), or "ingress" (the replica's own uvicorn
        on the HTTP port: no HAProxy, and Serve starts no proxy, serve.start's proxy_location)."""
        self.local, self.listener = local, listener
        self.state_dir: str | None = None

    @property
    def proxy_location(self) -> str | None:
        """serve.start's proxy_location: none with the replica's own listener, else Serve's default."""
        return "Disabled" if self.listener == "ingress" else None

    def environment(self, cfg=None) -> dict[str, str]:
        """The variables to set; a user's own value of one (in this environment) wins.
        cfg (a ServeConfig): its connection cap becomes HAProxy's maxconn."""
        if self.listener == "ingress":
            # No HAProxy: only the handlers on the replica's main loop. Not direct ingress either:
            # with it Serve's controller overrides proxy_location Disabled to HeadOnly, and its
            # proxy would take the port the replica listens on.
            env = {**THROUGHPUT_OPTIMIZED, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
            return {key: os.environ.get(key, value) for key, value in env.items()}
        env = {**FLAGS, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": CLI_DRAINING_PERIOD_S}
        if cfg is not None:
            # Ray 2.60's HAProxy config has no knob for `timeout http-request`; without it HAProxy
            # times a request's headers and body with `timeout client`, which never runs while
            # HAProxy waits on the server or a stream flows (tests/cluster/frontend/test_haproxy_timeouts.py),
            # so it can be as short as the request timeout. uvicorn behind it times them too.
            env["RAY_SERVE_HAPROXY_MAXCONN"] = str(cfg.http_max_connections)
            env["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] = str(haproxy_seconds(cfg.http_request_timeout_s))
        if self.local:
            # Short: HAProxy limits socket paths to 97 bytes and Ray adds the node id (56).
            self.state_dir = tempfile.mkdtemp(prefix="ss", dir="/tmp")
            d = self.state_dir
            env.update(
                {
                    "RAY_SERVE_HAPROXY_NBTHREAD": "1",  # a few cores at most on a local box
                    "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                    "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
                    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
                    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
                    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
                    "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
                    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
                    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state"),
                    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(d, "metrics.sock"),
                }
            )
        return {key: os.environ.get(key, value) for key, value in env.items()}

    def controller_options(self, env: dict[str, str]) -> dict | None:
        """serve.start's controller_options carrying env when joining a running cluster."""
        return None if self.local or not env else {"runtime_env": {"env_vars": env}}

    def cleanup(self) -> None:
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None
