"""Migration's accounting on local Ray (CPU, gloo), through the real HTTP app with tenants, the
state store and the Batch API, driven with the openai client: a tenant's streams and a
batch's lines run on two decode replicas, one of which is killed at the kill point (every
stream there held at KILL_AFTER output tokens). Every stream and every line completes once;
the tenant's usage read back from the store is what its clients received (each token once,
the continuations' prompts not billed), and the batch's output holds each line once with
its full completion, billed once under its tenant."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from splitserve.cluster.routing.replica_pools import DECODE
from tests.helpers.batch_api import (
    completion_line,
    http_server_with_batches,
    jsonl,
    read_lines,
    wait_for_status,
)
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline, wait_for_refill, wait_until
from tests.helpers.migration_streams import hold_decode_steps, http_answer, kill_busiest, wait_for_every_stream_held

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
ADMIN = "sk-admin"
KILL_AFTER = 3
MAX_TOKENS = 24
NUM_STREAMS = 6
PROMPTS = [[(13 * i + 7 * s) % 380 + 20 for i in range(20 + s)] for s in range(NUM_STREAMS)]
TENANTS = [{"name": "team", "api_keys": ["sk-team"]}, {"name": "batcher", "api_keys": ["sk-batch"]}]


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop, tmp_path_factory):
    cfg = cluster_config(
        tiny_model,
        num_prefill=1,
        num_decode=2,
        policy="kv",
        num_blocks=128,
        migration={"migrate_after_s": 0},
        tenants=TENANTS,
        tenant_sync_s=0.2,
        admin_api_key=ADMIN,
        state_dir=str(tmp_path_factory.mktemp("state")),
        batch={"poll_interval_s": 0.05, "lease_s": 1.0, "max_concurrency": NUM_STREAMS},
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def server(loop, backend):
    with http_server_with_batches(loop, backend) as srv:
        yield srv


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=240)


def usage_of(server, tenant: str) -> dict | None:
    reply = httpx.get(
        f"{server.url}/admin/usage", params={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert reply.status_code == 200, reply.text
    rows = reply.json()["data"]
    return rows[0] if rows else None


def moves(backend) -> float:
    return backend.metrics.migrations.total.labels(DECODE, "channel_closed")._value.get()


def kill_when_held(backend, num_streams: int) -> threading.Thread:
    """In the background: once num_streams streams are held at KILL_AFTER tokens, kill the
    decode replica streaming most (the other goes on, with the moved streams)."""
    cluster = backend.cluster

    def kill() -> None:
        try:
            kill_busiest(cluster, wait_for_every_stream_held(cluster, num_streams))
        except BaseException:
            for replica in cluster.decode_pool.live_replicas():  # the streams end, and the test fails
                replica.handle.inject_fault.remote()
            raise

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def refilled(loop, backend) -> None:
    cluster = backend.cluster
    wait_for_refill(cluster, DECODE, 2)
    wait_for_baseline(loop, cluster)


def test_a_tenant_is_billed_each_token_once(loop, backend, server):
    team = client(server, "sk-team")
    before = moves(backend)
    hold_decode_steps(backend.cluster, KILL_AFTER)
    killer = kill_when_held(backend, NUM_STREAMS)
    fields = {"temperature": 0, "max_tokens": MAX_TOKENS}
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        answers = list(pool.map(lambda p: http_answer(team, backend.model_name, p, fields), PROMPTS))
    killer.join(60)
    assert moves(backend) > before, "no stream was on the killed replica"
    assert all(a["usage"] == (len(p), MAX_TOKENS) and a["finish"] == "length" for a, p in zip(answers, PROMPTS))
    row = wait_until(
        lambda: (r := usage_of(server, "team")) and r["requests"] == NUM_STREAMS and r,
        None,
        "the usage was not written",
    )
    assert (row["prompt_tokens"], row["completion_tokens"]) == (sum(map(len, PROMPTS)), NUM_STREAMS * MAX_TOKENS)
    assert row["errors"] == 0
    refilled(loop, backend)


def test_a_migrated_batch_line_completes_once(loop, backend, server):
    batcher = client(server, "sk-batch")
    lines = [
        completion_line(f"line{i}", backend.model_name, p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    before = moves(backend)
    hold_decode_steps(backend.cluster, KILL_AFTER)
    # Batch lines are admitted only into headroom the interactive traffic leaves (and the held
    # replicas leave little): the kill waits for the first held line, not for all of them.
    killer = kill_when_held(backend, 1)
    uploaded = batcher.files.create(file=jsonl(lines), purpose="batch")
    batch = batcher.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for_status(batcher, batch.id)
    killer.join(60)
    assert moves(backend) > before, "no line was on the killed replica"
    counts = done.request_counts
    assert (done.status, counts.total, counts.completed, counts.failed) == ("completed", NUM_STREAMS, NUM_STREAMS, 0)
    output = read_lines(batcher, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines)  # each once
    for line in output:
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    row = wait_until(
        lambda: (r := usage_of(server, "batcher")) and r["requests"] == NUM_STREAMS and r, None, "no batch usage"
    )
    assert (row["prompt_tokens"], row["completion_tokens"]) == (sum(map(len, PROMPTS)), NUM_STREAMS * MAX_TOKENS)
    refilled(loop, backend)
