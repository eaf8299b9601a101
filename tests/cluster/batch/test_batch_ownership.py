"""Every Batch API object is its tenant's: with team-a's key, each of team-c's files (input,
output, error) and batches is a 404 on every route -- list, retrieve, content, delete,
cancel, and create from the file -- on SQLite and on Postgres, and again after a restart on
the same state. team-c's objects are untouched by all of it, its lines ran as team-c (billed
to it, with no key), and the admin key sees every owner's objects but runs nothing. Real HTTP
app, tenant gate, runner and store over uvicorn, driven with the `openai` client; generation is
the scripted FakeBackend (ownership lives in the routes and the store, not the engines)."""

from __future__ import annotations

import openai
import pytest

from splitserve.cluster.config import ServeConfig
from tests.helpers.batch_api import TenantIngress, completion_line, jsonl, read_lines, wait_for_status
from tests.helpers.http_api import MODEL_NAME, tiny_tokenizer

pytestmark = [pytest.mark.timeout(300)]
ADMIN = "sk-admin"
TENANTS = [{"name": "team-a", "api_keys": ["sk-a"]}, {"name": "team-c", "api_keys": ["sk-c"]}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def config(state_url: str, **extra) -> ServeConfig:
    batch = {"poll_interval_s": 0.05, "lease_s": 1.0, "max_concurrency": 4}
    return ServeConfig.model_validate(
        {"tenants": TENANTS, "admin_api_key": ADMIN, "state_url": state_url, "batch": batch, **extra}
    )


def team_c_objects(ingress: TenantIngress) -> dict:
    """team-c's finished batch (with output and error files) and a second batch, left to run."""
    c = ingress.client("sk-c")
    lines = [completion_line(f"c{i}", MODEL_NAME, f"row {i}", max_tokens=3) for i in range(2)]
    lines.append(completion_line("bad", MODEL_NAME, "x", max_tokens=-3))  # -> the error file
    uploaded = c.files.create(file=jsonl(lines), purpose="batch")
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for_status(c, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 1), done
    second = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    files = {"input": uploaded.id, "output": done.output_file_id, "error": done.error_file_id}
    contents = {name: c.files.content(fid).content for name, fid in files.items()}
    return {"files": files, "batches": [done.id, second.id], "contents": contents}


def assert_invisible_to_team_a(ingress: TenantIngress, objects: dict) -> None:
    a = ingress.client("sk-a")
    assert not {f.id for f in a.files.list().data} & set(objects["files"].values())
    assert not {b.id for b in a.batches.list(limit=100).data} & set(objects["batches"])
    calls = {}
    for name, fid in objects["files"].items():
        calls[f"files.retrieve({name})"] = lambda fid=fid: a.files.retrieve(fid)
        calls[f"files.content({name})"] = lambda fid=fid: a.files.content(fid)
        calls[f"files.delete({name})"] = lambda fid=fid: a.files.delete(fid)
    for bid in objects["batches"]:
        calls[f"batches.retrieve({bid})"] = lambda bid=bid: a.batches.retrieve(bid)
        calls[f"batches.cancel({bid})"] = lambda bid=bid: a.batches.cancel(bid)
    calls["batches.create(from team-c's file)"] = lambda: a.batches.create(
        input_file_id=objects["files"]["input"], endpoint="/v1/completions", completion_window="24h"
    )
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.code in ("file_not_found", "batch_not_found"), (name, refused.value)
    assert a.batches.list(limit=100).data == []  # the refused create made nothing


def assert_team_c_untouched(ingress: TenantIngress, objects: dict) -> None:
    c = ingress.client("sk-c")
    assert set(objects["files"].values()) <= {f.id for f in c.files.list().data}
    assert set(objects["batches"]) <= {b.id for b in c.batches.list(limit=100).data}
    for name, fid in objects["files"].items():
        assert c.files.content(fid).content == objects["contents"][name]


def test_cross_tenant_matrix_every_route_404_and_after_a_restart(state_url, tokenizer):
    ingress = TenantIngress(config(state_url), tokenizer)
    try:
        objects = team_c_objects(ingress)
        assert_invisible_to_team_a(ingress, objects)
        assert_team_c_untouched(ingress, objects)
        # The lines ran as team-c, with no key: admitted and counted under its name.
        ok = ingress.registry.get_sample_value(
            "splitserve_tenant_requests_total", {"tenant": "team-c", "outcome": "ok"}
        )
        assert ok >= 2
        output = read_lines(ingress.client("sk-c"), objects["files"]["output"])
        assert [x["response"]["status_code"] for x in output] == [200, 200]
    finally:
        ingress.close()
    restarted = TenantIngress(config(state_url), tokenizer, holder="ingress-b")
    try:
        assert_invisible_to_team_a(restarted, objects)
        assert_team_c_untouched(restarted, objects)
        admin = restarted.client(ADMIN)  # sees every owner's objects
        assert set(objects["files"].values()) <= {f.id for f in admin.files.list().data}
        assert admin.batches.retrieve(objects["batches"][0]).status == "completed"
        with pytest.raises(openai.BadRequestError):  # but runs nothing: it is no tenant
            admin.batches.create(
                input_file_id=objects["files"]["input"], endpoint="/v1/completions", completion_window="24h"
            )
    finally:
        restarted.close()
