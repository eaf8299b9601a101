"""Helpers of the Batch API tests: input files, a BatchService on a real cluster's HTTP app,
and waits on a batch's status through the official `openai` client."""

from __future__ import annotations

import io
import json
import time

from splitserve.cluster.batch.batch_service import BatchService

FINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[dict]) -> io.BytesIO:
    buf = io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())
    buf.name = "input.jsonl"
    return buf


def completion_line(custom_id: str, model: str, prompt, **params) -> dict:
    body = {"model": model, "prompt": prompt, "temperature": 0, **params}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def chat_line(custom_id: str, model: str, content: str, **params) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **params}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def start_service(loop, service: BatchService) -> None:
    async def start():
        service.start()

    loop.run(start())


def wait_for_status(client, batch_id: str, statuses=FINAL, timeout_s: float = 240.0):
    """Polls batches.retrieve until the batch is in one of statuses (timeout: a safety net only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s: {batch}")
        time.sleep(0.1)


def read_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
