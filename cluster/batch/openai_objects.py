"""The Batch API's JSON objects as OpenAI defines them (File, Batch, lists, output lines)."""

from __future__ import annotations

import uuid
from typing import Any

from splitserve.cluster.state.records import BatchRecord, FileRecord, LineResult


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(record: BatchRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": record.errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        **record.timestamps,
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "metadata": record.metadata,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def result_line(result: LineResult) -> dict[str, Any]:
    """One line of an output or error file. A line that got an HTTP answer carries it in
    `response` (the error file's bodies are OpenAI error objects); one that never ran
    (cancelled, expired) has `response: null` and an `error` with OpenAI's code."""
    line_id = f"batch_req_{result.request_id}"
    if result.status_code == 0:
        return {"id": line_id, "custom_id": result.custom_id, "response": None, "error": result.body}
    response = {"status_code": result.status_code, "request_id": result.request_id, "body": result.body}
    return {"id": line_id, "custom_id": result.custom_id, "response": response, "error": None}
