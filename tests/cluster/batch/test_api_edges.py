"""The edges a hostile-input sweep found, on the real HTTP app with tenants, an admin key, a
tenants file and a state store (uvicorn on 127.0.0.1, httpx and the `openai` client):
two Authorization headers, two multipart parts, a path as a filename, cancelling a cancelled
batch (OpenAI returns the batch), OPTIONS and a wrong method (Allow), `tools: []`, a 10 KB
model name, the OpenAPI schema's endpoint and purpose, and the admin endpoints' inputs (each
malformed or out-of-range value a 400 naming its parameter, a malformed tenants file too)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.cluster.batch.test_batch_ownership import ADMIN, config
from tests.helpers.batch_api import TenantIngress, completion_line, jsonl, wait_for_status
from tests.helpers.http_api import MODEL_NAME, assert_error, tiny_tokenizer

pytestmark = [pytest.mark.timeout(300)]
A = {"Authorization": "Bearer sk-a"}


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text("tenants:\n  - name: filed\n    api_keys: [sk-filed]\n")
    return path


@pytest.fixture(scope="module")
def ingress(tmp_path_factory, tenants_file):
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    state_url = f"sqlite:///{tmp_path_factory.mktemp('state') / 'state.db'}"
    served = TenantIngress(config(state_url, tenants_file=str(tenants_file), tenants_reload_s=3600), tokenizer)
    yield served
    served.close()


@pytest.fixture(scope="module")
def http(ingress):
    with httpx.Client(base_url=ingress.url, timeout=60) as client:
        yield client


def test_two_authorization_headers_are_refused(http):
    headers = [("Authorization", "Bearer sk-a"), ("Authorization", "Bearer sk-c")]
    assert_error(http.get("/v1/files", headers=headers), 400)


def test_one_file_and_one_purpose_part_and_a_filename_is_a_base_name(http):
    line = jsonl([completion_line("x", MODEL_NAME, "hi", max_tokens=1)]).getvalue()
    two_files = [("file", ("a.jsonl", line)), ("file", ("b.jsonl", line))]
    assert_error(http.post("/v1/files", headers=A, files=two_files, data={"purpose": "batch"}), 400, param="file")
    two_purposes = http.post(
        "/v1/files", headers=A, files=[("file", ("a.jsonl", line))], data={"purpose": ["batch", "batch"]}
    )
    assert_error(two_purposes, 400, param="purpose")
    assert http.get("/v1/files", headers=A).json()["data"] == []  # nothing stored
    for sent, kept in (
        ("../../../../tmp/x.jsonl", "x.jsonl"),
        ("..\\..\\evil.jsonl", "evil.jsonl"),
        ("..", "upload.jsonl"),
    ):
        reply = http.post("/v1/files", headers=A, files=[("file", (sent, line))], data={"purpose": "batch"})
        assert reply.status_code == 200 and reply.json()["filename"] == kept, reply.text


def test_cancelling_a_cancelled_batch_returns_it(ingress):
    a = ingress.client("sk-a")
    ingress.backend.hang_after = 0  # every line hangs until the cancel aborts it
    try:
        lines = [completion_line(f"h{i}", MODEL_NAME, "hi", max_tokens=5) for i in range(2)]
        uploaded = a.files.create(file=jsonl(lines), purpose="batch")
        batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert a.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = wait_for_status(a, batch.id)
        assert done.status == "cancelled"
        again = a.batches.cancel(batch.id)
        assert (again.id, again.status, again.cancelled_at) == (done.id, "cancelled", done.cancelled_at)
    finally:
        ingress.backend.hang_after = None
    finished = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_for_status(a, finished.id).status == "completed"
    with pytest.raises(openai.BadRequestError):  # a finished batch cannot be cancelled
        a.batches.cancel(finished.id)


def test_options_and_wrong_methods_name_the_allowed_ones(http):
    for path, allowed in (
        ("/v1/files", {"GET", "HEAD", "OPTIONS", "POST"}),
        ("/v1/files/file-x", {"GET", "HEAD", "OPTIONS", "DELETE"}),
        ("/v1/batches", {"GET", "HEAD", "OPTIONS", "POST"}),
        ("/v1/batches/batch_x/cancel", {"OPTIONS", "POST"}),
        ("/v1/completions", {"OPTIONS", "POST"}),
    ):
        options = http.options(path, headers=A)
        assert options.status_code == 204 and set(options.headers["allow"].split(", ")) == allowed, path
        wrong = http.put(path, headers=A)
        assert_error(wrong, 405)
        assert set(wrong.headers["allow"].split(", ")) == allowed, path
    assert http.options("/v1/nothing-here", headers=A).status_code == 404


def test_empty_tools_and_a_long_model_name_are_refused_briefly(http):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": []}
    assert_error(http.post("/v1/chat/completions", headers=A, json=chat), 400, param="tools")
    name = "m" * 10_000
    error = assert_error(http.post("/v1/completions", headers=A, json={"model": name, "prompt": "hi"}), 404)
    assert len(error["message"]) < 400 and "10000 characters" in error["message"]


def test_openapi_names_the_endpoints_and_purposes_the_server_takes(http):
    schema = http.get("/openapi.json").json()
    create = schema["components"]["schemas"]["BatchCreateRequest"]["properties"]
    assert create["endpoint"]["enum"] == ["/v1/chat/completions", "/v1/completions"]
    upload = next(s for n, s in schema["components"]["schemas"].items() if n.startswith("Body_upload_file"))
    assert upload["properties"]["purpose"]["enum"] == ["batch"]


@pytest.mark.parametrize(
    "params, param",
    [
        ({"start": "99999999999999999999999"}, "start"),
        ({"end": "99999999999999999999999"}, "end"),
        ({"start": "-1"}, "start"),
        ({"start": "soon"}, "start"),
        ({"end": "1.5"}, "end"),
        ({"start": "7200", "end": "3600"}, "end"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "t" * 65}, "tenant"),
    ],
)
def test_admin_usage_inputs_are_400_naming_the_parameter(http, params, param):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert_error(http.get("/admin/usage", params=params, headers=admin), 400, param=param)
    assert http.get("/admin/usage", params=params, headers=A).status_code == 401  # who asks, first


def test_admin_reload_of_a_malformed_file_is_a_400_naming_the_line(http, tenants_file, ingress):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    original = tenants_file.read_text()
    try:
        for text, where in (("tenants: 5\n", "line 1"), ("tenants:\n  - 5\n", "line 2"), ("- [\n", "line 2")):
            tenants_file.write_text(text)
            error = assert_error(http.post("/admin/reload", headers=admin), 400)
            assert where in error["message"] and str(tenants_file) in error["message"], error
            assert ingress.backend.tenants.authenticate("sk-filed").name == "filed"  # the old tenants stay
    finally:
        tenants_file.write_text(original)
    assert http.post("/admin/reload", headers=admin).json() == {"tenants": 3}
