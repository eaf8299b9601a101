"""GrpcFrontend: splitserve.v1.SplitServe over a ServingBackend, with grpc.health.v1 and
server reflection (so grpcurl works without the .proto).

    frontend = GrpcFrontend(backend)
    port = await frontend.start(cfg.grpc_host, cfg.grpc_port)   # port 0 picks a free one
    ...
    await frontend.stop(grace_s=5.0)

Requests are parsed by the service itself rather than by grpc, so a malformed message is
answered INVALID_ARGUMENT with the parser's reason instead of grpc's generic INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.cluster.frontend.grpc.health import BackendHealthServicer
from splitserve.cluster.frontend.grpc.messages import GenerateResponses, oneof_conflict, sampling_params_from
from splitserve.cluster.frontend.grpc.request_arrival import RequestArrivalTimeout
from splitserve.cluster.frontend.http.errors import retry_after
from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.cluster.frontend.model_service import GenerationRequest, ModelService
from splitserve.cluster.frontend.serving_api import GenerationAPI
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal
from splitserve.proto import load_stubs
from splitserve.proto.messages.invalid_request import InvalidRequestError

logger = logging.getLogger(__name__)

pb2, _ = load_stubs()
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["SplitServe"].full_name  # "splitserve.v1.SplitServe"
OWNED_BY = "splitserve"
# The one table from a RequestError's kind to a gRPC status code.
STATUS_CODE_BY_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
INGRESS_KEY = "x-splitserve-ingress"  # initial and trailing metadata: the ingress replica that answered


class GrpcFrontendError(RuntimeError):
    """The frontend could not start (address in use, bad host) or was misused."""


TENANT_STATUS_CODES = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class _Rejection(Exception):
    """A request refused by the frontend itself, with the status to answer."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class _MalformedRequest:
    type_name: str
    reason: str


def _lenient_parser(message_class):
    """A request deserializer that never raises: grpc would turn a raise into INTERNAL."""

    def parse(data: bytes):
        try:
            message = message_class.FromString(data)
        except DecodeError as exc:
            return _MalformedRequest(message_class.DESCRIPTOR.full_name, str(exc) or "cannot parse")
        # protobuf keeps the last of several oneof members silently (regex + json_object
        # would apply json_object only); refuse such a message, as HTTP refuses two constraints.
        conflict = oneof_conflict(message_class.DESCRIPTOR, data)
        if conflict:
            return _MalformedRequest(message_class.DESCRIPTOR.full_name, conflict)
        return message

    return parse


def _rpc(handler):
    """Turn rejections, RequestErrors and bugs into a gRPC status with readable details."""

    @functools.wraps(handler)
    async def wrapper(self: GrpcFrontend, request, context: grpc.aio.ServicerContext):
        trailing = [(INGRESS_KEY, self.ingress_id)]
        context.set_trailing_metadata(trailing)
        try:
            if isinstance(request, _MalformedRequest):
                raise _Rejection(
                    grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request.type_name} message: {request.reason}"
                )
            return await handler(self, request, context)
        except _Rejection as exc:
            code, details = exc.code, exc.details
        except TenantRefusal as exc:
            # HTTP's status and OpenAI code as gRPC's; the x-ratelimit-* headers as metadata.
            code, details = TENANT_STATUS_CODES[exc.status], f"{exc.code}: {exc.message}"
            trailing += list(exc.headers.items())
            if exc.retry_after_s is not None:
                trailing.append(("retry-after", retry_after(exc.retry_after_s)))
                trailing.append((RETRY_PUSHBACK_KEY, str(int(exc.retry_after_s * 1000))))
            context.set_trailing_metadata(trailing)
        except RequestError as exc:
            code, details = STATUS_CODE_BY_KIND[exc.kind], exc.message
            if exc.retryable:  # gRPC's form of Retry-After, read by clients with a retry policy
                trailing.append((RETRY_PUSHBACK_KEY, str(int(exc.retry_after_s * 1000))))
                context.set_trailing_metadata(trailing)
        except Exception:
            # The traceback (paths, actor ids, pids) goes to the server log, never to the client.
            label = getattr(request, "request_id", "") or ""
            logger.exception("gRPC %s failed (client request id %r)", handler.__name__, label)
            code, details = grpc.StatusCode.INTERNAL, "internal error; the server log has the details"
        await context.abort(code, details)

    return wrapper


