"""/v1/files: upload (multipart, purpose=batch, JSONL checked line by line), list, retrieve,
content, delete. Files live in the state store, so an upload through any ingress replica is
seen by every other one."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from fastapi import FastAPI, File, Form, Query, UploadFile
from fastapi.responses import JSONResponse, Response

from splitserve.cluster.batch.input_file import BatchInputError, parse_input_file
from splitserve.cluster.batch.openai_objects import file_object, list_object, new_file_id
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.http.errors import OpenAIHTTPError
from splitserve.cluster.state.batch_store import BatchStore
from splitserve.cluster.state.records import FileRecord

UPLOAD_PURPOSES = ("batch",)


def add_file_routes(app: FastAPI, store: BatchStore, cfg: ServeConfig, auth: list, errors: dict) -> None:
    async def existing_file(file_id: str) -> FileRecord:
        record = await asyncio.to_thread(store.get_file, file_id)
        if record is None:
            raise OpenAIHTTPError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return record

    @app.post("/v1/files", dependencies=auth, responses=errors)
    async def upload_file(file: UploadFile = File(...), purpose: str = Form(...)) -> JSONResponse:
        """Upload a Batch API input file (JSONL, one request per line)."""
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
        record = FileRecord(new_file_id(), purpose, file.filename or "upload.jsonl", len(content), int(time.time()))
        await asyncio.to_thread(store.put_file, record, content)
        return JSONResponse(file_object(record))

    @app.get("/v1/files", dependencies=auth, responses=errors)
    async def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(100, ge=1, le=10_000),
        order: Literal["asc", "desc"] = "desc",
    ) -> JSONResponse:
        records = await asyncio.to_thread(store.list_files, purpose, after, limit + 1, order == "desc")
        data = [file_object(r) for r in records[:limit]]
        return JSONResponse(list_object(data, has_more=len(records) > limit))

    @app.get("/v1/files/{file_id}", dependencies=auth, responses=errors)
    async def retrieve_file(file_id: str) -> JSONResponse:
        return JSONResponse(file_object(await existing_file(file_id)))

    @app.get("/v1/files/{file_id}/content", dependencies=auth, responses=errors)
    async def file_content(file_id: str) -> Response:
        content = await asyncio.to_thread(store.file_content, file_id)
        if content is None:
            raise OpenAIHTTPError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return Response(content, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=auth, responses=errors)
    async def delete_file(file_id: str) -> JSONResponse:
        if not await asyncio.to_thread(store.delete_file, file_id):
            raise OpenAIHTTPError(404, f"no file with id {file_id!r}", param="file_id", code="file_not_found")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
