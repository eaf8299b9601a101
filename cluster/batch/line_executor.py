"""Runs one batch line exactly as a live request: through the ingress's own HTTP app (in
process, httpx's ASGI transport), so validation, admission, routing (prefix affinity
included) and rendering are the live path's, and the output line is the live response. It
goes at the batch priority class: admitted only where a decode replica has headroom (else
429, and the runner retries it later), preempted by interactive work in the engines."""

from __future__ import annotations

import uuid

import httpx

from splitserve.cluster.frontend.openai.responses import error_body
from splitserve.cluster.frontend.priority_class import BATCH, PRIORITY_CLASS_HEADER
from splitserve.cluster.state.records import BatchLine, LineResult

# Answers that mean "not now" (no headroom, a replica going away): the line runs again later.
RETRY_LATER = (429, 503)


class LineExecutor:
    def __init__(self, app, api_key: str | None):
        # Batch class: the line's own `priority` (if any) is kept; it is shed without headroom.
        headers = {PRIORITY_CLASS_HEADER: BATCH}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        # raise_app_exceptions=False: the app's own 500 answer is the line's result.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(
            transport=transport, base_url="http://batch.internal", headers=headers, timeout=None
        )

    async def run(self, endpoint: str, line: BatchLine) -> LineResult:
        request_id = uuid.uuid4().hex
        if line.body.get("stream"):
            body = error_body("stream is not supported in a batch line", "invalid_request_error", "stream")
            return LineResult(line.custom_id, line.line_no, False, 400, request_id, body)
        response = await self.client.post(endpoint, json=line.body, headers={"x-request-id": request_id})
        try:
            payload = response.json()
        except ValueError:
            payload = error_body(response.text[:500] or "empty response", "server_error")
        ok = response.status_code == 200
        tokens = int((payload.get("usage") or {}).get("completion_tokens", 0)) if ok else 0
        return LineResult(line.custom_id, line.line_no, ok, response.status_code, request_id, payload, tokens)

    async def close(self) -> None:
        await self.client.aclose()
