"""/v1/batches: create (the input file checked as a whole: endpoint, every line's url, unique
custom_ids; nothing is stored unless all of it holds), retrieve, list (newest first, `after`
cursor), cancel (OpenAI's rules: a batch cancelling or cancelled is answered as it is; a
finished one cannot be). The runner (batch_runner.py) moves a batch on from `validating`. A
batch is its creator's (the tenant of the key; cluster/frontend/http/caller.py), created only
from that caller's own file, and its lines run as that tenant; every route answers another
owner's batch with 404, as one that does not exist."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from splitserve.cluster.batch.file_routes import no_such_file
from splitserve.cluster.batch.input_file import (
    BATCH_ENDPOINTS,
    BatchInputError,
    check_batch_lines,
    parse_input_file,
)
from splitserve.cluster.batch.openai_objects import batch_object, list_object, new_batch_id
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.caller import Callers
from splitserve.cluster.frontend.http.errors import OpenAIHTTPError
from splitserve.cluster.request_error import echoed
from splitserve.cluster.state.batch_store import BatchStore
from splitserve.cluster.state.records import (
    CANCELLED,
    CANCELLING,
    IN_PROGRESS,
    VALIDATING,
    BatchLine,
    BatchRecord,
)

COMPLETION_WINDOWS_S = {"24h": 24 * 3600}


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    # The schema names the endpoints; the route's own check gives the readable refusal.
    endpoint: str = Field(json_schema_extra={"enum": list(BATCH_ENDPOINTS)})
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)


def add_batch_routes(
    app: FastAPI,
    store: BatchStore,
    cfg: ServeConfig,
    auth: list,
    errors: dict,
    callers: Callers,
    on_change: Callable[[], None] = lambda: None,
) -> None:
    """on_change: called when a batch was created or cancelled here (this replica's runner looks
    at once instead of at its next poll)."""

    async def existing_batch(batch_id: str, owner: str | None) -> BatchRecord:
        record = await asyncio.to_thread(store.get_batch, batch_id, owner)
        if record is None:
            raise OpenAIHTTPError(404, f"no batch with id {echoed(batch_id)}", param="batch_id", code="batch_not_found")
        return record

    @app.post("/v1/batches", dependencies=auth, responses=errors)
    async def create_batch(body: BatchCreateRequest, request: Request) -> JSONResponse:
        """Create a batch from an uploaded input file; its lines run at batch priority, as the caller's tenant."""
        caller = callers.of(request.scope)
        if caller.is_admin:
            raise OpenAIHTTPError(
                400, "the admin key cannot run batches: use a tenant's API key", code="invalid_api_key"
            )
        for key, value in (body.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise OpenAIHTTPError(
                    400, "metadata keys are at most 64 characters, values at most 512", param="metadata"
                )
        content = await asyncio.to_thread(store.file_content, body.input_file_id, caller.owner)
        if content is None:
            missing = no_such_file(body.input_file_id)
            missing.param = "input_file_id"
            raise missing
        try:
            lines = await asyncio.to_thread(parse_input_file, content, cfg.batch.max_lines, cfg.max_body_bytes)
            check_batch_lines(lines, body.endpoint)
        except BatchInputError as e:
            raise OpenAIHTTPError(400, str(e), param=e.param) from None
        now = int(time.time())
        record = BatchRecord(
            id=new_batch_id(),
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            status=VALIDATING,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS_S[body.completion_window],
            total=len(lines),
            metadata=body.metadata,
            owner=caller.owner or "",
        )
        stored = [BatchLine(x.line_no, x.custom_id, x.body) for x in lines]
        await asyncio.to_thread(store.create_batch, record, stored)
        on_change()
        # The batch as created (OpenAI answers `validating`), not read back: a runner may already
        # have moved it on.
        return JSONResponse(batch_object(record))

    @app.get("/v1/batches/{batch_id}", dependencies=auth, responses=errors)
    async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
        return JSONResponse(batch_object(await existing_batch(batch_id, callers.of(request.scope).owner)))

    @app.get("/v1/batches", dependencies=auth, responses=errors)
    async def list_batches(
        request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> JSONResponse:
        owner = callers.of(request.scope).owner
        records = await asyncio.to_thread(store.list_batches, after, limit + 1, owner)
        data = [batch_object(r) for r in records[:limit]]
        return JSONResponse(list_object(data, has_more=len(records) > limit))

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=auth, responses=errors)
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        """Stop starting lines; lines in flight are aborted; the batch ends `cancelled`."""
        owner = callers.of(request.scope).owner
        await existing_batch(batch_id, owner)
        moved = await asyncio.to_thread(
            store.transition, batch_id, (VALIDATING, IN_PROGRESS), CANCELLING, int(time.time())
        )
        if moved:
            on_change()
        else:
            record = await existing_batch(batch_id, owner)
            if record.status not in (CANCELLING, CANCELLED):
                raise OpenAIHTTPError(
                    400, f"the batch is {record.status}: only a running batch can be cancelled", param="batch_id"
                )
        return JSONResponse(batch_object(await existing_batch(batch_id, owner)))
