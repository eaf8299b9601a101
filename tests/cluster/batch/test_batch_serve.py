"""Batch jobs as Serve runs them: `splitserve serve --address` into this session's Ray cluster,
two ingress replicas, 1 prefill + 1 decode, state in a SQLite store under --state-dir, tenants
on: every job is the tenant `batcher`'s and its lines run as that tenant.

- Killing the ingress replica that holds the runner lease mid-batch: the other one takes the
  lease, resumes the job, and every custom_id appears exactly once.
- Killing the controller mid-batch does not touch the job.
- SIGKILL to `splitserve serve` mid-batch (nothing released: the runner lease must expire),
  Serve taken down, and a new `splitserve serve` on the same state directory: the job resumes
  and completes, each custom_id once, as the tenant (its usage is the tenant's).

Every decode step is slowed (a fault injected into decode, 40 ms a step) so each job is
certainly still running when the kill comes: that bounds a job's duration from below, never
from above.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray
import yaml

from splitserve.cluster.app import CONTROLLER_DEPLOYMENT_NAME, DEPLOYMENT_NAME
from splitserve.cluster.control.worker_pool import app_namespace
from splitserve.cluster.state.database import open_state_engine, state_database_url
from splitserve.cluster.state.sql_batch_store import SqlBatchStore
from tests.helpers.batch_api import completion_line, jsonl, read_lines, wait_for_status
from tests.helpers.cluster import wait_until
from tests.helpers.serve_process import ServeProcess, shutdown_serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # its helpers start `splitserve serve`
APP = "splitserve"
NAMESPACE = app_namespace(APP)
LINES, TOKENS = 16, 48
STEP_HANG_S = 0.04
TENANT_KEY, ADMIN = "sk-batcher", "sk-admin"


def serve(tiny_model, workdir, state_dir) -> ServeProcess:
    config = workdir / "tenants.yaml"
    config.write_text(
        yaml.safe_dump({"tenants": [{"name": "batcher", "api_keys": [TENANT_KEY]}], "admin_api_key": ADMIN})
    )
    return ServeProcess(
        tiny_model,
        workdir / "serve.log",
        "--address",
        ray.get_runtime_context().gcs_address,
        "--ingress-replicas",
        "2",
        "--prefill.num-kv-blocks",
        "64",
        "--decode.num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--state-dir",
        str(state_dir),
        "--config",
        str(config),
        "--batch.lease-s",
        "2",
        "--batch.poll-interval-s",
        "0.1",
        "--batch.max-concurrency",
        "4",
    )


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batch-state")


@pytest.fixture(scope="module")
def store(state_dir):
    engine = open_state_engine(state_database_url(state_dir))
    yield SqlBatchStore(engine)
    engine.dispose()


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model, tmp_path_factory, state_dir):
    holder = {"proc": serve(tiny_model, tmp_path_factory.mktemp("serve-batch"), state_dir)}
    yield holder
    holder["proc"].stop()
    from ray import serve as ray_serve

    ray_serve.shutdown()


def client_of(proc: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key=TENANT_KEY, max_retries=2, timeout=120)


def slow_decode(hang_s: float) -> None:
    decode = ray.get_actor("decode-0", namespace=NAMESPACE)
    ray.get(decode.inject_fault.remote(hang_s=hang_s, hang_steps=10**6 if hang_s else 0), timeout=30)


def start_job(client, model: str, tag: str):
    lines = [
        completion_line(f"{tag}-{i}", model, f"{tag} row {i}:", max_tokens=TOKENS, ignore_eos=True)
        for i in range(LINES)
    ]
    uploaded = client.files.create(file=jsonl(lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    return batch, lines


def wait_mid_job(store, batch_id: str) -> None:
    """Until some lines are done and some are not (the slowed steps keep it there for seconds)."""
    record = wait_until(
        lambda: (b := store.get_batch(batch_id)) and b.completed >= 1 and b,
        None,
        "no line of the job finished",
    )
    assert record.completed < record.total, "the job finished before the kill: the slowdown did not hold"


def assert_each_custom_id_once(client, batch_id: str, lines) -> None:
    done = wait_for_status(client, batch_id, timeout_s=600)
    assert done.status == "completed", done
    output = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in output] == [x["custom_id"] for x in lines]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == TOKENS for x in output)
    assert read_lines(client, done.error_file_id) == []


def lease_holder(store) -> str:
    from sqlalchemy import select

    from splitserve.cluster.state.schema import leases

    with store.engine.connect() as conn:
        return conn.execute(select(leases.c.holder).where(leases.c.name == "batch-runner")).scalar() or ""


def test_killing_the_ingress_that_runs_the_job_moves_it_to_the_other(server, store):
    client = client_of(server["proc"])
    model = client.models.list().data[0].id
    slow_decode(STEP_HANG_S)
    try:
        batch, lines = start_job(client, model, "ingress")
        wait_mid_job(store, batch.id)
        victim = lease_holder(store)
        replica = ray.get_actor(f"SERVE_REPLICA::{APP}#{DEPLOYMENT_NAME}#{victim}", namespace="serve")
        ray.kill(replica, no_restart=True)
        wait_until(lambda: lease_holder(store) not in ("", victim), None, "no other ingress took the runner lease")
    finally:
        slow_decode(0.0)
    assert_each_custom_id_once(client, batch.id, lines)


def test_killing_the_controller_mid_job_does_not_touch_it(server, store):
    client = client_of(server["proc"])
    model = client.models.list().data[0].id
    slow_decode(STEP_HANG_S)
    try:
        batch, lines = start_job(client, model, "controller")
        wait_mid_job(store, batch.id)
        [controller] = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and f"#{CONTROLLER_DEPLOYMENT_NAME}#" in a["name"] and f"::{APP}#" in a["name"]
        ]
        ray.kill(ray.get_actor(controller, namespace="serve"), no_restart=True)
    finally:
        slow_decode(0.0)
    assert_each_custom_id_once(client, batch.id, lines)


def test_a_restart_on_the_same_state_dir_resumes_the_job(server, store, tiny_model, tmp_path_factory, state_dir):
    client = client_of(server["proc"])
    model = client.models.list().data[0].id
    slow_decode(STEP_HANG_S)
    batch, lines = start_job(client, model, "restart")
    wait_mid_job(store, batch.id)
    server["proc"].kill()  # SIGKILL: no lease released, no usage flushed, nothing cleaned up
    shutdown_serve()  # the app and its pools go too, so the next `serve` starts its own
    stopped = store.get_batch(batch.id)
    assert stopped.status == "in_progress" and stopped.completed < stopped.total
    assert stopped.owner == "batcher"
    started = time.monotonic()
    server["proc"] = serve(tiny_model, tmp_path_factory.mktemp("serve-batch-again"), state_dir)
    client = client_of(server["proc"])
    assert_each_custom_id_once(client, batch.id, lines)
    usage = httpx.get(
        f"{server['proc'].base_url}/admin/usage",
        params={"tenant": "batcher"},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    ).json()["data"]
    # At least the lines run after the restart are billed to the tenant (what the killed
    # process had not yet written is lost with it, as a crash loses any unflushed meter).
    assert usage and usage[0]["requests"] >= stopped.total - stopped.completed
    print(
        f"resumed after restart: {stopped.completed}/{stopped.total} done before, finished {time.monotonic() - started:.0f} s after"
    )
