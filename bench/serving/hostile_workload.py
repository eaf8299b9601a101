"""The request mix of bench/serving/hostile_input.py: what an attacker (and ordinary clients) send a
live server, one case per call. Every case closes what it opened; none waits longer than
its timeout."""

from __future__ import annotations

import json
import random
import socket
import threading

import grpc
import httpx

from splitserve.bench.serving.json_schemas import SCHEMAS
from splitserve.proto import load_stubs

pb2, pb2_grpc = load_stubs()


def deep_gbnf_chain(depth: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(depth)) + f'r{depth} ::= "a"\n'


HOSTILE_EXTRAS = [
    {"guided_grammar": deep_gbnf_chain(10_000)},
    {"guided_json": '{"a":' * 10_000 + "1" + "}" * 10_000},
    {"guided_json": "[" * 10_000 + "]" * 10_000},
    {"guided_regex": "a{1000000}"},
    {"guided_regex": "(a{1000}){1000}"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
    {"guided_regex": "[^\\s\\S]"},
    {"guided_choice": []},
    {"top_k": 10**9},
    {"prompt": [1, 2, 99_999_999]},
]
HOSTILE_GRPC_EXTRAS = [
    {"grammar": deep_gbnf_chain(10_000)},
    {"json_schema": '{"a":' * 10_000 + "1" + "}" * 10_000},
    {"regex": "a{1000000}"},
    {"json_schema": '{"$ref": "#"}'},
]


class Workload:
    """One client thread's cases. With grpc_target, gRPC cases join the mix: ordinary and
    hostile-constraint Generate calls, streams cancelled mid-way, and calls that never send
    their request message (answered by the server's grpc.request_timeout_s). A case returns
    the HTTP status, or for gRPC the status code's number (OK 0, CANCELLED 1, ...)."""

    def __init__(self, base_url: str, model: str, seed: int, timeout_s: float = 120.0, grpc_target: str | None = None):
        self.base_url, self.model, self.timeout_s = base_url, model, timeout_s
        self.rng = random.Random(seed)
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.channel = grpc.insecure_channel(grpc_target) if grpc_target else None
        self.counts: dict[str, dict[int, int]] = {}

    def close(self) -> None:
        self.http.close()
        if self.channel is not None:
            self.channel.close()

    def one(self) -> None:
        """Run one case drawn by weight."""
        cases = [
            (self.normal, 3),
            (self.distinct_schema, 3),
            (self.hostile_constraint, 4),
            (self.tool_ref_cycle, 1),
            (self.cancelled_stream, 2),
            (self.half_request, 1),
            (self.bad_body, 2),
        ]
        if self.channel is not None:
            cases += [(self.grpc_normal, 2), (self.grpc_hostile, 2), (self.grpc_cancelled_stream, 1)]
            cases += [(self.grpc_request_never_sent, 1)]
        case = self.rng.choices([c for c, _ in cases], weights=[w for _, w in cases])[0]
        status = case()
        by_status = self.counts.setdefault(case.__name__, {})
        by_status[status] = by_status.get(status, 0) + 1

    def _complete(self, **extra) -> int:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 8, **extra}
        return self.http.post("/v1/completions", json=body).status_code

    def normal(self) -> int:
        return self._complete(temperature=0.7, seed=self.rng.randrange(1 << 30))

    def distinct_schema(self) -> int:
        """A schema no earlier request used: every one is a grammar cache miss (churn)."""
        name = self.rng.choice(list(SCHEMAS))
        schema = json.loads(json.dumps(SCHEMAS[name]))
        schema["title"] = f"{name}-{self.rng.randrange(1 << 40)}"
        schema.setdefault("properties", {})[f"extra_{self.rng.randrange(1 << 20)}"] = {"type": "integer"}
        return self._complete(guided_json=schema, max_tokens=16)

    def hostile_constraint(self) -> int:
        return self._complete(**self.rng.choice(HOSTILE_EXTRAS))

    def tool_ref_cycle(self) -> int:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "call it"}],
            "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
            "tool_choice": "required",
        }
        return self.http.post("/v1/chat/completions", json=body).status_code

    def cancelled_stream(self) -> int:
        body = {"model": self.model, "prompt": "Once", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            for index, _ in enumerate(resp.iter_lines()):
                if index >= 2:
                    break  # the client goes away mid-stream
            return resp.status_code

    def half_request(self) -> int:
        """Half a body, then wait for the server to close it (its request timeout)."""
        host, port = self.base_url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=120) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 500\r\n\r\n{"model": "'
            )
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        return int(reply[9:12]) if reply.startswith(b"HTTP/1.1 ") else 0

    def bad_body(self) -> int:
        garbage = self.rng.choice([b"\x00\xff not json", b'{"model": 1', b"[" * 5000 + b"]" * 5000])
        return self.http.post(
            "/v1/completions", content=garbage, headers={"content-type": "application/json"}
        ).status_code

    # ---- gRPC ----------------------------------------------------------------------------
    def _generate(self, **fields) -> int:
        assert self.channel is not None
        request = pb2.GenerateRequest(text="Once upon a time", max_tokens=8, **fields)
        try:
            for _ in pb2_grpc.SplitServeStub(self.channel).Generate(request, timeout=self.timeout_s):
                pass
        except grpc.RpcError as exc:
            return exc.code().value[0]
        return grpc.StatusCode.OK.value[0]

    def grpc_normal(self) -> int:
        return self._generate(temperature=0.7, seed=self.rng.randrange(1 << 30))

    def grpc_hostile(self) -> int:
        return self._generate(**self.rng.choice(HOSTILE_GRPC_EXTRAS))

    def grpc_cancelled_stream(self) -> int:
        assert self.channel is not None
        request = pb2.GenerateRequest(text="Once", max_tokens=32, ignore_eos=True)
        call = pb2_grpc.SplitServeStub(self.channel).Generate(request, timeout=self.timeout_s)
        try:
            for index, _ in enumerate(call):
                if index >= 2:
                    call.cancel()  # the client goes away mid-stream
        except grpc.RpcError as exc:
            return exc.code().value[0]
        return grpc.StatusCode.OK.value[0]

    def grpc_request_never_sent(self) -> int:
        """A call opened and its message never sent: the server's request timeout ends it."""
        assert self.channel is not None
        released = threading.Event()

        def never():
            released.wait(self.timeout_s)
            yield from ()

        call = self.channel.stream_stream("/splitserve.v1.SplitServe/Generate", request_serializer=bytes)
        try:
            for _ in call(never(), timeout=self.timeout_s):
                pass
        except grpc.RpcError as exc:
            return exc.code().value[0]
        finally:
            released.set()
        return grpc.StatusCode.OK.value[0]
