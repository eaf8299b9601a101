"""Migration of one choice of an n = 2 request, with speculative decoding (n-gram) on and a
stop string spanning the kill point, on local Ray (CPU, gloo) through the production HTTP
API and the openai client. Round-robin routing puts the two choices on the two decode
replicas; the one holding a choice is killed once every stream there has KILL_AFTER output
tokens, while text is held back for the stop string. Only that choice moves; the answer
equals the undisturbed one (text, log-probabilities, offsets, finish and stop per choice, one
id, usage), the two choices seeded (seed, seed + 1) and sampled; the survivor goes on
speculating; every pool is back at baseline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray

from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.proto.messages.poll_reply import PollReply
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline, wait_until
from tests.helpers.migration_streams import hold_decode_steps, wait_for_every_stream_held

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SPECULATIVE = {"method": "ngram", "policy": "fixed", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
KILL_AFTER = 4
# The stop string is the text of these output tokens: it starts before the kill point and
# ends past it, even where one speculative step took the held stream KILL_AFTER + 4 tokens far.
STOP_TOKENS = slice(2, 14)
PROMPT = [20, 21, 22, 23, 24, 25, 26, 27] * 4  # repeats: the n-gram proposer finds drafts
REQUEST = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 40, "logprobs": 1}


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(
        tiny_model,
        num_prefill=1,
        num_decode=2,
        policy="round-robin",
        num_blocks=128,
        migration={"migrate_after_s": 0},
        speculative=SPECULATIVE,
    )
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def client(server):
    # A stream here outlives its replica's death and its migration: more than the usual 120 s.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=240)


def choices_answer(client, model: str, stop: list[str] | None) -> dict:
    """The streamed n = 2 answer: per choice its text, log-probabilities, offsets, finish and
    stop reason; the ids and usage the stream carried."""
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        stream=True,
        stream_options={"include_usage": True},
        stop=stop,
        extra_body={"ignore_eos": True},
        **REQUEST,
    )
    answer: dict = {"choices": [{"text": "", "logprobs": [], "offsets": [], "finish": None} for _ in range(2)]}
    answer |= {"ids": set(), "usage": None}
    for chunk in stream:
        answer["ids"].add(chunk.id)
        if chunk.usage is not None:
            answer["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            got = answer["choices"][choice.index]
            got["text"] += choice.text
            got["logprobs"] += choice.logprobs.token_logprobs
            got["offsets"] += choice.logprobs.text_offset
            got["finish"] = choice.finish_reason or got["finish"]
            got["stop"] = getattr(choice, "stop_reason", None) or got.get("stop")
    return answer


def spec_drafts(cluster, replica_id: str) -> int:
    """The replica's speculative drafts so far (polled: not while it holds a step)."""
    reply = ray.get(cluster.decode_pool.get(replica_id).handle.poll.remote(), timeout=30)
    return PollReply.from_bytes(reply).engine.spec_num_drafts


def test_one_choice_moves_with_speculation_and_a_stop_string_across_the_kill(loop, backend, client):
    cluster, model = backend.cluster, backend.model_name
    free = choices_answer(client, model, None)
    stops = []
    for choice in free["choices"]:
        start, end = choice["offsets"][STOP_TOKENS.start], choice["offsets"][STOP_TOKENS.stop]
        stops.append(choice["text"][start:end])
    assert all(len(stop) >= 4 for stop in stops), stops
    reference = choices_answer(client, model, stops)
    for choice in reference["choices"]:
        assert (
            choice["finish"] == "stop" and len(choice["logprobs"]) > KILL_AFTER + SPECULATIVE["num_speculative_tokens"]
        )
    moved = backend.metrics.migrations.total.labels(DECODE, "channel_closed")._value.get()
    drafts_before = {
        replica.replica_id: spec_drafts(cluster, replica.replica_id) for replica in cluster.decode_pool.live_replicas()
    }
    hold_decode_steps(cluster, KILL_AFTER)
    with ThreadPoolExecutor(1) as streaming:
        answering = streaming.submit(choices_answer, client, model, stops)
        try:
            inflight = wait_for_every_stream_held(cluster, 2)
            assert len(set(inflight)) == 2, f"round-robin put both choices on one replica: {inflight}"
            victim, survivor = inflight
            ray.kill(cluster.decode_pool.get(victim).handle)
            hold_decode_steps(cluster, 0, killed=victim)  # the other choice goes on, the moved one too
        except BaseException:
            for replica in cluster.decode_pool.live_replicas():  # the stream ends, and the test fails
                replica.handle.inject_fault.remote()
            raise
        answer = answering.result(timeout=240)
    assert len(answer["ids"]) == 1 and answer["usage"] == reference["usage"]
    for got, want in zip(answer["choices"], reference["choices"]):
        assert (got["text"], got["offsets"], got["finish"], got["stop"]) == (
            want["text"],
            want["offsets"],
            want["finish"],
            want["stop"],
        )
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
    assert backend.metrics.migrations.total.labels(DECODE, "channel_closed")._value.get() == moved + 1
    # It drafted after the kill too: for its own choice and the moved one.
    assert spec_drafts(cluster, survivor) > drafts_before[survivor]
    live = cluster.decode_pool.live_replicas
    wait_until(lambda: victim not in {r.replica_id for r in live()}, None, "the dead replica is still in its pool")
    wait_for_baseline(loop, cluster)
