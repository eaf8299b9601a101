"""Two ingress replicas as Serve runs them: `splitserve serve --address` into this session's
Ray cluster, `--ingress-replicas 2`, 2 prefill + 1 decode, HTTP through Ray's HAProxy.

- Both ingresses follow the same KV event streams, so a prefix group lands on one prefill
  replica whichever ingress carried each request (cached tokens; the replicas' own block
  hashes), and greedy output equals `splitserve generate`.
- Killing one ingress replica loses only the streams it carried: the streams on the other one
  finish whole, the pool actors keep their ids (no reload), and the service answers again
  within 15 s while Serve brings a new ingress replica up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.app import DEPLOYMENT_NAME
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import app_namespace, named_actors
from splitserve.engine.core.block_hash import hash_blocks
from tests.helpers.cluster import wait_until
from tests.helpers.serve_process import ServeProcess, shutdown_serve

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
APP = "splitserve"  # the CLI's app name
RECOVERY_WAIT_S = 120.0  # a safety net for HAProxy noticing the dead ingress, never the thing asserted
NAMESPACE = app_namespace(APP)
INGRESS_HEADER = "x-splitserve-ingress"
MAX_MODEL_LEN = 256
STREAM_TOKENS = 200


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model, tmp_path_factory):
    proc = ServeProcess(
        tiny_model,
        tmp_path_factory.mktemp("serve-ingresses") / "serve.log",
        "--address",
        ray.get_runtime_context().gcs_address,
        "--ingress-replicas",
        "2",
        "--prefill-replicas",
        "2",
        "--decode-replicas",
        "1",
        "--router",
        "kv",
        "--prefill.num-kv-blocks",
        "128",
        "--decode.num-kv-blocks",
        "128",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    )
    try:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            # Answering is not enough: an ingress routes by the membership it has applied, so
            # wait until both see every pool replica.
            wait_until(lambda: len(ingresses_seeing_all(http, 8)) == 2, None, "an ingress never saw every replica")
    except BaseException:
        proc.stop()
        raise
    yield proc
    proc.stop()
    shutdown_serve()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def ingresses_seen(http: httpx.Client, num_requests: int) -> set[str]:
    seen = set()
    for _ in range(num_requests):
        res = http.get("/v1/models")
        if res.status_code == 200:
            seen.add(res.headers[INGRESS_HEADER])
    return seen


def ingresses_seeing_all(http: httpx.Client, num_requests: int) -> set[str]:
    seen = set()
    for _ in range(num_requests):
        res = http.get("/health")
        if res.status_code == 200 and (res.json()["prefill_replicas"], res.json()["decode_replicas"]) == (2, 1):
            seen.add(res.headers[INGRESS_HEADER])
    return seen


def indexed_prefill_blocks(http: httpx.Client) -> dict[str, float]:
    """splitserve_router_indexed_blocks{pool="prefill"} by ingress, from the merged /metrics."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "splitserve_router_indexed_blocks" and sample.labels["pool"] == "prefill":
                out[sample.labels["ingress"]] = sample.value
    return out


def prefill_snapshots() -> dict[str, set]:
    return {
        name: set(ray.get(ray.get_actor(name, namespace=NAMESPACE).snapshot.remote(), timeout=30)[1])
        for name in named_actors(NAMESPACE)
        if name.startswith("prefill-")
    }


def pool_actor_ids() -> dict[str, str]:
    return {name: ray.get_actor(name, namespace=NAMESPACE)._actor_id.hex() for name in named_actors(NAMESPACE)}


