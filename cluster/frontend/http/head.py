"""HEAD wherever GET works: ASGI middleware that runs a HEAD request as the GET it mirrors
and sends only the status and headers (Content-Length included), as HTTP says HEAD must.

FastAPI registers GET routes for GET alone, so without this a load balancer's or monitor's
`HEAD /health` gets a 405."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.cluster.frontend.http.sse import BODY_SEND


class HeadAsGet:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        body_sent = False

        async def send_headers_only(message: Message) -> None:
            nonlocal body_sent
            if message["type"] == "http.response.start":
                await send(message)
            elif message["type"] == "http.response.body" and not body_sent:
                if not message.get("more_body", False):
                    body_sent = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)

        # A streamed body must not skip send_headers_only (sse.py's BODY_SEND).
        await self.app({**scope, "method": "GET", BODY_SEND: send_headers_only}, receive, send_headers_only)
