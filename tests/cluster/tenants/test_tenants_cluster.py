"""Tenants on a real 1P+1D cluster (local Ray, CPU) behind the real HTTP app, driven with the
`openai` client: unknown keys and disallowed models, requests/min with the other tenant
unaffected, OpenAI's x-ratelimit-* headers counting down, a token budget stopping many long
streams at admission, usage read back from the state store equal to what clients received
(streams with include_usage, n > 1, a cancelled stream, an error), revocation by file reload,
a malformed reload keeping the old tenants, and per-tenant metrics without keys.
One module-scoped cluster; two-replica enforcement is tested on two limiters sharing one store
(test_tenant_limiter.py), where it is fast and exact."""

from __future__ import annotations

import concurrent.futures
import os
import time

import grpc
import httpx
import openai
import pytest
import yaml

from splitserve.proto import load_stubs
from tests.helpers.batch_api import (
    completion_line,
    http_server_with_batches,
    jsonl,
    read_lines,
    wait_for_status,
)
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline, wait_until

pb2, _ = load_stubs()
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
ADMIN = "sk-admin"
PROMPT = "Once upon a time"
BUDGET = 700  # three reservations of prompt + 200 fit, a fourth does not
TENANTS = [
    # rpm0/rpm1, grpc0/grpc1: a fresh tenant per attempt (a burst across a minute boundary
    # spends in both windows, so the retry needs a tenant that has spent nothing).
    *({"name": f"rpm{i}", "api_keys": [f"sk-rpm{i}"], "requests_per_minute": 3} for i in range(2)),
    {"name": "free", "api_keys": ["sk-free"]},
    {"name": "counted", "api_keys": ["sk-counted"], "requests_per_minute": 1000, "tokens_per_minute": 100_000},
    {"name": "budget", "api_keys": ["sk-budget"], "budget_tokens": BUDGET, "budget_period": "month"},
    {"name": "narrow", "api_keys": ["sk-narrow"], "models": ["some-other-model"]},
    {"name": "usage", "api_keys": ["sk-usage"], "priority": 1},
    *({"name": f"grpc{i}", "api_keys": [f"sk-grpc{i}"], "requests_per_minute": 2} for i in range(2)),
    {"name": "batch-budget", "api_keys": ["sk-batch"], "budget_tokens": 1},  # set from the prompt's length below
]
BATCH_LINES, BATCH_TOKENS, BATCH_FIT = 6, 8, 3  # lines of which BATCH_FIT fit the budget


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "filed", "api_keys": ["sk-filed"]}]}))
    return path


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop, tmp_path_factory, tenants_file):
    from splitserve.engine.io.tokenizer import Tokenizer

    # Each batch line costs its prompt + BATCH_TOKENS exactly (ignore_eos): BATCH_FIT of them,
    # and half of another, fit the budget.
    line_cost = len(Tokenizer.from_pretrained(tiny_model).encode(PROMPT)) + BATCH_TOKENS
    tenants = [
        {**t, "budget_tokens": int((BATCH_FIT + 0.5) * line_cost)} if t["name"] == "batch-budget" else t
        for t in TENANTS
    ]
    cfg = cluster_config(
        tiny_model,
        num_blocks=64,
        tenants=tenants,
        tenants_file=str(tenants_file),
        tenants_reload_s=0.2,
        tenant_sync_s=0.2,
        admin_api_key=ADMIN,
        state_dir=str(tmp_path_factory.mktemp("state")),
        batch={"poll_interval_s": 0.05, "lease_s": 1.0, "max_concurrency": 4},
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def server(loop, backend):
    with http_server_with_batches(loop, backend) as srv:
        yield srv


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def complete(server, backend, key, **kwargs):
    return client(server, key).completions.create(model=backend.model_name, prompt=PROMPT, max_tokens=4, **kwargs)


def test_unknown_key_401_and_disallowed_model_404(server, backend):
    with pytest.raises(openai.AuthenticationError) as unknown:
        complete(server, backend, "sk-nobody")
    assert unknown.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as narrow:
        complete(server, backend, "sk-narrow")
    assert narrow.value.code == "model_not_found"


def test_requests_per_minute_hold_and_other_tenant_unaffected(server, backend):
    for attempt in range(2):  # a minute boundary inside the burst resets the window: then once more
        minute = int(time.time() // 60)
        outcomes = []
        for _ in range(5):
            try:
                complete(server, backend, f"sk-rpm{attempt}")
                outcomes.append("ok")
            except openai.RateLimitError as exc:
                outcomes.append(exc)
            complete(server, backend, "sk-free")  # unaffected throughout
        if int(time.time() // 60) == minute:
            break
    assert outcomes[:3] == ["ok"] * 3 and len(outcomes) == 5
    for refused in outcomes[3:]:
        assert refused.code == "rate_limit_exceeded"
        retry_after = int(refused.response.headers["retry-after"])
        assert 1 <= retry_after <= 60
        assert refused.response.headers["x-ratelimit-remaining-requests"] == "0"


def test_headers_count_down(server, backend):
    for _ in range(2):
        minute = int(time.time() // 60)
        raw = client(server, "sk-counted").completions.with_raw_response
        heads = [raw.create(model=backend.model_name, prompt=PROMPT, max_tokens=4).headers for _ in range(3)]
        if int(time.time() // 60) == minute:
            break
    remaining = [int(h["x-ratelimit-remaining-requests"]) for h in heads]
    assert all(h["x-ratelimit-limit-requests"] == "1000" for h in heads)
    assert remaining == [remaining[0], remaining[0] - 1, remaining[0] - 2]
    assert all(h["x-ratelimit-limit-tokens"] == "100000" for h in heads)
    tokens = [int(h["x-ratelimit-remaining-tokens"]) for h in heads]
    assert tokens[0] > tokens[1] > tokens[2]  # each admission reserves prompt + max_tokens
    assert all(1 <= int(h["x-ratelimit-reset-requests"].rstrip("s")) <= 60 for h in heads)


def test_budget_stops_concurrent_long_streams_at_admission(server, backend, loop):
    budget_client = client(server, "sk-budget")
    extra = {"ignore_eos": True}

    def start_stream():
        try:
            stream = budget_client.completions.create(
                model=backend.model_name, prompt=PROMPT, max_tokens=200, stream=True, extra_body=extra
            )
        except openai.RateLimitError as exc:
            return exc
        next(iter(stream))  # streaming: the reservation is held
        return stream

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: start_stream(), range(6)))
    streams = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(streams) == 3 and len(refused) == 3  # stopped before the budget, not after
    assert all(r.code == "insufficient_quota" for r in refused)
    for stream in streams:
        stream.close()  # cancelled: settled to what was generated
    wait_for_baseline(loop, backend.cluster)
    usage = wait_until(lambda: _usage(server, "budget"), None, "budget usage not written")
    assert usage["requests"] == 3 and usage["completion_tokens"] <= 3 * 200


def _usage(server, tenant: str) -> dict | None:
    reply = httpx.get(
        f"{server.url}/admin/usage", params={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert reply.status_code == 200, reply.text
    rows = reply.json()["data"]
    return rows[0] if rows else None


def test_usage_read_back_equals_what_clients_received(server, backend, loop):
    usage_client = client(server, "sk-usage")
    model = backend.model_name
    got = {"prompt": 0, "completion": 0, "cached": 0}

    def add(u):
        got["prompt"] += u.prompt_tokens
        got["completion"] += u.completion_tokens
        got["cached"] += (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0

    add(usage_client.completions.create(model=model, prompt=PROMPT, max_tokens=5).usage)
    add(usage_client.completions.create(model=model, prompt=PROMPT, max_tokens=3, n=2).usage)
    chat = usage_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    add([c for c in chat if c.usage is not None][-1].usage)
    prompt_ids = backend.encode(PROMPT)
    # A cancelled stream: the client saw some tokens, then left.
    stream = usage_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    seen = sum(1 for _, _ in zip(range(3), stream, strict=False))
    stream.close()
    # An error after admission: a deadline too short for any work.
    with pytest.raises(openai.APIStatusError):
        usage_client.with_options(timeout=120).completions.create(
            model=model, prompt=PROMPT, max_tokens=50, extra_headers={"x-request-timeout": "0.000001"}
        )
    wait_for_baseline(loop, backend.cluster)

    def settled():
        row = _usage(server, "usage")
        return row if row and row["requests"] == 5 else None

    row = wait_until(settled, None, "usage of 5 requests not written")
    assert row["errors"] == 1
    assert row["prompt_tokens"] == got["prompt"] + 2 * len(prompt_ids)
    assert row["cached_tokens"] >= got["cached"]
    cancelled_and_error = row["completion_tokens"] - got["completion"]
    assert seen <= cancelled_and_error <= 400  # the cancelled stream: what was generated


def test_revoked_by_reload_and_malformed_file_keeps_old(server, backend, tenants_file, http):
    complete(server, backend, "sk-filed")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    tenants_file.write_text("tenants:\n  - name: filed\n    api_keys: [sk-filed]\n    requests_per_minute: -1\n")
    reply = http.post("/admin/reload", headers=admin)
    assert reply.status_code == 400 and "line 4" in reply.json()["error"]["message"]
    complete(server, backend, "sk-filed")  # the old tenants stay
    # Replaced whole, as an operator's deploy tool does: a poll never reads it half-written.
    staged = tenants_file.with_suffix(".staged")
    staged.write_text(yaml.safe_dump({"tenants": [{"name": "filed", "api_keys": ["sk-new"]}]}))
    os.replace(staged, tenants_file)

    def revoked():
        try:
            complete(server, backend, "sk-filed")
            return False
        except openai.AuthenticationError:
            return True

    wait_until(revoked, None, "the revoked key still works")  # reloaded by polling, no admin call
    complete(server, backend, "sk-new")
    assert http.post("/admin/reload").status_code == 401


def test_a_batch_runs_as_its_tenant_and_stops_at_its_budget(server, backend, loop):
    """The lines are admitted and billed as team requests would be: BATCH_FIT complete, the
    rest fail with insufficient_quota (final, not retried), the counts add up, and the usage
    is the tenant's."""
    batch_client = client(server, "sk-batch")
    lines = [
        completion_line(f"b{i}", backend.model_name, PROMPT, max_tokens=BATCH_TOKENS, ignore_eos=True)
        for i in range(BATCH_LINES)
    ]
    uploaded = batch_client.files.create(file=jsonl(lines), purpose="batch")
    batch = batch_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for_status(batch_client, batch.id)
    counts = done.request_counts
    assert (done.status, counts.total, counts.completed, counts.failed) == ("completed", 6, BATCH_FIT, 3), done
    output, errors = read_lines(batch_client, done.output_file_id), read_lines(batch_client, done.error_file_id)
    assert sorted(x["custom_id"] for x in output + errors) == sorted(x["custom_id"] for x in lines)
    for error in errors:
        assert error["response"]["status_code"] == 429
        assert error["response"]["body"]["error"]["code"] == "insufficient_quota"
    wait_for_baseline(loop, backend.cluster)

    def billed():
        row = _usage(server, "batch-budget")
        return row if row and row["requests"] == BATCH_FIT else None

    row = wait_until(billed, None, "the batch's usage was not written under its tenant")
    assert row["model"] == backend.model_name and row["completion_tokens"] == BATCH_FIT * BATCH_TOKENS


def test_metrics_per_tenant_without_keys(http):
    text = http.get("/metrics").text
    assert 'splitserve_tenant_requests_total{outcome="ok",tenant="free"}' in text
    assert 'splitserve_tenant_budget_remaining{tenant="budget"}' in text
    assert "sk-" not in text


def test_grpc_status_codes_and_ratelimit_metadata(stub, backend):
    request = pb2.GenerateRequest(text=PROMPT, max_tokens=2)

    def call(key: str):
        responses = stub.Generate(request, timeout=120, metadata=(("authorization", f"Bearer {key}"),))
        list(responses)
        return dict(responses.initial_metadata())

    for key, code in (("sk-nobody", grpc.StatusCode.UNAUTHENTICATED), ("sk-narrow", grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as refused:
            call(key)
        assert refused.value.code() == code
    for attempt in range(2):  # once more if a minute boundary fell inside the burst
        minute = int(time.time() // 60)
        heads = [call(f"sk-grpc{attempt}") for _ in range(2)]
        try:  # judged only after the minute check: a new window would admit this third call
            third = call(f"sk-grpc{attempt}")
        except grpc.RpcError as exc:
            third = exc
        if int(time.time() // 60) == minute:
            break
    assert [h["x-ratelimit-remaining-requests"] for h in heads] == ["1", "0"]
    assert isinstance(third, grpc.RpcError), third
    assert third.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert third.details().startswith("rate_limit_exceeded")
    trailing = dict(third.trailing_metadata())
    assert 1 <= int(trailing["retry-after"]) <= 60 and trailing["x-ratelimit-limit-requests"] == "2"
