"""GenerateRequest's penalties, logit_bias, min_tokens and top_logprobs on a real 1P+1D
cluster (local Ray, CPU, gloo; the prefill replica samples the first token, the decode replica
the rest), through a real grpc client, checked against the same requests over the HTTP API on
the same backend. Refused values are INVALID_ARGUMENT and leave the block pools at baseline."""

from __future__ import annotations

import math

import grpc
import pytest

from splitserve.proto import load_stubs
from splitserve.proto.messages.sampling_params import MAX_TOP_LOGPROBS
from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
pb2, _ = load_stubs()
PROMPT = "Once upon a time"
CRAFTED = [20, 21, 20, 21, 20, 21, 20, 21]  # with a +8 bias on 20, greedy repeats it (engine test)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    with serving_backend(loop, cluster_config(tiny_model, num_blocks=64), tiny_model) as serving:
        yield serving


def generate(stub, prompt: list[int], **fields) -> tuple[list[int], str, list]:
    """(token ids, text, the responses) of one Generate call."""
    request = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=prompt), **fields)
    responses = list(stub.Generate(request, timeout=TIMEOUT_S))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses


def complete(http, backend, prompt: list[int], **body) -> dict:
    res = http.post("/v1/completions", json={"model": backend.model_name, "prompt": prompt, **body})
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 1.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 5.0}],
    ids=["frequency", "presence", "repetition"],
)
def test_penalties_give_the_http_tokens_and_push_away_from_repeats(stub, http, backend, penalty):
    base = dict(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _, _ = generate(stub, CRAFTED, **base, logit_bias={20: 8.0})
    penalized, text, responses = generate(stub, CRAFTED, **base, logit_bias={20: 8.0}, **penalty)
    assert penalized.count(20) < plain.count(20)
    assert responses[-1].usage.completion_tokens == 20
    over_http = complete(http, backend, CRAFTED, **base, logit_bias={"20": 8}, **penalty)
    assert over_http["text"] == text == backend.tokenizer.decode(penalized)


def test_logit_bias_forces_and_bans_tokens_as_over_http(stub, http, backend):
    prompt = backend.encode(PROMPT)
    base = dict(max_tokens=6, temperature=0, ignore_eos=True)
    greedy, _, _ = generate(stub, prompt, **base)
    target = next(t for t in range(100, 200) if t not in greedy)
    forced, text, _ = generate(stub, prompt, **base, logit_bias={target: 100.0})
    assert forced == [target] * 6
    assert complete(http, backend, prompt, **base, logit_bias={str(target): 100})["text"] == text
    banned = greedy[0]
    without, text, _ = generate(stub, prompt, **base, logit_bias={banned: -100.0})
    assert banned not in without and without != greedy
    assert complete(http, backend, prompt, **base, logit_bias={str(banned): -100})["text"] == text


def test_min_tokens_holds_eos_off(stub, backend):
    prompt = backend.encode(PROMPT)
    eos = backend.tokenizer.eos_token_ids[0]
    eager = dict(max_tokens=16, temperature=0, logit_bias={eos: 100.0})
    _, _, responses = generate(stub, prompt, **eager)
    assert responses[-1].usage.completion_tokens == 1 and responses[-1].finish_reason == "stop"
    tokens, _, responses = generate(stub, prompt, **eager, min_tokens=5)
    assert responses[-1].usage.completion_tokens == 6 and responses[-1].finish_reason == "stop"
    assert eos not in tokens[:5]


def test_top_logprobs_most_likely_first_and_as_over_http(stub, http, backend):
    prompt = backend.encode(PROMPT)
    base = dict(max_tokens=6, temperature=0, ignore_eos=True)
    tokens, _, responses = generate(stub, prompt, **base, logprobs=True, top_logprobs=5)
    logprobs = [lp for r in responses for lp in r.logprobs]
    tops = [top for r in responses for top in r.top_logprobs]
    assert len(tokens) == len(logprobs) == len(tops) == 6
    for token, logprob, top in zip(tokens, logprobs, tops):
        assert len(top.token_ids) == len(top.logprobs) == 5
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert sum(math.exp(lp) for lp in top.logprobs) <= 1 + 1e-6
        # Greedy without bias or penalties: the chosen token is the most likely one.
        assert top.token_ids[0] == token and top.logprobs[0] == pytest.approx(logprob, abs=1e-6)
    over_http = complete(http, backend, prompt, **base, logprobs=5)["logprobs"]
    assert over_http["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    decode = backend.tokenizer.decode
    for top, http_top in zip(tops, over_http["top_logprobs"]):
        alternatives: dict[str, float] = {}  # byte-level tokens may decode alike: the first wins, as over HTTP
        for token, logprob in zip(top.token_ids, top.logprobs):
            alternatives.setdefault(decode([token], skip_special_tokens=False), logprob)
        assert list(http_top) == list(alternatives)
        assert list(http_top.values()) == pytest.approx(list(alternatives.values()), abs=1e-4)


# Each case: vocab_size -> the request's bad fields, and what the error must say.
BAD_VALUES = {
    "min_tokens": (lambda v: {"min_tokens": 5, "max_tokens": 4}, "min_tokens must be an integer in [0, max_tokens=4]"),
    "presence_penalty": (lambda v: {"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    "frequency_penalty": (lambda v: {"frequency_penalty": -2.5}, "frequency_penalty must be a number in [-2, 2]"),
    "repetition_penalty": (lambda v: {"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    "logit_bias": (lambda v: {"logit_bias": {v: 1.0}}, "logit_bias token id {v} is outside the vocabulary [0, {v})"),
    "top_logprobs": (
        lambda v: {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1},
        f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_are_invalid_argument_and_allocate_nothing(loop, stub, backend, case):
    vocab_size = backend.model_config.vocab_size
    make_fields, details = BAD_VALUES[case]
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, backend.encode(PROMPT), **make_fields(vocab_size))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details.replace("{v}", str(vocab_size)) in err.value.details(), err.value.details()
    assert backend.num_inflight == 0
    wait_for_baseline(loop, backend.cluster)
    assert len(generate(stub, backend.encode(PROMPT), max_tokens=2, ignore_eos=True)[0]) == 2  # still serving
    wait_for_baseline(loop, backend.cluster)
