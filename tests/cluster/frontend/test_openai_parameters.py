"""Every OpenAI/vLLM sampling parameter splitserve accepts, driven through the unmodified
`openai` client against a real server over a real 1P+1D cluster (local Ray, CPU, gloo: every
request is prefilled on the prefill replica, which samples the first token, and decoded on the
decode replica), and checked against the colocated engine run offline (LLMEngine).

Also: /tokenize, /detokenize, /version, HEAD, keyless admission with Retry-After, and the
metrics families (promtool when installed). At the end the block pools are back to baseline."""

from __future__ import annotations

import math
import shutil
import subprocess
from importlib.metadata import version

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
PROMPT = "Once upon a time"
OTHER_PROMPT = "The quick brown fox"
CRAFTED = [20, 21, 20, 21, 20, 21, 20, 21]  # with a +8 bias on 20, greedy repeats it (engine test)


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    # No API key, per-key cap 1, global cap 4: the per-key cap must not bite without keys.
    cfg = cluster_config(tiny_model, num_blocks=64, max_queued_requests=4, max_requests_per_key=1)
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the real cluster's server (this package's conftest `client` is a
    TestClient on a fake backend)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128))

    def run(prompt: str | list[int], **params):
        ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
        return engine.generate([ids], SamplingParams(**params))[0]

    run.engine = engine
    return run


def complete(client, backend, **kwargs):
    return client.completions.create(model=backend.model_name, **kwargs)


def chat(client, backend, **kwargs):
    messages = [{"role": "user", "content": "Say hello"}]
    return client.chat.completions.create(model=backend.model_name, messages=messages, **kwargs)


def chat_prompt_ids(backend) -> list[int]:
    return backend.render_chat([{"role": "user", "content": "Say hello"}])


# ---- n ----------------------------------------------------------------------------------------


def test_n_greedy_choices_are_identical_and_seeded_choices_reproducible(client, backend, offline):
    res = complete(client, backend, prompt=PROMPT, max_tokens=12, temperature=0, n=2, extra_body={"ignore_eos": True})
    expected = offline(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.text for c in res.choices] == [expected.text, expected.text]
    assert res.usage.prompt_tokens == len(backend.encode(PROMPT)) and res.usage.completion_tokens == 24
    # seeded: choice i is the request seeded with seed + i, as vLLM does; both reproducible
    seeded = dict(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    texts = [c.text for c in complete(client, backend, **seeded).choices]
    assert texts == [offline(PROMPT, max_tokens=12, seed=7 + i, ignore_eos=True).text for i in range(2)]
    assert texts[0] != texts[1]
    assert [c.text for c in complete(client, backend, **seeded).choices] == texts
    # chat, and streamed: two identical greedy choices, each streamed under its index
    greedy_chat = offline(chat_prompt_ids(backend), max_tokens=8, temperature=0)
    body = chat(client, backend, max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in body.choices] == [greedy_chat.text] * 2
    streamed = {0: "", 1: ""}
    for chunk in chat(client, backend, max_tokens=8, temperature=0, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: greedy_chat.text, 1: greedy_chat.text}


def test_a_list_of_prompts_gives_prompts_x_n_choices(client, backend, offline):
    res = complete(client, backend, prompt=[PROMPT, OTHER_PROMPT], max_tokens=6, temperature=0, n=2)
    first, second = (offline(p, max_tokens=6, temperature=0).text for p in (PROMPT, OTHER_PROMPT))
    assert [(c.index, c.text) for c in res.choices] == [(0, first), (1, first), (2, second), (3, second)]
    assert res.usage.prompt_tokens == len(backend.encode(PROMPT)) + len(backend.encode(OTHER_PROMPT))
    ids = [backend.encode(PROMPT), backend.encode(OTHER_PROMPT)]
    streamed: dict[int, str] = {}
    for chunk in complete(client, backend, prompt=ids, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: first, 1: second}


# ---- logprobs ---------------------------------------------------------------------------------


def assert_sorted_distribution(logprobs: list[float]) -> None:
    assert logprobs == sorted(logprobs, reverse=True)
    assert sum(math.exp(lp) for lp in logprobs) <= 1 + 1e-6


def test_completion_logprobs_with_alternatives(client, backend, offline):
    expected = offline(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=3)
    res = complete(
        client, backend, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = res.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    tokenizer = backend.tokenizer
    for token, top, offline_top in zip(lp.tokens, lp.top_logprobs, expected.top_logprobs):
        alternatives: dict[str, float] = {}  # byte-level tokens may decode alike ("\ufffd"): first wins
        for t, value in offline_top:
            alternatives.setdefault(tokenizer.decode([t], skip_special_tokens=False), value)
        assert list(top) == list(alternatives)
        assert list(top)[0] == token  # greedy: the chosen token is the most likely
        assert_sorted_distribution(list(top.values()))


def test_chat_top_logprobs(client, backend, offline):
    expected = offline(chat_prompt_ids(backend), max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=5)
    kwargs = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = chat(client, backend, **kwargs).choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(expected.logprobs, abs=1e-4)
    for entry, offline_top in zip(content, expected.top_logprobs):
        assert len(entry.top_logprobs) == 5
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in offline_top], abs=1e-4)
        assert_sorted_distribution([t.logprob for t in entry.top_logprobs])
        assert entry.top_logprobs[0].token == entry.token
    streamed = [
        c
        for chunk in chat(client, backend, stream=True, **kwargs)
        for choice in chunk.choices
        if choice.logprobs
        for c in choice.logprobs.content
    ]
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in streamed] == [
        (c.token, [t.token for t in c.top_logprobs]) for c in content
    ]


