"""Migration on local Ray (CPU, gloo), through the production ServingBackend, the OpenAI HTTP
API (the openai client) and gRPC: one of two decode replicas is killed (ray.kill of its actor)
once every stream's client has received its N-th token, while the streams run. Every stream
completes as one answer (one id and created, no error event): greedy text equals an
undisturbed run's, seeded sampled text its seeded reference, a regex-constrained answer its
own, with the same log-probabilities and text offsets and the client's usage. Opted out, a
stream fails as before. Afterwards every pool is back to baseline (prefill pins included)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import ray

from splitserve.cluster.frontend.grpc.server import GrpcFrontend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.routing.router import DECODE
from splitserve.proto import load_stubs
from tests.helpers.cluster import LoopHttpServer, cluster_config, serving_backend, wait_for_baseline, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
pb2, pb2_grpc = load_stubs()
# Tokens every client has received when the replica dies. A decode replica holds its steps
# (until released) once every stream there has this many tokens, and a stream joining it ends
# a held step (it catches up, then the steps hold again): whatever the machine's pace, every
# stream reaches the kill point and none can finish on the victim before it dies. The
# survivors are released right after the kill.
KILL_AFTER = 5
MAX_TOKENS = 60
PROMPTS = [[(11 * i + 17 * s) % 380 + 20 for i in range(24 + s)] for s in range(7)]
HTTP_CASES = [  # (prompt index, the request's sampling fields)
    (0, {"temperature": 0}),
    (1, {"temperature": 0}),
    (2, {"temperature": 1.0, "seed": 7}),
    (3, {"temperature": 0.8, "seed": 21, "top_p": 0.9}),
    (4, {"temperature": 1.0, "seed": 3, "extra_body": {"guided_regex": "[a-z]{2,6}( [a-z]{2,6}){40,80}"}}),
]
GRPC_CASES = [(5, {"temperature": 0}), (6, {"temperature": 1.0, "seed": 9})]


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(
        tiny_model, num_prefill=1, num_decode=2, policy="kv", num_blocks=128, migration={"migrate_after_s": 0}
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def cluster(backend):
    return backend.cluster


@pytest.fixture(scope="module")
def client(loop, backend):
    with LoopHttpServer(loop, build_http_app(backend)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(loop, backend):
    frontend = GrpcFrontend(backend)
    port = loop.run(frontend.start("127.0.0.1", 0))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb2_grpc.SplitServeStub(channel)
    loop.run(frontend.stop(1.0))


class KillPoint:
    """Every stream waits after its KILL_AFTER-th token until the replica was killed."""

    def __init__(self, num_streams: int):
        self.reached = threading.Barrier(num_streams + 1)
        self.killed = threading.Event()

    def token_count(self, count: int, before: int) -> None:
        if before < KILL_AFTER <= count:
            self.reached.wait(60)
            assert self.killed.wait(60)


def http_answer(client, model: str, index: int, fields: dict, kill: KillPoint | None) -> dict:
    fields = dict(fields)
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[index],
        max_tokens=MAX_TOKENS,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **fields,
    )
    answer: dict = {"text": "", "logprobs": [], "offsets": [], "ids": set(), "created": set(), "usage": None}
    for chunk in stream:
        answer["ids"].add(chunk.id)
        answer["created"].add(chunk.created)
        if chunk.usage is not None:
            answer["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            assert choice.index == 0
            before = len(answer["logprobs"])
            answer["text"] += choice.text
            answer["logprobs"] += choice.logprobs.token_logprobs
            answer["offsets"] += choice.logprobs.text_offset
            answer["finish"] = choice.finish_reason or answer.get("finish")
            if kill is not None:
                kill.token_count(len(answer["logprobs"]), before)
    return answer


def grpc_answer(stub, index: int, fields: dict, kill: KillPoint | None) -> dict:
    request = pb2.GenerateRequest(
        token_ids=pb2.TokenIds(ids=PROMPTS[index]), max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, **fields
    )
    answer: dict = {"token_ids": [], "text": "", "logprobs": [], "ids": set()}
    for response in stub.Generate(request, timeout=120):
        before = len(answer["token_ids"])
        answer["ids"].add(response.request_id)
        answer["token_ids"] += response.token_ids
        answer["text"] += response.text
        answer["logprobs"] += response.logprobs
        if response.finished:
            answer["finish"] = response.finish_reason
            answer["usage"] = (response.usage.prompt_tokens, response.usage.completion_tokens)
        if kill is not None:
            kill.token_count(len(answer["token_ids"]), before)
    return answer


def all_answers(client, stub, model: str, kill: KillPoint | None) -> list[dict]:
    with ThreadPoolExecutor(len(HTTP_CASES) + len(GRPC_CASES)) as pool:
        futures = [pool.submit(http_answer, client, model, i, f, kill) for i, f in HTTP_CASES]
        futures += [pool.submit(grpc_answer, stub, i, f, kill) for i, f in GRPC_CASES]
        return [f.result(timeout=240) for f in futures]


def assert_same(got: dict, want: dict) -> None:
    assert len(got["ids"]) == 1 and len(got.get("created", {0})) == 1
    assert got["text"] == want["text"] and got.get("token_ids") == want.get("token_ids")
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
    assert got.get("offsets") == want.get("offsets")
    assert (got["finish"], got["usage"]) == (want["finish"], want["usage"])


def hold_decode_steps(cluster, hold_at: int, killed: str | None = None) -> None:
    """Arm every live decode replica but `killed` to hold at hold_at output tokens (0 releases)."""
    handles = [r.handle for r in cluster.decode_pool.live_replicas() if r.replica_id != killed]
    ray.get([h.inject_fault.remote(hold_at_output_tokens=hold_at) for h in handles], timeout=10)


def gap_count_and_sum(backend) -> tuple[float, float]:
    samples = {s.name: s.value for metric in backend.metrics.migrations.gaps.collect() for s in metric.samples}
    return samples["splitserve_migration_gap_seconds_count"], samples["splitserve_migration_gap_seconds_sum"]


def live_decode_ids(cluster) -> set[str]:
    return {r.replica_id for r in cluster.decode_pool.live_replicas()}


def kill_busiest_decode(cluster, kill: KillPoint) -> str:
    """Once every client has its KILL_AFTER-th token: ray.kill the decode replica streaming most."""
    kill.reached.wait(120)
    inflight = list(cluster.dispatcher.inflight.values())
    victim_id = max(set(inflight), key=inflight.count)
    ray.kill(cluster.decode_pool.get(victim_id).handle)
    hold_decode_steps(cluster, 0, killed=victim_id)  # the survivors go on (the moved streams too)
    kill.killed.set()
    return victim_id


def test_streams_survive_their_decode_replica(loop, cluster, backend, client, stub):
    references = all_answers(client, stub, backend.model_name, None)
    assert all(r["usage"] == (len(PROMPTS[i]), MAX_TOKENS) for r, (i, _) in zip(references, HTTP_CASES + GRPC_CASES))
    moved = backend.metrics.migrations.total.labels(DECODE, "channel_closed")._value.get()
    gaps_before = gap_count_and_sum(backend)
    hold_decode_steps(cluster, KILL_AFTER)
    kill = KillPoint(len(references))
    with ThreadPoolExecutor(1) as killer:
        victim = killer.submit(kill_busiest_decode, cluster, kill)
        answers = all_answers(client, stub, backend.model_name, kill)
        victim_id = victim.result(timeout=10)
    for got, want in zip(answers, references):
        assert_same(got, want)
    num_moved = backend.metrics.migrations.total.labels(DECODE, "channel_closed")._value.get() - moved
    assert num_moved >= 1, "no stream was on the killed replica"
    gaps = gap_count_and_sum(backend)  # one gap per move, each the client's real wait
    assert gaps[0] == gaps_before[0] + num_moved and gaps[1] > gaps_before[1]
    print(f"killed {victim_id} after {KILL_AFTER} tokens: {num_moved:.0f} of {len(answers)} streams moved")
    hold_decode_steps(cluster, 0, killed=victim_id)
    wait_until(lambda: victim_id not in cluster.router.replica_ids(DECODE), 10, "the dead replica is still routed")
    wait_until(lambda: victim_id not in live_decode_ids(cluster), 60, "the dead replica is still in its pool")
    wait_for_baseline(loop, cluster)


def test_a_stream_opted_out_of_migration_fails_with_its_replica(loop, cluster, backend, client):
    wait_until(lambda: cluster.live_replicas(DECODE) == 2, 120, "the decode pool was not refilled", 0.2)
    hold_decode_steps(cluster, KILL_AFTER)
    refused = backend.metrics.migrations.refusals.labels("disabled")._value.get()
    kill = KillPoint(1)
    with ThreadPoolExecutor(1) as killer:
        victim = killer.submit(kill_busiest_decode, cluster, kill)
        with pytest.raises(openai.APIError):
            http_answer(client, backend.model_name, 0, {"temperature": 0, "extra_body": {"migration": False}}, kill)
        victim_id = victim.result(timeout=10)
    assert backend.metrics.migrations.refusals.labels("disabled")._value.get() == refused + 1
    hold_decode_steps(cluster, 0, killed=victim_id)
    wait_until(lambda: cluster.live_replicas(DECODE) == 2, 120, "the decode pool was not refilled", 0.2)
    wait_for_baseline(loop, cluster)


def drain_busiest_mid_stream(loop, cluster, backend, client, stub, start_drain) -> dict:
    """Every client streams; once each has its KILL_AFTER-th token (the decode steps held),
    start_drain(victim, outcome) drains the decode replica streaming most, the other replica
    released; the victim is released once its streams were handed off (while its steps were
    still held: none could finish there). Every answer must equal its undisturbed reference,
    each move counted as a drain. Returns the outcome (victim, what start_drain put there)."""
    wait_until(lambda: cluster.live_replicas(DECODE) == 2, 120, "the decode pool was not refilled", 0.2)
    references = all_answers(client, stub, backend.model_name, None)
    drains = backend.metrics.migrations.total.labels(DECODE, "drain")
    before = drains._value.get()
    hold_decode_steps(cluster, KILL_AFTER)
    kill, outcome = KillPoint(len(references)), {}

    def drain_busiest() -> None:
        kill.reached.wait(120)
        inflight = list(cluster.dispatcher.inflight.values())
        victim = outcome["victim"] = max(set(inflight), key=inflight.count)
        handle = cluster.decode_pool.get(victim).handle
        hold_decode_steps(cluster, 0, killed=victim)  # the other replica goes on
        kill.killed.set()
        finish = start_drain(victim, outcome)
        wait_until(lambda: drains._value.get() == before + inflight.count(victim), 60, "no stream handed off")
        try:
            ray.get(handle.inject_fault.remote(), timeout=10)  # released, if not removed already
        except ray.exceptions.RayActorError:
            pass
        finish()

    with ThreadPoolExecutor(1) as background:
        draining = background.submit(drain_busiest)
        answers = all_answers(client, stub, backend.model_name, kill)
        draining.result(timeout=180)
    for got, want in zip(answers, references):
        assert_same(got, want)
    assert drains._value.get() > before
    return outcome


def test_a_drained_replica_hands_its_streams_to_the_other(loop, cluster, backend, client, stub):
    """migration.migrate_after_s 0: the busiest decode replica is drained (as a scale-down
    does) once every client has its KILL_AFTER-th token; its streams go on from the other
    replica, every answer equal to its undisturbed reference, none failed, each move counted
    as a drain, and the drained replica removed with every pool back at baseline."""
    with ThreadPoolExecutor(1) as drainer:

        def start_drain(victim: str, outcome: dict):
            drained = drainer.submit(loop.run, cluster.drain_replica(DECODE, victim, 120), 150)
            return lambda: outcome.update(drained=drained.result(timeout=150))

        outcome = drain_busiest_mid_stream(loop, cluster, backend, client, stub, start_drain)
    assert outcome["drained"] is True
    assert outcome["victim"] not in live_decode_ids(cluster)
    wait_for_baseline(loop, cluster)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_on_a_decode_worker_moves_its_streams(loop, cluster, backend, client, stub):
    """SIGTERM on the busiest decode replica's worker process (what Kubernetes sends a deleted
    pod's processes) once every client has its KILL_AFTER-th token: the controller drains it
    (migrate_after_s 0), its streams go on from the other replica, every answer equal to its
    undisturbed reference and none failed, each move counted as a drain; the replica is
    replaced (the pool is back at 2), its process has exited, and every pool is at baseline."""
    if cluster.live_replicas(DECODE) < 2:  # the drain test before this one removed one for good
        loop.run(cluster.add_replicas(DECODE, 2 - cluster.live_replicas(DECODE)), 180)

    def start_drain(victim: str, outcome: dict):
        handle = cluster.decode_pool.get(victim).handle
        outcome["pid"] = ray.get(handle.process_id.remote(), timeout=10)
        os.kill(outcome["pid"], signal.SIGTERM)
        return lambda: None

    outcome = drain_busiest_mid_stream(loop, cluster, backend, client, stub, start_drain)
    wait_until(lambda: outcome["victim"] not in live_decode_ids(cluster), 60, "the SIGTERM'd replica is still there")
    wait_until(lambda: process_gone(outcome["pid"]), 60, "the SIGTERM'd worker process did not exit")
    wait_until(lambda: cluster.live_replicas(DECODE) == 2, 120, "the SIGTERM'd replica was not replaced", 0.2)
    wait_for_baseline(loop, cluster)
