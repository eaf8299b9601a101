"""The HTTP app's exception handlers: every error as OpenAI's {"error": {...}} body with the
status its kind maps to (cluster/frontend/http/errors.py); no traceback reaches a client."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.cluster.frontend.http.errors import HTTP_STATUS_BY_KIND, OpenAIHTTPError, error_response
from splitserve.cluster.frontend.http.sse import ClientDisconnected
from splitserve.cluster.request_error import RequestError
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal
from splitserve.proto.messages.invalid_request import InvalidRequestError

_WHERE = ("body", "query", "path", "header", "cookie")  # where a parameter was, not its name


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message (and the offending parameter) from FastAPI's validation errors."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in _WHERE]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return f"the request body is not valid JSON: {detail}", None
    if not loc:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    # A value matching no branch of a union fails every branch; errors other than "wrong
    # type" (too long, out of range...) come from the branch the client meant, so show those.
    specific = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    details = []
    for err in (specific or errors)[:3]:
        where = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_branch(p) and p not in _WHERE)
        details.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(dict.fromkeys(details)), loc[0]


def _is_union_branch(part) -> bool:
    """pydantic names union branches in error locations ("list[constrained-int]", "str")."""
    return part == "body" or (
        isinstance(part, str)
        and ("[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict"))
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", getattr(exc, "param", None))

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        status, error_type = HTTP_STATUS_BY_KIND[exc.kind]
        return error_response(status, exc.message, error_type, exc.param, exc.code, retry_after_s=exc.retry_after_s)

    @app.exception_handler(TenantRefusal)
    async def on_tenant_refusal(_: Request, exc: TenantRefusal) -> JSONResponse:
        extra = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        return error_response(
            exc.status,
            exc.message,
            exc.error_type,
            "model" if exc.status == 404 else None,
            exc.code,
            headers={**exc.headers, **extra},
            retry_after_s=exc.retry_after_s or 1.0,
        )

    @app.exception_handler(OpenAIHTTPError)
    async def on_openai_error(_: Request, exc: OpenAIHTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.error_type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), error_type, headers=dict(exc.headers or {}))

    @app.exception_handler(ClientDisconnected)
    async def on_client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    # Starlette re-raises after this response is sent, so the server logs the traceback.
    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, __: Exception) -> JSONResponse:
        return error_response(500, "internal server error", "server_error")
