"""ASGI middleware that runs before any parsing: API-key check and request-body size cap.

Authentication happens first, so an unauthenticated client cannot make the server buffer a
body. The body is then read up to `max_body_bytes` (Content-Length is checked before reading;
the bytes actually received are counted too, for chunked uploads) and replayed to the app.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.cluster.frontend.openai.responses import error_body
from splitserve.cluster.tenants.tenant_refusal import UNKNOWN_KEY_MESSAGE


async def send_error(
    send: Send,
    status: int,
    message: str,
    error_type: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    body = json.dumps(error_body(message, error_type, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class RequestGuard:
    """Wraps the app: 401 without the API key on protected paths, 413 for oversized bodies."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        protected_prefixes: tuple[str, ...] = ("/v1/", "/tokenize", "/detokenize"),
        body_timeout_s: float | None = None,
        upload_paths: tuple[str, ...] = (),
        max_upload_bytes: int = 0,
        authorize: Callable[[Scope], bool] | None = None,
    ):
        """upload_paths: paths whose POST bodies may be up to max_upload_bytes instead (file
        uploads; the route checks the file itself and answers 400 over its own limit).
        authorize: decides on a protected path's request instead of api_key (tenants' keys,
        the admin key, batch lines: cluster/frontend/http/caller.py)."""
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.api_key = api_key
        self.authorize = authorize
        self.max_body_bytes = max_body_bytes
        self.protected_prefixes = protected_prefixes
        # A slow client's body (a slowloris: a partial Content-Length or chunked body) must
        # arrive within this; then 408 and the connection is closed.
        self.body_timeout_s = body_timeout_s
        self.upload_paths = upload_paths
        # Multipart framing (boundaries, part headers) rides on top of the file's own bytes.
        self.max_upload_bytes = max_upload_bytes + 64 * 1024

    def _authorized(self, scope: Scope) -> bool:
        if not scope["path"].startswith(self.protected_prefixes):
            return True
        if self.authorize is not None:
            return self.authorize(scope)
        if not self.api_key:
            return True
        token = bearer_token(scope.get("headers", []))
        return token is not None and hmac.compare_digest(token.encode(), self.api_key.encode())

    def _declared_length(self, scope: Scope) -> int | None:
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length":
                return int(value)  # ValueError on garbage; the caller answers 400
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(name.lower() == b"authorization" for name, _ in scope.get("headers", [])) > 1:
            # Two credentials: which one counts would be a guess, and a proxy may add one.
            await send_error(send, 400, "send one Authorization header, not several", "invalid_request_error")
            return
        if not self._authorized(scope):
            await send_error(
                send,
                401,
                UNKNOWN_KEY_MESSAGE,
                "invalid_request_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return
        try:
            declared = self._declared_length(scope)
        except ValueError:
            await send_error(send, 400, "the Content-Length header is not an integer", "invalid_request_error")
            return
        limit = self.max_body_bytes
        if scope["path"] in self.upload_paths and scope["method"] == "POST":
            limit = max(limit, self.max_upload_bytes)
        if declared is not None and declared > limit:
            await self._send_too_large(send, limit)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive, limit), self.body_timeout_s)
        except TimeoutError:
            await send_error(
                send,
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                "invalid_request_error",
                code="request_timeout",
                headers={"Connection": "close"},
            )
            return
        if body is _TOO_LARGE:
            await self._send_too_large(send, limit)
        elif body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive, limit: int):
        """The whole body; None when the client left first; _TOO_LARGE past the cap."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _TOO_LARGE
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _send_too_large(self, send: Send, limit: int) -> None:
        await send_error(
            send,
            413,
            f"the request body exceeds the limit of {limit} bytes",
            "invalid_request_error",
            code="request_too_large",
        )


_TOO_LARGE = object()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the client's later messages
    (http.disconnect), so streaming responses still notice a client leaving."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