# ---- echo, penalties, logit_bias, min_tokens, stops -------------------------------------------


def test_echo(client, backend, offline):
    expected = offline(PROMPT, max_tokens=5, temperature=0)
    assert complete(client, backend, prompt=PROMPT, max_tokens=5, temperature=0, echo=True).choices[0].text == (
        PROMPT + expected.text
    )
    stream = complete(client, backend, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT + expected.text
    ids = backend.encode(OTHER_PROMPT)
    res = complete(client, backend, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert res.choices[0].text == backend.tokenizer.decode(ids) + offline(ids, max_tokens=5, temperature=0).text


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 1.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 5.0}],
    ids=["frequency", "presence", "repetition"],
)
def test_penalties_match_the_engine_and_push_away_from_repeats(client, backend, offline, penalty):
    base = dict(max_tokens=20, temperature=0, ignore_eos=True, logit_bias={20: 8.0})
    plain, penalized = offline(CRAFTED, **base), offline(CRAFTED, **base, **penalty)
    assert penalized.token_ids.count(20) < plain.token_ids.count(20)
    openai_params = {k: v for k, v in penalty.items() if k != "repetition_penalty"}
    extra = {"ignore_eos": True, **{k: v for k, v in penalty.items() if k == "repetition_penalty"}}
    res = complete(
        client,
        backend,
        prompt=CRAFTED,
        max_tokens=20,
        temperature=0,
        logit_bias={"20": 8},
        extra_body=extra,
        **openai_params,
    )
    assert res.choices[0].text == penalized.text != plain.text


