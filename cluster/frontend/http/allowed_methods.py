"""Methods per path, as HTTP states them: OPTIONS answers 204 with `Allow`, and a method a path
does not take is a 405 with `Allow` listing every method it does (RFC 9110 §15.5.6).

Starlette's router answers a wrong method from the first route matching the path, so a path
served by several routes (GET and POST /v1/files) would list only that one route's methods.
This reads every route of the app instead; HEAD goes wherever GET does (head.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.cluster.frontend.http.guard import send_error


class AllowedMethods:
    def __init__(self, app: ASGIApp, routes: Callable[[], Sequence[BaseRoute]]):
        """routes: the app's routes, read at each request (routes may be added after this)."""
        self.app, self.routes = app, routes

    def allowed(self, scope: Scope) -> set[str]:
        methods: set[str] = set()
        for route in self.routes():
            match, _ = route.matches({**scope, "method": "GET"})
            # A route without methods (a mount) takes every method: leave it to the router.
            route_methods = getattr(route, "methods", None)
            if match != Match.NONE and route_methods:
                methods |= set(route_methods)
        if "GET" in methods:
            methods.add("HEAD")
        return methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        methods = self.allowed(scope)
        if not methods or scope["method"] in methods:
            await self.app(scope, receive, send)
            return
        allow = ", ".join(sorted(methods | {"OPTIONS"}))
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", allow.encode())]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send_error(
            send,
            405,
            f"{scope['method']} is not allowed here; allowed: {allow}",
            "invalid_request_error",
            headers={"Allow": allow},
        )
