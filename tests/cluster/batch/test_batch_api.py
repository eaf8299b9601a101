"""The OpenAI Batch API on a real 1P+1D cluster (local Ray, CPU) through the unmodified `openai`
client: files.create / batches.create / batches.retrieve / files.content run batches to the
end; each output line equals the live greedy answer; a bad line goes to the error file while
the rest run; bad input gets a 400 and creates nothing; cancel aborts the lines in flight and
the block pools return to baseline; a runner that dies mid-batch is replaced and every
custom_id still appears exactly once."""

from __future__ import annotations

import asyncio

import openai
import pytest

from splitserve.cluster.batch.batch_service import BatchService
from splitserve.cluster.frontend.http.api import build_http_app
from tests.helpers.batch_api import (
    chat_line,
    completion_line,
    jsonl,
    read_lines,
    start_service,
    wait_for_status,
)
from tests.helpers.cluster import (
    LoopHttpServer,
    cluster_config,
    serving_backend,
    slow_decode,
    wait_for_baseline,
    wait_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SHARED = "Summarize the following note in one line. Note: "  # batch jobs often share a prompt


@pytest.fixture(scope="module")
def cfg(tiny_model, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("state")
    batch = {"poll_interval_s": 0.05, "lease_s": 1.0, "max_concurrency": 4}
    return cluster_config(tiny_model, num_blocks=64, state_dir=str(state_dir), batch=batch)


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop, cfg):
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def served(loop, backend, cfg):
    """(openai client, BatchService, app) on uvicorn, the runner started on the cluster's loop."""
    service = BatchService(cfg, "ingress-a", backend.metrics.registry, backend.model_name)
    app = build_http_app(backend, batch=service)
    with LoopHttpServer(loop, app) as server:
        start_service(loop, service)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, service, app
        loop.run(service.stop())


@pytest.fixture
def client(served):
    return served[0]


def run_batch(client, lines, endpoint="/v1/completions"):
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "validating" and batch.request_counts.total == len(lines)
    return wait_for_status(client, batch.id)


def test_completions_batch_matches_live_greedy_answers(client, backend, loop):
    model = backend.model_name
    lines = [completion_line(f"note-{i}", model, SHARED + f"item {i} " * (i + 1), max_tokens=6) for i in range(5)]
    lines.insert(2, completion_line("bad", model, "x", max_tokens=-3))  # refused as a live request would be
    batch = run_batch(client, lines)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 5, 1)
    assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
    output = read_lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in output] == [f"note-{i}" for i in range(5)]
    for line, sent in zip(output, [x for x in lines if x["custom_id"] != "bad"]):
        assert line["response"]["status_code"] == 200 and line["error"] is None
        live = client.completions.create(**sent["body"])
        assert line["response"]["body"]["choices"][0]["text"] == live.choices[0].text
        assert line["response"]["body"]["usage"]["completion_tokens"] == live.usage.completion_tokens
    (error,) = read_lines(client, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["response"]["body"]["error"]["message"]
    registry, labels = backend.metrics.registry, {"model_name": model}
    assert registry.get_sample_value("splitserve_batch_lines_total", {**labels, "result": "completed"}) >= 5
    assert registry.get_sample_value("splitserve_batch_lines_total", {**labels, "result": "failed"}) >= 1
    assert registry.get_sample_value("splitserve_batch_generation_tokens_total", labels) >= 5 * 6
    assert registry.get_sample_value("splitserve_batch_jobs", {**labels, "status": "completed"}) >= 0
    wait_for_baseline(loop, backend.cluster)


def test_chat_batch_matches_live_greedy_answers(client, backend):
    lines = [chat_line(f"c{i}", backend.model_name, f"hello {i}", max_tokens=5) for i in range(3)]
    batch = run_batch(client, lines, endpoint="/v1/chat/completions")
    assert batch.status == "completed" and batch.request_counts.completed == 3
    for line, sent in zip(read_lines(client, batch.output_file_id), lines):
        live = client.chat.completions.create(**sent["body"])
        assert line["response"]["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content


def _listing(client):
    return sorted(b.id for b in client.batches.list(limit=100).data), sorted(f.id for f in client.files.list().data)


def test_bad_input_is_refused_with_400_and_creates_nothing(client, backend, cfg):
    model = backend.model_name
    good = client.files.create(file=jsonl([completion_line("a", model, "x", max_tokens=1)]), purpose="batch")
    before = _listing(client)
    malformed = jsonl([completion_line("a", model, "x")])
    malformed.seek(0, 2)  # append a broken second line
    malformed.write(b'{"custom_id": "b", "method": "POST"\n')
    malformed.seek(0)
    cases = {
        "malformed JSONL": lambda: client.files.create(file=malformed, purpose="batch"),
        "line over the body limit": lambda: client.files.create(
            file=jsonl([completion_line("big", model, "y" * (cfg.max_body_bytes + 10))]), purpose="batch"
        ),
        "wrong purpose": lambda: client.files.create(
            file=jsonl([completion_line("a", model, "x")]), purpose="fine-tune"
        ),
        "unknown endpoint": lambda: client.batches.create(
            input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h"
        ),
        "missing file": lambda: client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        ),
    }
    dup = client.files.create(
        file=jsonl([completion_line("same", model, "x"), completion_line("same", model, "y")]), purpose="batch"
    )
    before = (before[0], sorted([dup.id, *before[1]]))
    cases["duplicate custom_id"] = lambda: client.batches.create(
        input_file_id=dup.id, endpoint="/v1/completions", completion_window="24h"
    )
    expected = {
        "malformed JSONL": "line 2 is not valid JSON",
        "line over the body limit": "over the request body limit",
        "wrong purpose": "purpose must be one of batch",
        "unknown endpoint": "endpoint must be one of",
        "missing file": "no file with id 'file-nope'",
        "duplicate custom_id": "duplicate custom_id 'same'",
    }
    for name, call in cases.items():
        # A file that is not there (or not the caller's) is a 404, as on every other route.
        error = openai.NotFoundError if name == "missing file" else openai.BadRequestError
        with pytest.raises(error) as refused:
            call()
        assert expected[name] in refused.value.message, (name, refused.value.message)
        assert _listing(client) == before, f"{name} left something behind"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    assert client.files.delete(dup.id).deleted and client.files.delete(good.id).deleted


def test_cancel_aborts_lines_in_flight_and_frees_blocks(client, backend, loop):
    """Unbounded lines (ignore_eos, huge max_tokens) can only end by the cancel."""
    model = backend.model_name
    lines = [completion_line(f"long-{i}", model, f"go {i}", max_tokens=100_000, ignore_eos=True) for i in range(6)]
    lines = [{**x, "body": {**x["body"], "max_tokens": 400}} for x in lines]  # within max_model_len
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: backend.num_sheddable_inflight > 0, None, "no batch line started")
    assert backend.num_inflight == 0  # batch lines are batch class: outside the interactive limit
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_for_status(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    seen = [x["custom_id"] for x in read_lines(client, done.output_file_id) + read_lines(client, done.error_file_id)]
    assert sorted(seen) == sorted(x["custom_id"] for x in lines)  # each exactly once
    assert done.request_counts.completed + done.request_counts.failed == len(lines)
    wait_until(lambda: backend.num_sheddable_inflight == 0, None, "batch lines still in flight after the cancel")
    wait_for_baseline(loop, backend.cluster, timeout_s=30)
    assert client.batches.cancel(batch.id).status == "cancelled"  # OpenAI's: the batch, as it is


def test_a_runner_killed_mid_batch_is_replaced_and_each_custom_id_appears_once(served, backend, cfg, loop):
    """The lease holder dies without a word (no lease release, its requests cut off), a second
    ingress's runner takes the lease once it expires, resumes the job from the store, and no
    custom_id is lost or doubled. (Last in this module: it leaves the second runner running.)"""
    from prometheus_client import CollectorRegistry

    client, first, _ = served
    model = backend.model_name
    lines = [completion_line(f"r{i}", model, SHARED + f"row {i}", max_tokens=24) for i in range(12)]
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    # Each decode step at least 50 ms: a line lasts >= 24 steps, so "one line done and another
    # in flight" lasts far longer than the poll below on any machine (a floor, not a ceiling).
    slow_decode(loop, backend, 0.05)
    try:
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        wait_until(
            lambda: first.runner.inflight and first.store.get_batch(batch.id).completed >= 1,
            None,
            "the first runner never had a line done and another in flight",
        )

        async def kill(service):
            service._task.cancel()
            tasks = list(service.runner.inflight.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(service._task, *tasks, return_exceptions=True)

        loop.run(kill(first))  # still slowed: the kill lands while lines run
    finally:
        slow_decode(loop, backend, 0.0)
    second = BatchService(cfg, "ingress-b", CollectorRegistry(), model)
    build_http_app(backend, batch=second)
    start_service(loop, second)
    try:
        done = wait_for_status(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == len(lines)
        output = read_lines(client, done.output_file_id)
        assert [x["custom_id"] for x in output] == [x["custom_id"] for x in lines]
        assert read_lines(client, done.error_file_id) == []
        for line, sent in zip(output[:3], lines[:3]):
            assert (
                line["response"]["body"]["choices"][0]["text"]
                == client.completions.create(**sent["body"]).choices[0].text
            )
        wait_for_baseline(loop, backend.cluster, timeout_s=30)
    finally:
        loop.run(second.stop())
