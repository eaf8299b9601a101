"""Runs one batch line exactly as a live request of the batch's owner: through the ingress's
own HTTP app (in process, httpx's ASGI transport), so validation, tenant admission and limits,
billing, routing (prefix affinity included) and rendering are the live path's, and the output
line is the live response. The owner travels in the ASGI scope, not as a key
(cluster/frontend/http/caller.py). It goes at the batch priority class: admitted only where a
decode replica has headroom (else 429, and the runner retries it later), preempted by
interactive work in the engines."""

from __future__ import annotations

import uuid

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve.cluster.frontend.http.caller import BATCH_OWNER_SCOPE_KEY
from splitserve.cluster.frontend.openai.responses import error_body
from splitserve.cluster.frontend.priority_class import BATCH, PRIORITY_CLASS_HEADER
from splitserve.cluster.state.records import BatchLine, BatchRecord, LineResult

# Answers that mean "not now" (no headroom, a replica going away, the tenant's per-minute
# limits): the line runs again later. Past its budget a tenant is refused for the whole
# period, so that 429 is the line's result, as are every other error's.
RETRY_LATER = (429, 503)
FINAL_CODES = ("insufficient_quota",)
_OWNER_HEADER = b"x-splitserve-batch-owner"


def retry_later(result: LineResult) -> bool:
    code = ((result.body or {}).get("error") or {}).get("code")
    return result.status_code in RETRY_LATER and code not in FINAL_CODES


def _as_owner(app: ASGIApp) -> ASGIApp:
    """The app, with each request's owner header (set by LineExecutor only, on this in-process
    transport) moved into the scope, where the app's Callers reads it."""

    async def owned(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k != _OWNER_HEADER]
        owner = next((v.decode() for k, v in scope["headers"] if k == _OWNER_HEADER), "")
        await app({**scope, "headers": headers, BATCH_OWNER_SCOPE_KEY: owner}, receive, send)

    return owned


class LineExecutor:
    def __init__(self, app):
        # Batch class: the line's own `priority` (if any) is kept; it is shed without headroom.
        # raise_app_exceptions=False: the app's own 500 answer is the line's result.
        transport = httpx.ASGITransport(app=_as_owner(app), raise_app_exceptions=False)
        self.client = httpx.AsyncClient(
            transport=transport,
            base_url="http://batch.internal",
            headers={PRIORITY_CLASS_HEADER: BATCH},
            timeout=None,
        )

    async def run(self, batch: BatchRecord, line: BatchLine) -> LineResult:
        request_id = uuid.uuid4().hex
        if line.body.get("stream"):
            body = error_body("stream is not supported in a batch line", "invalid_request_error", "stream")
            return LineResult(line.custom_id, line.line_no, False, 400, request_id, body)
        headers = {"x-request-id": request_id, _OWNER_HEADER.decode(): batch.owner}
        response = await self.client.post(batch.endpoint, json=line.body, headers=headers)
        try:
            payload = response.json()
        except ValueError:
            payload = error_body(response.text[:500] or "empty response", "server_error")
        ok = response.status_code == 200
        tokens = int((payload.get("usage") or {}).get("completion_tokens", 0)) if ok else 0
        return LineResult(line.custom_id, line.line_no, ok, response.status_code, request_id, payload, tokens)

    async def close(self) -> None:
        await self.client.aclose()
