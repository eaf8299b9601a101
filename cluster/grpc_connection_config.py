"""GrpcConnectionConfig: what a gRPC client may hold open on an ingress replica, and for how
long: the handshake and request-message timeout, the idle-connection timeout, keepalive, and
caps on connections, RPCs in flight and streams per connection (issue #28: slow and idle
clients must not park connections forever).

ServeConfig nests it as `grpc` (flags `--grpc.idle-timeout-s` ..., YAML `grpc:`, the Helm
values schema). Every limit maps onto one of grpc core's own server options
(server_options) or grpc.aio.server's maximum_concurrent_rpcs; only the request-message
timeout is ours (cluster/frontend/grpc/request_arrival.py), because grpc has none.

Why the defaults hold for a stream of any length: grpc's idle timer counts calls, not bytes,
so an open stream is never idle however long it is quiet; keepalive pings are answered by the
client's transport, not its application; no maximum connection age is set.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GrpcConnectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    request_timeout_s: float = Field(30.0, gt=0)
    """Seconds a new connection has to finish its HTTP/2 handshake, and an opened RPC to deliver its request message (DEADLINE_EXCEEDED past it); a response, however long it streams, is never timed."""
    idle_timeout_s: float = Field(300.0, gt=0)
    """A connection with no RPC in flight is closed (GOAWAY) after this long idle (grpc checks once a period: between this and twice it); clients reconnect on their next call. An open stream is never idle."""
    max_connections: int = Field(4096, ge=1)
    """Connections each ingress replica's gRPC server holds at once; more are closed on arrival (the client sees UNAVAILABLE)."""
    max_concurrent_rpcs: int = Field(1024, ge=1)
    """RPCs in flight per ingress replica (health watches included); more are refused with RESOURCE_EXHAUSTED."""
    max_streams_per_connection: int = Field(256, ge=1)
    """Concurrent RPCs one connection may carry (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a client queues more until one ends."""
    keepalive_time_s: float = Field(60.0, gt=0)
    """How often the server pings a connection that has RPCs in flight, to find clients that vanished."""
    keepalive_timeout_s: float = Field(20.0, gt=0)
    """A connection whose ping is unanswered this long is closed, and its streams cancelled (their KV freed)."""

    def server_options(self) -> list[tuple[str, int]]:
        """grpc core's channel arguments for these limits (maximum_concurrent_rpcs and the
        request-message timeout are set elsewhere: they are not channel arguments)."""
        return [
            ("grpc.server_handshake_timeout_ms", _ms(self.request_timeout_s)),
            ("grpc.max_connection_idle_ms", _ms(self.idle_timeout_s)),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
        ]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
