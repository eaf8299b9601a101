"""Helpers of the Batch API tests: input files, a BatchService on a real cluster's HTTP app,
and waits on a batch's status through the official `openai` client."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator

from splitserve.cluster.batch.batch_service import BatchService
from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.cluster import LoopHttpServer

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


class TenantIngress:
    """One ingress replica without Ray: the real HTTP app, TenantGate, BatchService (runner
    started) and state store on state_url, over a scripted FakeBackend, served by uvicorn on
    127.0.0.1. Closing it and opening another on the same state_url is a restart."""

    def __init__(self, cfg, tokenizer, holder: str = "ingress-a"):
        from prometheus_client import CollectorRegistry

        from splitserve.cluster.frontend.http.api import build_http_app
        from splitserve.cluster.state.database import open_state_engine, state_database_url
        from splitserve.cluster.tenants.tenant_gate import TenantGate
        from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
        from tests.helpers.cluster import LoopHttpServer, LoopThread
        from tests.helpers.http_api import FakeBackend

        self.loop = LoopThread()
        self.backend = FakeBackend(tokenizer, cfg)
        self.registry = CollectorRegistry()
        self.engine = open_state_engine(state_database_url(cfg.state_dir, cfg.state_url))
        self.backend.tenants = TenantGate(cfg, self.engine, holder, TenantMetrics(self.registry))
        self.service = BatchService(cfg, holder, self.registry, self.backend.model_name)
        self.app = build_http_app(self.backend, batch=self.service)
        self.server = LoopHttpServer(self.loop, self.app).__enter__()
        start_service(self.loop, self.service)
        self.url = self.server.url

    def client(self, key: str):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def close(self) -> None:
        self.loop.run(self.service.stop())
        self.loop.run(self.backend.tenants.close())
        self.server.__exit__(None, None, None)
        self.engine.dispose()
        self.loop.stop()


@contextlib.contextmanager
def http_server_with_batches(loop, backend) -> Iterator:
    """The real HTTP app over a ServingBackend, with a started BatchService (one ingress's),
    served on 127.0.0.1; the service stops on exit."""
    service = BatchService(backend.cfg, "ingress-a", backend.metrics.registry, backend.model_name)
    with LoopHttpServer(loop, build_http_app(backend, batch=service)) as srv:
        start_service(loop, service)
        yield srv
        loop.run(service.stop())