def _bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left before the client's deadline (None: it set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else max(remaining, 0.001)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcFrontend:
    def __init__(
        self,
        backend: GenerationAPI,
        health_poll_interval_s: float = 2.0,
        share_port: bool = False,
        catalog: ModelCatalog | None = None,
    ):
        """share_port: SO_REUSEPORT, so every ingress replica on a node serves the one port
        (the kernel spreads connections); otherwise a busy port fails start(). catalog: every
        model name served, each request's `model` resolved there (default: just `backend`);
        backend is the default model (a request with no model) and holds the settings."""
        self.backend = backend
        self.catalog = catalog or ModelCatalog.of(backend)  # type: ignore[arg-type]
        self.service = ModelService(self.catalog, backend)
        self.ingress_id: str = getattr(backend, "ingress_id", "") or ""
        self._share_port = share_port
        self._api_key: str | None = backend.cfg.api_key or None
        self._tenants = getattr(backend, "tenants", None)
        self._max_message_bytes: int = backend.cfg.max_body_bytes
        self._health_poll_interval_s = health_poll_interval_s
        self._server: grpc.aio.Server | None = None
        self._health: BackendHealthServicer | None = None
        self.port: int | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on host:port (0: a free port) and serve; returns the bound port."""
        if self._server is not None:
            raise GrpcFrontendError(f"the gRPC frontend is already serving on port {self.port}")
        limits = self.backend.cfg.grpc  # slow, idle and too many clients (cluster/grpc_connection_config.py)
        server = grpc.aio.server(
            interceptors=[RequestArrivalTimeout(limits.request_timeout_s)],
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.so_reuseport", 1 if self._share_port else 0),
                *limits.server_options(),
            ],
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        )
        server.add_generic_rpc_handlers((self._service_handler(),))
        health = BackendHealthServicer(self.catalog, [SERVICE_NAME], self._health_poll_interval_s)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection([SERVICE_NAME, grpc_health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        try:
            bound = server.add_insecure_port(_address(host, port))
        except RuntimeError as exc:
            raise GrpcFrontendError(f"cannot listen for gRPC on {_address(host, port)}: {exc}") from None
        if not bound:
            raise GrpcFrontendError(f"cannot listen for gRPC on {_address(host, port)}")
        await server.start()
        await health.refresh()
        health.start_polling()
        self._server, self._health, self.port = server, health, bound
        logger.info("gRPC frontend serving %s on %s", SERVICE_NAME, _address(host, bound))
        return bound

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, let in-flight RPCs finish for grace_s, then cancel the rest."""
        if self._server is None:
            return
        server, health = self._server, self._health
        self._server, self._health, self.port = None, None, None
        await health.enter_graceful_shutdown()
        await health.stop_polling()
        await server.stop(grace_s)

    def _service_handler(self) -> grpc.GenericRpcHandler:
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate,
                request_deserializer=_lenient_parser(pb2.GenerateRequest),
                response_serializer=pb2.GenerateResponse.SerializeToString,
            ),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.tokenize,
                request_deserializer=_lenient_parser(pb2.TokenizeRequest),
                response_serializer=pb2.TokenizeResponse.SerializeToString,
            ),
            "Models": grpc.unary_unary_rpc_method_handler(
                self.models,
                request_deserializer=_lenient_parser(pb2.ModelsRequest),
                response_serializer=pb2.ModelsResponse.SerializeToString,
            ),
        }
        declared = {m.name for m in pb2.DESCRIPTOR.services_by_name["SplitServe"].methods}
        if declared != set(handlers):
            raise GrpcFrontendError(
                f"splitserve.proto declares {sorted(declared)} but the frontend "
                f"implements {sorted(handlers)}; rebuild with `python -m splitserve.proto.build`"
            )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    # ---- RPCs ----------------------------------------------------------------------------
    @_rpc
    async def generate(self, request, context: grpc.aio.ServicerContext) -> None:
        """The GenerateRequest to ModelService (validation, priority, tenant admission, routing),
        its chunks written as they come; the metadata carries the tenant's and the route's headers."""
        received_at = time.perf_counter()  # the first token's ingress stage starts
        api_key = self._authorize(context)
        api = self.service.resolve(request.model)
        try:  # before tokenizing: a bad parameter costs nothing
            params = sampling_params_from(request)
        except InvalidRequestError as exc:
            raise _Rejection(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        # The same constraint check HTTP runs (bounds, isolated compile), before tokenizing.
        if params.structured_output is not None:
            await api.check_constraint(params.structured_output, request.WhichOneof("structured_output"))
        # The client's gRPC deadline becomes the request's (capped by request_timeout_s). Its
        # request_id is a label: echoed back and logged, never a key (the server's id is).
        label = request.request_id or None
        generation = await self.service.generate(
            GenerationRequest(
                model=request.model,
                prompts=[await self._prompt_token_ids(api, request)],
                params=params,
                api_key=api_key,
                label=label,
                received_at=received_at,
                timeout_s=_time_remaining(context),
                priority_class=request.priority_class,
                priority=request.priority if request.HasField("priority") else None,
                headers={key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)},
            )
        )
        [chunks] = generation.sources
        metadata = [(INGRESS_KEY, self.ingress_id), *generation.headers.items()]
        try:
            # aclosing: when the client cancels, the CancelledError raised in context.write closes
            # the backend generator, whose cleanup aborts the request and frees its KV blocks.
            async with contextlib.aclosing(chunks):
                first = None
                if generation.routed:  # the model is known at its first chunk
                    first = await anext(chunks, None)
                    decision = generation.decision
                    metadata += [] if decision is None else list(decision.headers().items())
                await context.send_initial_metadata(tuple(metadata))
                responses = GenerateResponses(label, request.return_first_token_stages)
                if first is not None:
                    await context.write(responses.of(first))
                async for chunk in chunks:
                    await context.write(responses.of(chunk))
        finally:
            generation.settle()

    @_rpc
    async def tokenize(self, request, context: grpc.aio.ServicerContext) -> pb2.TokenizeResponse:
        self._authorize(context)
        api = self.service.resolve(request.model)
        if not request.text:
            raise _Rejection(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
        token_ids = await asyncio.to_thread(api.encode, request.text)
        return pb2.TokenizeResponse(token_ids=token_ids, count=len(token_ids), max_model_len=api.max_model_len)

    @_rpc
    async def models(self, request, context: grpc.aio.ServicerContext) -> pb2.ModelsResponse:
        self._authorize(context)
        cards = [
            pb2.ModelCard(
                id=name,
                max_model_len=self.catalog.resolve(name).max_model_len,
                owned_by=OWNED_BY,
                parent=self.catalog.parent(name) or "",
            )
            for name in self.catalog.served()
        ]
        return pb2.ModelsResponse(models=cards)

    # ---- request checks ------------------------------------------------------------------
    def _authorize(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's API key (None when the deployment has none); rejects a wrong one."""
        if self._tenants is not None:
            token = _bearer_token(context.invocation_metadata())
            self._tenants.authenticate(token)  # TenantRefusal (UNAUTHENTICATED) for no tenant's key
            return token
        if self._api_key is None:
            return None
        token = _bearer_token(context.invocation_metadata())
        if token is None:
            raise _Rejection(
                grpc.StatusCode.UNAUTHENTICATED, "missing API key: send the metadata `authorization: Bearer <key>`"
            )
        if not hmac.compare_digest(token.encode(), self._api_key.encode()):
            raise _Rejection(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return token

    async def _prompt_token_ids(self, api, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise _Rejection(grpc.StatusCode.INVALID_ARGUMENT, "prompt text is empty")
            return await asyncio.to_thread(api.encode, request.text)  # off the event loop
        if kind == "token_ids":
            if not request.token_ids.ids:
                raise _Rejection(grpc.StatusCode.INVALID_ARGUMENT, "prompt token_ids is empty")
            return list(request.token_ids.ids)
        raise _Rejection(grpc.StatusCode.INVALID_ARGUMENT, "set the prompt: `text` or `token_ids`")