def test_two_ingresses_send_a_prefix_group_to_one_prefill_replica(http, model, tiny_model):
    block_size = ServeConfig().block_size
    groups = [f"Group {g}: " + " ".join(f"w{g}x{i}" for i in range(40)) for g in range(3)]
    prompts = [(g, f"{groups[g]} question {k}?") for k in range(4) for g in range(3)]
    by_ingress: dict[str, int] = {}
    texts = {}
    for i, (g, prompt) in enumerate(prompts):
        if i == len(groups):
            # The ingresses learn of the first prompts' blocks from the replicas' KV event
            # streams, each on its own poll: wait until both index every block the prefill
            # replicas hold (their own gauge says so) before asking for those prefixes.
            def converged() -> bool:
                held = len(set().union(*prefill_snapshots().values()))
                indexed = indexed_prefill_blocks(http)
                return len(indexed) == 2 and all(n == held for n in indexed.values())

            wait_until(converged, None, "the ingresses' indexes never matched the replicas' blocks", 0.5)
        res = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert res.status_code == 200, res.text
        body = res.json()
        ingress = res.headers[INGRESS_HEADER]
        by_ingress[ingress] = by_ingress.get(ingress, 0) + 1
        texts[prompt] = body["choices"][0]["text"]
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if prompt != f"{groups[g]} question 0?":  # the group's prefix was computed before
            prefix_ids = http.post("/tokenize", json={"model": model, "prompt": groups[g]}).json()["tokens"]
            assert cached >= (len(prefix_ids) // block_size - 1) * block_size, (prompt, ingress, body["usage"])
    assert len(by_ingress) == 2, f"one ingress carried every request: {by_ingress}"

    # Each group's prefix blocks live on exactly one prefill replica: both ingresses routed
    # the group to the same one, from the same KV events.
    snapshots = prefill_snapshots()
    assert len(snapshots) == 2
    for group in groups:
        ids = http.post("/tokenize", json={"model": model, "prompt": group}).json()["tokens"]
        first_block = hash_blocks(ids, block_size)[:1]
        holders = [name for name, hashes in snapshots.items() if set(first_block) <= hashes]
        assert len(holders) == 1, (group[:10], holders)

    # Greedy output equals `splitserve generate` on the same checkpoint.
    sample = [prompt for _, prompt in prompts[:3]]
    cmd = [sys.executable, "-m", "splitserve.cluster.cli", "generate", "--model", tiny_model, "--max-tokens", "8"]
    cmd += ["--temperature", "0", "--json", "--num-kv-blocks", "128"]
    for prompt in sample:
        cmd += ["--prompt", prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    generated = [json.loads(line)["text"] for line in out.splitlines() if line.startswith("{")]
    assert generated == [texts[p] for p in sample]


class Stream:
    """One streamed completion read on a thread: which ingress carried it, and how it ended."""

    def __init__(self, base_url: str, model: str, i: int):
        self.client = httpx.Client(base_url=base_url, timeout=120)
        body = {
            "model": model,
            "prompt": f"stream {i}",
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
            "logprobs": 0,  # a token list per chunk: counts the tokens (a chunk may carry several)
        }
        self.response = self.client.send(self.client.build_request("POST", "/v1/completions", json=body), stream=True)
        assert self.response.status_code == 200
        self.ingress = self.response.headers[INGRESS_HEADER]
        self.lines = self.response.iter_lines()
        self.num_tokens = 0
        self.finish_reason = None
        self.done = False
        self.error: BaseException | None = None
        self.last_chunk_at = 0.0
        self._read_until_first_chunk()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read_until_first_chunk(self) -> None:
        for line in self.lines:
            if self._take(line):
                return

    def _take(self, line: str) -> bool:
        if not line.startswith("data: "):
            return False
        if line == "data: [DONE]":
            self.done = True
            return True
        choice = json.loads(line[6:])["choices"][0]
        self.num_tokens += len(choice["logprobs"]["tokens"])
        self.last_chunk_at = time.monotonic()
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True

    def _read(self) -> None:
        try:
            for line in self.lines:
                self._take(line)
        except BaseException as exc:  # the killed ingress's streams end here
            self.error = exc
        finally:
            self.client.close()


def test_killing_an_ingress_replica_loses_only_its_streams(server, http, model):
    before = pool_actor_ids()
    decode = ray.get_actor("decode-0", namespace=NAMESPACE)
    # Slow every decode step (20 ms) so the streams are still running when the ingress dies.
    ray.get(decode.inject_fault.remote(hang_s=0.02, hang_steps=100_000), timeout=30)
    streams: list[Stream] = []
    try:
        while len({s.ingress for s in streams}) < 2 or len(streams) < 6:
            assert len(streams) < 16, "HAProxy sent every stream to one ingress"
            streams.append(Stream(server.base_url, model, len(streams)))
        victim = streams[0].ingress
        survivors = [s for s in streams if s.ingress != victim]
        replica = ray.get_actor(f"SERVE_REPLICA::{APP}#{DEPLOYMENT_NAME}#{victim}", namespace="serve")
        killed_at = time.monotonic()
        ray.kill(replica, no_restart=True)

        # The service answers again: five requests in a row succeed (the deadline is a safety net).
        in_a_row = 0
        while in_a_row < 5:
            assert time.monotonic() - killed_at < RECOVERY_WAIT_S, "the service did not answer again"
            try:
                ok = http.get("/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            in_a_row = in_a_row + 1 if ok else 0
            time.sleep(0.1)
    finally:
        ray.get(decode.inject_fault.remote(), timeout=30)
    for stream in streams:
        stream.thread.join(timeout=120)
    for stream in survivors:  # the other ingress's streams finish whole
        assert stream.error is None and stream.done, stream.error
        assert stream.finish_reason == "length" and stream.num_tokens == STREAM_TOKENS
    assert max(s.last_chunk_at for s in survivors) > killed_at, "the streams ended before the kill"
    assert pool_actor_ids() == before  # same actors: no model reload

    # Serve replaces the killed replica; both ingresses answer again.
    def two_ingresses():
        seen = ingresses_seen(http, 8)
        return len(seen) == 2 and victim not in seen

    wait_until(two_ingresses, None, "no second ingress replica after the kill")
    res = http.post("/v1/completions", json={"model": model, "prompt": "after", "max_tokens": 4})
    assert res.status_code == 200, res.text
