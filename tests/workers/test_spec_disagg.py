"""Speculative decoding in the disaggregated path (1 prefill + 1 decode replica, real actors,
the OpenAI SDK over HTTP): greedy output identical to the colocated engine without
speculation, streamed stops, the per-request opt-out, the metrics, and block pools back to
baseline after a client leaves mid-speculation."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import (
    cluster_config,
    pool_states,
    serving_backend,
    wait_for_baseline,
    wait_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
SPECULATIVE = {"method": "ngram", "policy": "fixed", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPTS = [
    "Once upon a time",
    "one two three four one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


@pytest.fixture(scope="module", params=["ngram", "draft"])
def method(request):
    return request.param


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop, method):
    # The draft proposer with draft = target: every draft token is accepted.
    extra = {"method": "draft", "draft_model": tiny_model} if method == "draft" else {}
    cfg = cluster_config(tiny_model, num_blocks=64, speculative={**SPECULATIVE, **extra})
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128))


def decode_stats(loop, backend):
    return next(s.engine for rid, s in pool_states(loop, backend.cluster).items() if rid.startswith("decode"))


def test_greedy_output_is_identical_to_plain_decoding(loop, client, backend, offline, method):
    for prompt in PROMPTS:
        expected = offline.generate(
            [offline.tokenize(prompt)], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        )
        got = client.completions.create(
            model=backend.model_name, prompt=prompt, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == expected[0].text
    stats = decode_stats(loop, backend)
    assert stats.spec_method == method and stats.spec_accepted_tokens > 0
    if method == "draft":
        assert stats.spec_accepted_tokens == stats.spec_proposed_tokens
    # A stop string inside the output: the stream ends at it, exactly as without speculation.
    base = offline.generate(
        [offline.tokenize(PROMPTS[1])], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    )
    stop = base[0].text[len(base[0].text) // 2 :][:3]
    expected = offline.generate(
        [offline.tokenize(PROMPTS[1])], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop])
    )[0]
    stream = client.completions.create(
        model=backend.model_name,
        prompt=PROMPTS[1],
        max_tokens=60,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_for_baseline(loop, backend.cluster)


def test_opt_out_is_never_drafted_for_and_metrics_show_speculation(loop, client, backend, server, method):
    before = decode_stats(loop, backend)
    client.completions.create(
        model=backend.model_name,
        prompt=PROMPTS[1],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True, "speculative_decoding": False},
    )
    after = decode_stats(loop, backend)
    assert after.spec_num_drafts == before.spec_num_drafts
    assert after.spec_k_histogram == before.spec_k_histogram  # not even considered
    client.completions.create(
        model=backend.model_name, prompt=PROMPTS[1], max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert decode_stats(loop, backend).spec_num_drafts > after.spec_num_drafts

    def scraped():
        with httpx.Client(base_url=server.url, timeout=30) as http:
            text = http.get("/metrics").text
        return {
            (s.name, s.labels.get("pool"), s.labels.get("method")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("splitserve_spec_decode")
        }

    # /metrics says what the decode replica counted (how many drafts a random model accepts
    # varies with the policy's timing-based choices, so the counts are compared, not guessed).
    stats = decode_stats(loop, backend)

    def series(name: str) -> float | None:
        return samples.get((f"splitserve_spec_decode_{name}", "decode", method))

    samples = wait_until(
        lambda: (
            (s := scraped()).get(("splitserve_spec_decode_num_drafts_total", "decode", method)) == stats.spec_num_drafts
            and s
        ),
        None,
        "the decode pool's spec_decode series never matched its replica's counts",
    )
    assert series("num_draft_tokens_total") == stats.spec_proposed_tokens > 0
    assert series("num_accepted_tokens_total") == stats.spec_accepted_tokens
    assert series("acceptance_rate") == pytest.approx(stats.spec_accepted_tokens / stats.spec_proposed_tokens)


def test_client_leaving_mid_speculation_frees_every_block(loop, server, backend):
    body = {"model": backend.model_name, "prompt": PROMPTS[1], "max_tokens": 300, "temperature": 0, "stream": True}
    drafts_before = decode_stats(loop, backend).spec_num_drafts
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            data = (line for line in resp.iter_lines() if line.startswith("data: "))
            # Read until the decode replica has verified drafts of this request, then leave.
            for _ in range(200):
                next(data)
                if decode_stats(loop, backend).spec_num_drafts > drafts_before:
                    break
    assert decode_stats(loop, backend).spec_num_drafts > drafts_before
    wait_until(lambda: backend.num_inflight == 0, None, "request still running after the client left")
    wait_for_baseline(loop, backend.cluster)