def test_logit_bias_bans_a_token(client, backend, offline):
    greedy = offline(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    banned = greedy.token_ids[0]
    expected = offline(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logit_bias={banned: -100})
    assert banned not in expected.token_ids
    res = complete(
        client,
        backend,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias={str(banned): -100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].text == expected.text != greedy.text
    assert backend.tokenizer.decode([banned], skip_special_tokens=False) not in res.choices[0].logprobs.tokens


def test_min_tokens_holds_eos_off(client, backend):
    eos = backend.tokenizer.eos_token_ids[0]
    eager = complete(client, backend, prompt=PROMPT, max_tokens=16, temperature=0, logit_bias={str(eos): 100})
    assert eager.usage.completion_tokens == 1 and eager.choices[0].finish_reason == "stop"
    held = complete(
        client,
        backend,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 5},
    )
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_stop_token_ids_text_is_left_out(client, backend, offline):
    greedy = offline(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    decode = backend.tokenizer.decode
    stop_tok = next(t for i, t in enumerate(greedy.token_ids) if i >= 2 and decode([t]).strip())
    first = greedy.token_ids.index(stop_tok)
    extra = {"ignore_eos": True, "stop_token_ids": [stop_tok]}
    res = complete(client, backend, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra)
    choice = res.choices[0]
    assert choice.text == decode(greedy.token_ids[:first]) and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_tok and res.usage.completion_tokens == first + 1
    kept = complete(
        client,
        backend,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={**extra, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == decode(greedy.token_ids[: first + 1])
    stop_str = decode([stop_tok]).strip()
    cut = complete(client, backend, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop_str])
    with_stop = complete(
        client,
        backend,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stop=[stop_str],
        extra_body={"include_stop_str_in_output": True},
    )
    assert with_stop.choices[0].text == cut.choices[0].text + stop_str
    assert cut.choices[0].model_extra["stop_reason"] == stop_str


def test_unsupported_parameters_are_refused_by_name(client, backend):
    with pytest.raises(openai.BadRequestError, match="beam search"):
        complete(client, backend, prompt=PROMPT, extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="not available when stream"):
        complete(client, backend, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="min_p"):
        chat(client, backend, max_tokens=2, extra_body={"min_p": 0.2})


# ---- endpoints ----------------------------------------------------------------------------------


def test_tokenize_detokenize_version_and_head(http, backend):
    name = backend.model_name
    ids = backend.encode(PROMPT)
    body = http.post("/tokenize", json={"model": name, "prompt": PROMPT}).json()
    assert body == {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids, "token_strs": None}
    plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
    assert plain.json()["tokens"] == backend.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert plain.json()["token_strs"] == backend.tokenizer.convert_ids_to_tokens(plain.json()["tokens"])
    messages = [{"role": "user", "content": "Say hello"}]
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == chat_prompt_ids(backend)
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    detok = http.post("/detokenize", json={"model": name, "tokens": ids})
    assert detok.json() == {"prompt": backend.tokenizer.decode(ids, skip_special_tokens=False)}
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert http.get("/version").json() == {"version": version("splitserve")}
    for path in ("/health", "/version", "/v1/models", "/metrics"):
        get, head = http.get(path), http.head(path)
        assert head.status_code == get.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    assert http.head(f"/v1/models/{name}").status_code == 200
    assert http.head("/v1/completions").status_code == 405  # no GET there, so no HEAD either


# ---- admission ----------------------------------------------------------------------------------


def test_keyless_clients_are_bounded_by_the_global_queue_only(loop, http, backend):
    # max_requests_per_key = 1, max_queued_requests = 4: three keyless choices run at once
    body = {"model": backend.model_name, "prompt": PROMPT, "max_tokens": 2}
    res = http.post("/v1/completions", json={**body, "n": 3})
    assert res.status_code == 200 and len(res.json()["choices"]) == 3
    # Five choices: the fifth is refused, so the four admitted ones are cancelled wherever
    # they are (often mid-transfer on the decode replica); none of their blocks may leak.
    for _ in range(3):
        refused = http.post("/v1/completions", json={**body, "n": 5})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
    wait_until(lambda: backend.num_inflight == 0, None, "refused choices still counted in flight")
    wait_for_baseline(loop, backend.cluster)


def test_stream_disconnect_aborts_every_choice(loop, server, backend):
    body = {"model": backend.model_name, "prompt": PROMPT, "max_tokens": 300, "n": 3, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            assert next(resp.iter_lines()).startswith("data: ")
    wait_until(lambda: backend.num_inflight == 0, None, "choices still running after the client left")
    wait_for_baseline(loop, backend.cluster)


# ---- metrics ------------------------------------------------------------------------------------


def scrape(http) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
    }


def test_vllm_metric_families_with_model_name(client, backend, http):
    complete(client, backend, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    samples = scrape(http)
    model = (("model_name", backend.model_name),)
    assert samples[("splitserve_request_success_total", (("finished_reason", "length"),) + model)] >= 1
    assert (
        samples[("splitserve_prefix_cache_query_tokens_total", model)]
        >= samples[("splitserve_prefix_cache_hit_tokens_total", model)]
    )
    assert samples[("splitserve_request_queue_time_seconds_count", model)] >= 1
    assert samples[("splitserve_prompt_tokens_total", model)] > 0
    assert samples[("splitserve_generation_tokens_total", model)] > 0
    assert samples[("splitserve_request_generation_tokens_count", model)] >= 1
    assert all(dict(labels).get("model_name") == backend.model_name for _, labels in samples if labels)


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)
def test_promtool_accepts_a_live_scrape(http):
    text = http.get("/metrics").text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_pools_back_to_baseline(loop, backend):
    wait_for_baseline(loop, backend.cluster)
    assert backend.num_inflight == 0
