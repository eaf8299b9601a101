"""gRPC connection limits over real sockets (the real GrpcFrontend, a fake backend): an idle
connection and one that never finishes its handshake are closed within their timeouts, an RPC
whose request message never arrives is refused within its timeout, a stream quieter than every
timeout is not cut, and the caps on RPCs and on connections refuse past the limit and recover."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import grpc
import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.grpc.server import SERVICE_NAME
from splitserve.cluster.grpc_connection_config import GrpcConnectionConfig
from splitserve.proto import load_stubs
from tests.helpers.grpc_client import FakeBackend, FrontendThread

pb2, pb2_grpc = load_stubs()
TIMEOUT_S = 1.0  # every timeout under test; the assertions are relative to it
SAFETY_S = 20 * TIMEOUT_S  # the longest any wait lasts; the events are expected near TIMEOUT_S
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + empty SETTINGS
GOAWAY, SETTINGS, MAX_CONCURRENT_STREAMS = 0x7, 0x4, 0x3


@contextlib.contextmanager
def serving(tokenizer, **limits):
    backend = FakeBackend(tokenizer, ServeConfig(grpc=GrpcConnectionConfig(**limits)))
    server = FrontendThread(backend)
    server.start()
    try:
        yield backend, server
    finally:
        server.close()


def frames_until_closed(sock: socket.socket) -> tuple[float, list[tuple[int, bytes]]]:
    """Seconds until the server closes sock, and the HTTP/2 frames (type, payload) it sent."""
    started = time.monotonic()
    sock.settimeout(SAFETY_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    elapsed, frames = time.monotonic() - started, []
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        frames.append((data[3], data[9 : 9 + length]))
        data = data[9 + length :]
    return elapsed, frames


def models(target: str, timeout_s: float = SAFETY_S):
    with grpc.insecure_channel(target) as channel:
        return pb2_grpc.SplitServeStub(channel).Models(pb2.ModelsRequest(), timeout=timeout_s)


def poll(predicate, message: str):
    deadline = time.monotonic() + SAFETY_S
    while not (value := predicate()):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
    return value


def test_an_idle_connection_is_closed_within_the_idle_timeout(tokenizer):
    with serving(tokenizer, idle_timeout_s=TIMEOUT_S, max_streams_per_connection=7) as (_, server):
        # A bare HTTP/2 connection that never opens a call (what a parked attacker holds).
        with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_S) as sock:
            sock.sendall(PREFACE)
            elapsed, frames = frames_until_closed(sock)
        assert elapsed < SAFETY_S
        assert elapsed >= TIMEOUT_S / 2, elapsed  # the idle timer, not something at once, closed it
        assert any(kind == GOAWAY and b"idle" in payload for kind, payload in frames), frames
        # The server's SETTINGS carry the per-connection stream cap.
        settings = b"".join(payload for kind, payload in frames if kind == SETTINGS)
        advertised = {
            int.from_bytes(settings[i : i + 2], "big"): settings[i + 2 : i + 6] for i in range(0, len(settings), 6)
        }
        assert int.from_bytes(advertised[MAX_CONCURRENT_STREAMS], "big") == 7

        # A real client after its call: the GOAWAY moves its channel to IDLE, and its next
        # call reconnects and succeeds.
        with grpc.insecure_channel(server.target) as channel:
            states: list[grpc.ChannelConnectivity] = []
            stub = pb2_grpc.SplitServeStub(channel)
            stub.Models(pb2.ModelsRequest(), timeout=SAFETY_S)
            started = time.monotonic()
            channel.subscribe(states.append, try_to_connect=False)
            poll(lambda: grpc.ChannelConnectivity.IDLE in states, "the idle connection was not closed")
            assert time.monotonic() - started >= TIMEOUT_S / 2
            assert stub.Models(pb2.ModelsRequest(), timeout=SAFETY_S).models


def test_a_connection_that_sends_nothing_is_closed_within_the_request_timeout(tokenizer):
    with serving(tokenizer, request_timeout_s=TIMEOUT_S, idle_timeout_s=SAFETY_S * 10) as (_, server):
        with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_S) as sock:
            elapsed, frames = frames_until_closed(sock)
        assert TIMEOUT_S * 0.9 <= elapsed < SAFETY_S, elapsed
        assert any(kind == GOAWAY and b"handshake" in payload for kind, payload in frames), frames


def never_sent(released: threading.Event):
    """A request stream that never yields: the call is open, its message never comes."""
    released.wait(SAFETY_S)
    yield from ()


@pytest.mark.parametrize("method", ["Generate", "Models"])
def test_a_request_message_that_never_arrives_is_refused_within_the_request_timeout(tokenizer, method):
    with serving(tokenizer, request_timeout_s=TIMEOUT_S) as (backend, server):
        released = threading.Event()
        with grpc.insecure_channel(server.target) as channel:
            # The bytes of a unary call whose client stops after the headers.
            call = channel.stream_stream(f"/{SERVICE_NAME}/{method}", request_serializer=bytes)
            started = time.monotonic()
            try:
                with pytest.raises(grpc.RpcError) as info:
                    list(call(never_sent(released), timeout=SAFETY_S))
            finally:
                released.set()
            elapsed = time.monotonic() - started
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
        assert "grpc.request_timeout_s" in info.value.details()
        assert TIMEOUT_S * 0.9 <= elapsed < SAFETY_S, elapsed
        assert backend.calls == []
        assert models(server.target).models  # the server still serves


def test_a_stream_quieter_than_every_timeout_is_not_cut(tokenizer):
    limits = dict(idle_timeout_s=TIMEOUT_S, request_timeout_s=TIMEOUT_S, keepalive_time_s=TIMEOUT_S / 4)
    with serving(tokenizer, keepalive_timeout_s=TIMEOUT_S, **limits) as (backend, server):
        # Each silence between tokens outlasts the idle and request timeouts (and spans keepalive
        # pings); the whole stream outlasts twice the idle timeout, grpc's latest idle check.
        backend.chunk_delay_s = 1.5 * TIMEOUT_S
        with grpc.insecure_channel(server.target) as channel:
            started = time.monotonic()
            responses = list(
                pb2_grpc.SplitServeStub(channel).Generate(
                    pb2.GenerateRequest(text="hello", max_tokens=3, ignore_eos=True), timeout=SAFETY_S * 2
                )
            )
            elapsed = time.monotonic() - started
        assert sum(len(r.token_ids) for r in responses) == 3
        assert responses[-1].finish_reason == "length"
        assert elapsed >= 2 * TIMEOUT_S
        assert backend.outcomes == ["completed"]


def test_rpcs_past_the_cap_are_refused_and_the_cap_recovers(tokenizer):
    with serving(tokenizer, max_concurrent_rpcs=2) as (backend, server):
        backend.chunk_delay_s = 0.2  # streams that stay open until cancelled
        with grpc.insecure_channel(server.target) as channel:
            stub = pb2_grpc.SplitServeStub(channel)
            streams = [stub.Generate(pb2.GenerateRequest(text="hi", max_tokens=50), timeout=SAFETY_S) for _ in range(2)]
            for stream in streams:
                next(stream)  # both are in flight
            with pytest.raises(grpc.RpcError) as info:
                stub.Models(pb2.ModelsRequest(), timeout=SAFETY_S)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            for stream in streams:
                stream.cancel()
            poll(lambda: len(backend.outcomes) == 2, "the cancelled streams did not end")

            def served():
                try:
                    return stub.Models(pb2.ModelsRequest(), timeout=SAFETY_S).models
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    return None

            poll(served, "the RPC cap did not recover after the streams ended")
            assert "completed" not in backend.outcomes


def test_connections_past_the_cap_are_closed_and_the_cap_recovers(tokenizer):
    with serving(tokenizer, max_connections=2) as (_, server):
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_S) for _ in range(2)]
        try:
            for sock in held:
                sock.sendall(PREFACE)
                sock.recv(9)  # the server's SETTINGS: this connection is accepted
            with socket.create_connection(("127.0.0.1", server.port), timeout=SAFETY_S) as extra:
                extra.sendall(PREFACE)
                _, frames = frames_until_closed(extra)
            assert frames == []  # closed on arrival, before any HTTP/2
            with pytest.raises(grpc.RpcError) as info:
                models(server.target)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        finally:
            held.pop().close()
        assert poll(lambda: _served(server.target), "a connection slot did not free up")
        for sock in held:
            sock.close()


def _served(target: str):
    try:
        return models(target, timeout_s=TIMEOUT_S * 5).models
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
        return None
