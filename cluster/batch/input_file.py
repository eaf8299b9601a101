"""Reads and checks a Batch API input file: JSONL, one request per line, OpenAI's line shape
{"custom_id", "method": "POST", "url", "body"}.

Shape errors refuse the whole file or batch with a 400 naming the line, before anything is
stored; what a request body means (model, parameters) is checked when the line runs, exactly
as a live request is, and a bad one goes to the error file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The endpoints a batch may target (OpenAI also has /v1/embeddings and /v1/responses).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class BatchInputError(ValueError):
    """A file or batch refused as a whole: message names the line (1-based) and the problem."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class InputLine:
    line_no: int  # 0-based position among the file's requests
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_input_file(content: bytes, max_lines: int, max_line_bytes: int) -> list[InputLine]:
    """Every request of a JSONL batch input file, or BatchInputError for the first bad line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BatchInputError(f"the file is not UTF-8 text: {e}", "file") from None
    lines: list[InputLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline) carry no request
        if len(raw.encode("utf-8")) > max_line_bytes:
            raise BatchInputError(
                f"line {number} is {len(raw.encode('utf-8'))} bytes, over the request body limit of {max_line_bytes}",
                "file",
            )
        if len(lines) == max_lines:
            raise BatchInputError(f"the file has more than {max_lines} requests (lines)", "file")
        lines.append(_parse_line(raw, number, len(lines)))
    if not lines:
        raise BatchInputError("the file holds no requests: a batch input file is JSONL, one request per line", "file")
    return lines


def _parse_line(raw: str, number: int, line_no: int) -> InputLine:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BatchInputError(f"line {number} is not valid JSON: {e.msg} (column {e.colno})", "file") from None
    if not isinstance(obj, dict):
        raise BatchInputError(f"line {number} must be a JSON object", "file")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchInputError(f"line {number}: custom_id must be a non-empty string", "file")
    if obj.get("method") != "POST":
        raise BatchInputError(f'line {number}: method must be "POST", got {obj.get("method")!r}', "file")
    url = obj.get("url")
    if url not in BATCH_ENDPOINTS:
        raise BatchInputError(f"line {number}: url must be one of {', '.join(BATCH_ENDPOINTS)}, got {url!r}", "file")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchInputError(f"line {number}: body must be a JSON object", "file")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BatchInputError(f"line {number}: unknown field(s) {', '.join(unknown)}", "file")
    return InputLine(line_no, custom_id, url, body)


def check_batch_lines(lines: list[InputLine], endpoint: str) -> None:
    """What POST /v1/batches adds: every line targets the batch's endpoint, custom_ids are unique."""
    if endpoint not in BATCH_ENDPOINTS:
        raise BatchInputError(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}", "endpoint")
    seen: dict[str, int] = {}
    for line in lines:
        if line.url != endpoint:
            raise BatchInputError(
                f"request {line.line_no + 1}: url {line.url!r} differs from the batch's endpoint {endpoint!r}",
                "input_file_id",
            )
        if line.custom_id in seen:
            raise BatchInputError(
                f"request {line.line_no + 1}: duplicate custom_id {line.custom_id!r} (first in request {seen[line.custom_id] + 1})",
                "input_file_id",
            )
        seen[line.custom_id] = line.line_no
