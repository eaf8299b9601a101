"""The OpenAI-compatible HTTP frontend: build_http_app(backend, catalog=...) -> FastAPI.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with `stream: true`;
several prompts and n > 1 fan out into one generation per choice), the Batch API (/v1/files,
/v1/batches; cluster/batch/) when a BatchService is given, GET /v1/models,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with enable_lora),
POST /tokenize, POST /detokenize, GET /version (vLLM's shapes), GET /health, GET /ready,
GET /metrics, and FastAPI's /openapi.json; HEAD works wherever GET does. A generation request
may carry `x-request-timeout: SECONDS` (capped by request_timeout_s; past it: 504). Every error is
OpenAI's {"error": {"message", "type", "param", "code"}}; no traceback ever reaches a client.
`backend` is a ServingAPI (cluster/frontend/serving_api.py): ServingBackend, or a test double;
each request's `model` is resolved in a ModelCatalog (an unknown one: 404 model_not_found).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer

from splitserve.cluster.frontend.fanout import first_chunks, merged
from splitserve.cluster.frontend.first_token_stages import RECEIVED_AT
from splitserve.cluster.frontend.http.access_log import AccessLog, client_request_id
from splitserve.cluster.frontend.http.admin_routes import add_admin_routes
from splitserve.cluster.frontend.http.allowed_methods import AllowedMethods
from splitserve.cluster.frontend.http.caller import Callers
from splitserve.cluster.frontend.http.error_handlers import install_error_handlers
from splitserve.cluster.frontend.http.errors import (
    HTTP_STATUS_BY_KIND,
    OpenAIHTTPError,
)
from splitserve.cluster.frontend.http.guard import RequestGuard
from splitserve.cluster.frontend.http.head import HeadAsGet
from splitserve.cluster.frontend.http.lora_routes import add_lora_routes
from splitserve.cluster.frontend.http.model_routes import add_model_routes
from splitserve.cluster.frontend.http.openapi_bounds import state_bounds_in_openapi
from splitserve.cluster.frontend.http.sse import LastEvent, SSEResponse, run_until_disconnected
from splitserve.cluster.frontend.http.tokenize_routes import add_tokenize_routes, splitserve_version
from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.cluster.frontend.model_service import GenerationRequest, ModelService
from splitserve.cluster.frontend.openai.completion_renderer import CompletionRenderer
from splitserve.cluster.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    build_sampling_params,
)
from splitserve.cluster.frontend.openai.render import (
    SSE_DONE,
    ChatRenderer,
    ResponseRenderer,
    sse_event,
)
from splitserve.cluster.frontend.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    error_body,
)
from splitserve.cluster.frontend.openai.structured_output import constraint_field
from splitserve.cluster.frontend.priority_class import PRIORITY_CLASS_HEADER
from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.request_error import RequestError
from splitserve.proto.messages.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503, 504)}
TIMEOUT_HEADER = "x-request-timeout"
GENERATION_RESPONSES = {200: {"content": {"text/event-stream": {}}}, **_ERRORS}


def build_http_app(
    backend: ServingAPI, echo_request_id: bool = True, batch=None, catalog: ModelCatalog | None = None
) -> FastAPI:
    """The OpenAI-compatible FastAPI app in front of `backend` (see the module docstring).
    catalog: every model name served, each request's `model` resolved there (default: just
    `backend`, under its model_name); backend is then the default model, whose cfg (the
    deployment's settings), tenant gate and ingress id the app uses.
    echo_request_id: answer a client's x-request-id with the same header (Ray Serve does it
    itself, so the Serve app passes False). batch: a cluster.batch.batch_service.BatchService
    that adds the Batch API (/v1/files, /v1/batches); its caller starts its runner."""
    cfg = backend.cfg
    catalog = catalog or ModelCatalog.of(backend)
    tenants = getattr(backend, "tenants", None)
    callers = Callers(cfg.api_key, tenants, cfg.admin_api_key)
    service = ModelService(catalog, backend)
    app = FastAPI(
        title="splitserve",
        description="OpenAI-compatible disaggregated LLM serving",
        version=splitserve_version(),
        strict_content_type=False,
    )
    app.add_middleware(
        RequestGuard,
        api_key=cfg.api_key,
        max_body_bytes=cfg.max_body_bytes,
        body_timeout_s=cfg.http_request_timeout_s,
        upload_paths=("/v1/files",) if batch is not None else (),
        max_upload_bytes=cfg.batch.max_file_bytes,
        authorize=callers.authorized,
    )
    app.add_middleware(HeadAsGet)
    app.add_middleware(AllowedMethods, routes=lambda: app.routes)
    # Outermost: logs the guard's refusals (and HEADs as HEAD) too; names the ingress replica.
    app.add_middleware(AccessLog, ingress_id=getattr(backend, "ingress_id", None), echo_request_id=echo_request_id)
    install_error_handlers(app)
    # Documents the bearer scheme in /openapi.json; RequestGuard enforces it before parsing.
    auth = [Depends(HTTPBearer(auto_error=False))] if cfg.api_key or tenants is not None else []
    add_model_routes(app, catalog, auth, _ERRORS)
    add_tokenize_routes(app, catalog, auth, _ERRORS)
    if batch is not None:
        batch.install(app, auth, _ERRORS, callers)
    if tenants is not None:
        add_admin_routes(app, tenants, cfg.admin_api_key)
    if cfg.enable_lora:
        add_lora_routes(app, backend, callers, auth, _ERRORS)

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=auth, responses=GENERATION_RESPONSES)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        api = catalog.resolve(body.model)
        body.check_supported()  # before any prompt is tokenized
        # Off the event loop: it also serves every other stream of this replica.
        prompts = [await asyncio.to_thread(api.encode, p) if isinstance(p, str) else list(p) for p in body.prompts()]
        params = build_sampling_params(body, max(map(len, prompts)), api.max_model_len)
        await check_constraint(api, body, params)

        def renderer() -> CompletionRenderer:  # once the prompts are validated: echo decodes them
            echoes = (
                [p if isinstance(p, str) else api.tokenizer.decode(p) for p in body.prompts()] if body.echo else None
            )
            return CompletionRenderer(
                f"cmpl-{uuid.uuid4().hex}",
                catalog.lora_adapter(body.model) or api.model_name,  # the name that answers (an adapter: its own)
                int(time.time()),
                api.tokenizer,
                params.logprobs,
                body.include_usage,
                prompt_lengths=[len(p) for p in prompts],
                n=body.n,
                echoes=echoes,
                num_top_logprobs=params.top_logprobs,
                echo_token_ids=prompts if params.prompt_logprobs is not None else None,
                echo_only=body.echo_only,
                prompt_logprobs_ids=prompts if body.prompt_logprobs is not None else None,
                include_first_token_stages=body.return_first_token_stages,
            )

        return await answer(request, generation_request(request, body, prompts, params), renderer, body.stream)

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=auth, responses=GENERATION_RESPONSES
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        api = catalog.resolve(body.model)
        body.check_supported()
        prompt_ids = await asyncio.to_thread(api.render_chat, body.template_messages(), tools=body.template_tools())
        params = build_sampling_params(body, len(prompt_ids), api.max_model_len)
        plan = body.tool_call_plan()
        await check_constraint(api, body, params, plan)

        def renderer() -> ChatRenderer:
            return ChatRenderer(
                f"chatcmpl-{uuid.uuid4().hex}",
                catalog.lora_adapter(body.model) or api.model_name,  # the name that answers (an adapter: its own)
                int(time.time()),
                api.tokenizer,
                params.logprobs,
                body.include_usage,
                prompt_lengths=[len(prompt_ids)],
                n=body.n,
                prompt_logprobs_ids=[prompt_ids] if body.prompt_logprobs is not None else None,
                tool_plan=plan,
                include_first_token_stages=body.return_first_token_stages,
            )

        parsed = generation_request(request, body, [prompt_ids], params, tools=bool(body.tools))
        return await answer(request, parsed, renderer, body.stream)

    async def check_constraint(api: ServingAPI, body, params: SamplingParams, plan=None) -> None:
        """The backend's one constraint check (shared with gRPC), naming the request's field."""
        if params.structured_output is None:
            return
        parts = {}
        if plan is not None:
            parts = {
                f"tools[{i}].function.parameters": tool.function.parameters
                for i, tool in enumerate(body.tools or [])
                if tool.function.parameters is not None
            }
        field = constraint_field(body, None if plan is None else plan.grammar) or "structured_outputs"
        await api.check_constraint(params.structured_output, field, parts)

    def generation_request(
        request: Request, body, prompts: list[list[int]], params: SamplingParams, tools: bool = False
    ) -> GenerationRequest:
        """The HTTP request as ModelService takes it (a batch line runs as its batch's tenant)."""
        caller = callers.of(request.scope)
        return GenerationRequest(
            model=body.model,
            prompts=prompts,
            params=params,
            n=body.n,
            api_key=caller.api_key,
            run_as=caller.owner if caller.batch_line and tenants is not None else None,
            label=client_request_id(request.scope.get("headers", [])),  # the client's own id: a label
            timeout_s=_request_timeout(request),
            priority_class=request.headers.get(PRIORITY_CLASS_HEADER),
            priority=body.priority,
            headers=dict(request.headers),
            tools=tools,
            received_at=request.scope.get(RECEIVED_AT),
        )

    async def answer(
        request: Request, parsed: GenerationRequest, make_renderer: Callable[[], ResponseRenderer], stream: bool
    ) -> Response:
        """ModelService runs the request (validation, priority, tenant admission, routing, one
        generation per choice); its chunks are streamed or collected into the response."""
        generation = await service.generate(parsed)
        sources, headers = generation.sources, generation.headers or None
        handed_off = False
        try:
            renderer = make_renderer()
            # Refusals (400/429/503) come before the first chunk, so they still get a status code.
            firsts = await run_until_disconnected(request.receive, first_chunks(sources))
            decision = generation.decision  # made by now: a cascade decides before its first chunk
            if decision is not None:
                headers = {**(headers or {}), **decision.headers()}
                renderer.answered_by(decision.target)
            rest = merged(sources)
            if stream:
                handed_off = True
                return SSEResponse(
                    _stream_events(renderer, firsts, rest),
                    source=rest,
                    headers=headers,
                    on_close=generation.settle,
                )
            for index, first in enumerate(firsts):
                if first is not None:
                    renderer.observe(first, index)

            async def collect() -> None:
                async for index, chunk in rest:
                    renderer.observe(chunk, index)

            # Drain to the end, so the backend counts a normal finish.
            try:
                await run_until_disconnected(request.receive, collect())
            finally:
                with anyio.CancelScope(shield=True):
                    await rest.aclose()
            renderer.mark_unfinished()
            return JSONResponse(renderer.render_response(), headers=headers)
        finally:
            if not handed_off:
                await generation.close()

    # The served models (every catalog name), the vocabulary's bound and the other rules validation enforces.
    def smallest_vocab() -> int | None:  # a token id valid for every model
        sizes = [v for _, api in catalog.items() if (v := getattr(api, "vocab_size", None)) is not None]
        return min(sizes) if sizes else None

    state_bounds_in_openapi(app, catalog.served, smallest_vocab)
    return app


def _request_timeout(request: Request) -> float | None:
    """The client's deadline in seconds from the x-request-timeout header (None: the server's)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise OpenAIHTTPError(
            400,
            f"the {TIMEOUT_HEADER} header must be a positive number of seconds, got {raw[:32]!r}",
            param=TIMEOUT_HEADER,
        )
    return value


async def _stream_events(renderer: ResponseRenderer, firsts: list, rest):
    """SSE events of one request, as one string per chunk (its events written at once); a
    failure after the first chunk becomes an error event. The chunk that finishes the last
    choice is held until the sources end (at once: nothing is left to wait for) and goes out
    with the closing events as the stream's LastEvent: one write, instead of one for the
    finish, one for [DONE] and one for the end of the chunked body."""
    pending = "".join(renderer.opening_events())
    try:
        for index, first in enumerate(firsts):
            if first is not None:
                pending += "".join(renderer.chunk_events(first, index))
        if pending and not renderer.all_finished():
            yield pending
            pending = ""
        async for index, chunk in rest:
            events = renderer.chunk_events(chunk, index)
            if not events:
                continue
            if chunk.finished and renderer.all_finished():
                pending += "".join(events)
            else:
                yield events[0] if len(events) == 1 else "".join(events)
    except RequestError as exc:
        status, error_type = HTTP_STATUS_BY_KIND[exc.kind]
        yield LastEvent(pending + sse_event(error_body(exc.message, error_type, code=status)) + SSE_DONE)
        return
    except Exception:
        logger.exception("stream %s failed", renderer.request_id)
        yield LastEvent(pending + sse_event(error_body("internal server error", "server_error", code=500)) + SSE_DONE)
        return
    yield LastEvent(pending + "".join(renderer.closing_events()))
