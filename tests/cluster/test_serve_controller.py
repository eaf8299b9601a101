"""The controller as Serve runs it: `splitserve serve --address` into this session's Ray
cluster (so the test can see and kill actors there), 1 prefill + 1 decode.

- Killing the controller deployment's replica does not stop serving; Serve starts a new one,
  which re-adopts the pools: same actors (same ids: no model reload).
- Deleting a Serve app runs the controller's shutdown: its pool actors are gone.
- Ctrl-C on `splitserve serve`, even right after the controller was force-killed (its
  shutdown never runs), leaves no actor of the app: the CLI reaps the app's namespace.
"""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from splitserve.cluster.app import CONTROLLER_DEPLOYMENT_NAME, build_app
from splitserve.cluster.control.worker_pool import app_namespace, app_namespaces, model_namespace, named_actors
from splitserve.proto.messages.membership import MembershipView
from tests.helpers.cluster import wait_until
from tests.helpers.model import make_checkpoint
from tests.helpers.serve_process import ServeProcess, shutdown_serve

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
APP = "splitserve"  # the CLI's app name
NAMESPACE = app_namespace(APP)
POOL_FLAGS = ("--prefill.num-kv-blocks", "64", "--decode.num-kv-blocks", "64", "--max-model-len", "256")


def controller_replicas() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and f"#{CONTROLLER_DEPLOYMENT_NAME}#" in a["name"] and f"::{APP}#" in a["name"]
    ]


def pool_actor_ids(namespace: str = NAMESPACE) -> dict[str, str]:
    return {name: ray.get_actor(name, namespace=namespace)._actor_id.hex() for name in named_actors(namespace)}


def complete(http: httpx.Client, model: str, i: int) -> dict:
    res = http.post("/v1/completions", json={"model": model, "prompt": f"story {i}:", "max_tokens": 4})
    assert res.status_code == 200, res.text
    return res.json()


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model, tmp_path_factory):
    address = ray.get_runtime_context().gcs_address
    proc = ServeProcess(
        tiny_model,
        tmp_path_factory.mktemp("serve-controller") / "serve.log",
        "--address",
        address,
        "--controller.probe-interval-s",
        "0.2",
        *POOL_FLAGS,
    )
    yield proc
    proc.stop()
    shutdown_serve()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def test_serving_survives_a_killed_controller_which_is_replaced_and_readopts(server, http, tiny_model):
    before = pool_actor_ids()
    assert set(before) == {"prefill-0", "decode-0"}
    [old] = controller_replicas()
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    done = [complete(http, tiny_model, i) for i in range(5)]  # no controller, or a new one starting
    served_s = time.monotonic() - killed_at
    assert all(r["usage"]["completion_tokens"] == 4 for r in done)
    [new] = wait_until(lambda: [n for n in controller_replicas() if n != old], None, "Serve did not restart it")
    from ray import serve

    handle = serve.get_deployment_handle(CONTROLLER_DEPLOYMENT_NAME, app_name=APP)

    def adopted_view():
        try:
            data = handle.membership.remote(-1, "test-observer", None, 0.0).result(timeout_s=10)
        except Exception:  # the new replica is still starting
            return None
        view = MembershipView.from_bytes(data)
        return view if len(view.replicas) == 2 else None

    view = wait_until(adopted_view, None, "the new controller did not re-adopt the pools")
    print(
        f"controller killed: 5 requests served in {served_s:.1f} s; {new} re-adopted after {time.monotonic() - killed_at:.1f} s"
    )
    assert {r.replica_id: r.actor_id for r in view.replicas} == before  # the same actors: no reload
    assert pool_actor_ids() == before
    assert http.get("/health").json()["ok"]
    assert all(complete(http, tiny_model, i)["usage"]["completion_tokens"] == 4 for i in range(5, 8))


def test_deleting_a_serve_app_kills_its_pools(server, tiny_model):
    """The controller's shutdown (its __del__ when Serve stops it) kills the pool actors:
    a second app on the same cluster, colocated (decode only), deleted as `serve delete`
    or `serve shutdown` would."""
    from ray import serve

    args = {
        "model": tiny_model,
        "prefill": {"replicas": 0},
        "decode": {"num_kv_blocks": 64},
        "grpc_port": 0,
        "max_model_len": 256,
    }
    serve.run(build_app(args, fail_fast=True), name="second", route_prefix="/second")
    assert set(named_actors(app_namespace("second"))) == {"decode-0"}
    serve.delete("second")
    assert named_actors(app_namespace("second")) == []  # nothing reaped them but the controller
    assert set(named_actors(NAMESPACE)) == {"prefill-0", "decode-0"}  # the other app's are untouched


def test_an_app_of_two_models_serves_both_by_name_and_deleting_it_kills_both_pools(server, tiny_model, models_root):
    """`models:` through the real Serve app: one controller deployment with a Controller per
    model (each model's pool in its own namespace), ingress replicas with a backend per model."""
    from ray import serve

    beta_dir = str(make_checkpoint(models_root, "draft", "qwen2"))
    args = {
        "prefill": {"replicas": 0},
        "decode": {"num_kv_blocks": 64},
        "grpc_port": 0,
        "max_model_len": 256,
        "models": [
            {"model": tiny_model, "served_model_name": "alpha"},
            {"model": beta_dir, "served_model_name": "beta"},
        ],
        "aliases": {"latest": "beta"},  # registered in every ingress's catalog next to the models
    }
    serve.run(build_app(args, fail_fast=True), name="two", route_prefix="/two")
    namespaces = [model_namespace("two", "alpha"), model_namespace("two", "beta")]
    assert app_namespaces("two") == sorted(namespaces)
    assert all(named_actors(ns) == ["decode-0"] for ns in namespaces)
    with httpx.Client(base_url=server.base_url + "/two", timeout=120) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["alpha", "beta", "latest"]
        for name in ("alpha", "beta"):
            assert complete(http, name, 0)["model"] == name
        via_alias = http.post("/v1/completions", json={"model": "latest", "prompt": "hello", "max_tokens": 2})
        assert via_alias.status_code == 200 and via_alias.json()["model"] == "beta"
        assert via_alias.headers["x-splitserve-model"] == "beta"
        missing = http.post("/v1/completions", json={"model": "gamma", "prompt": "x", "max_tokens": 2})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        health = http.get("/health").json()
        assert health["ok"] and set(health["models"]) == {"alpha", "beta"}
        metrics = http.get("/metrics").text  # one merged view: both models' pool series
        assert 'model_name="alpha"' in metrics and 'model_name="beta"' in metrics
    serve.delete("two")
    assert app_namespaces("two") == []  # each model's controller killed its own pool
    assert set(named_actors(NAMESPACE)) == {"prefill-0", "decode-0"}  # the other app's are untouched


def test_ctrl_c_right_after_a_controller_kill_leaves_no_actor_of_the_app(server):
    [controller] = controller_replicas()
    ray.kill(ray.get_actor(controller, namespace="serve"), no_restart=True)  # its shutdown never runs
    assert named_actors(NAMESPACE)
    assert server.stop() == 0, server.log_path.read_text()[-3000:]
    assert named_actors(NAMESPACE) == []
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if f"::{APP}#" in a["name"]]
