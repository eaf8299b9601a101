"""/v1/files: upload (multipart: one `file` part and one `purpose`, purpose=batch, JSONL checked
line by line), list, retrieve, content, delete. Files live in the state store, so an upload
through any ingress replica is seen by every other one. A file is its uploader's (the tenant of
the key; cluster/frontend/http/caller.py): every route answers another owner's file with 404,
as one that does not exist."""

from __future__ import annotations

import asyncio
import time
from pathlib import PurePosixPath
from typing import Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from splitserve.cluster.batch.input_file import BatchInputError, parse_input_file
from splitserve.cluster.batch.openai_objects import file_object, list_object, new_file_id
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.caller import Callers
from splitserve.cluster.frontend.http.errors import OpenAIHTTPError
from splitserve.cluster.request_error import echoed
from splitserve.cluster.state.batch_store import BatchStore
from splitserve.cluster.state.records import FileRecord

UPLOAD_PURPOSES = ("batch",)
DEFAULT_FILENAME = "upload.jsonl"


def no_such_file(file_id: str) -> OpenAIHTTPError:
    return OpenAIHTTPError(404, f"no file with id {echoed(file_id)}", param="file_id", code="file_not_found")


def base_name(filename: str | None) -> str:
    """The client's filename without any folders (a name is a label, never a path)."""
    name = PurePosixPath((filename or "").replace("\\", "/")).name
    return name if name not in ("", ".", "..") else DEFAULT_FILENAME


async def _single_parts(request: Request) -> None:
    """OpenAI's upload takes one file and one purpose; several of either is refused, not guessed."""
    form = await request.form()  # already parsed for the route's parameters: cached
    for name in ("file", "purpose"):
        if len(form.getlist(name)) > 1:
            raise OpenAIHTTPError(400, f"send one {name!r} part, not {len(form.getlist(name))}", param=name)


def add_file_routes(
    app: FastAPI, store: BatchStore, cfg: ServeConfig, auth: list, errors: dict, callers: Callers
) -> None:
    async def existing_file(file_id: str, owner: str | None) -> FileRecord:
        record = await asyncio.to_thread(store.get_file, file_id, owner)
        if record is None:
            raise no_such_file(file_id)
        return record

    @app.post("/v1/files", dependencies=auth, responses=errors)
    async def upload_file(
        request: Request,
        file: UploadFile = File(...),
        purpose: str = Form(..., json_schema_extra={"enum": list(UPLOAD_PURPOSES)}),
    ) -> JSONResponse:
        """Upload a Batch API input file (JSONL, one request per line)."""
        caller = callers.of(request.scope)
        if caller.is_admin:
            raise OpenAIHTTPError(
                400, "the admin key cannot upload files: use a tenant's API key", code="invalid_api_key"
            )
        await _single_parts(request)
        if purpose not in UPLOAD_PURPOSES:
            raise OpenAIHTTPError(
                400,
                f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                "invalid_request_error",
                "purpose",
            )
        content = await file.read(cfg.batch.max_file_bytes + 1)
        if len(content) > cfg.batch.max_file_bytes:
            raise OpenAIHTTPError(400, f"the file exceeds the limit of {cfg.batch.max_file_bytes} bytes", param="file")
        try:
            await asyncio.to_thread(parse_input_file, content, cfg.batch.max_lines, cfg.max_body_bytes)
        except BatchInputError as e:
            raise OpenAIHTTPError(400, str(e), param=e.param) from None
        record = FileRecord(
            new_file_id(), purpose, base_name(file.filename), len(content), int(time.time()), owner=caller.owner or ""
        )
        await asyncio.to_thread(store.put_file, record, content)
        return JSONResponse(file_object(record))

    @app.get("/v1/files", dependencies=auth, responses=errors)
    async def list_files(
        request: Request,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(100, ge=1, le=10_000),
        order: Literal["asc", "desc"] = "desc",
    ) -> JSONResponse:
        owner = callers.of(request.scope).owner
        records = await asyncio.to_thread(store.list_files, purpose, after, limit + 1, order == "desc", owner)
        data = [file_object(r) for r in records[:limit]]
        return JSONResponse(list_object(data, has_more=len(records) > limit))

    @app.get("/v1/files/{file_id}", dependencies=auth, responses=errors)
    async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
        return JSONResponse(file_object(await existing_file(file_id, callers.of(request.scope).owner)))

    @app.get("/v1/files/{file_id}/content", dependencies=auth, responses=errors)
    async def file_content(file_id: str, request: Request) -> Response:
        content = await asyncio.to_thread(store.file_content, file_id, callers.of(request.scope).owner)
        if content is None:
            raise no_such_file(file_id)
        return Response(content, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=auth, responses=errors)
    async def delete_file(file_id: str, request: Request) -> JSONResponse:
        if not await asyncio.to_thread(store.delete_file, file_id, callers.of(request.scope).owner):
            raise no_such_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
