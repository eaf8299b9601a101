"""Completions `echo` with `logprobs` (what lm-evaluation-harness's local-completions model
sends for loglikelihood tasks) through the unmodified `openai` client, a real server and a
real 1P+1D cluster (local Ray, CPU, gloo), over the prefill replica and over decode's local
prefill: the prompt's log-probabilities equal transformers' log_softmax on the same
checkpoint (fp32) for a prompt spanning several blocks and prefill chunks, rendered as vLLM
and OpenAI do (null for the first prompt token, top alternatives most likely first,
text_offset over prompt then completion), streamed (the prompt's entries in the first chunk)
and not, and again once the prompt is cached; the block pools return to baseline."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.helpers.cluster import cluster_config, serving_backend, wait_for_baseline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
TOL = 1e-4
PROMPT = [(37 * i) % 500 + 5 for i in range(50)]  # 4 blocks of 16; 4 chunks at a 16-token budget


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    cfg = cluster_config(tiny_model, num_blocks=64)
    cfg.prefill.max_num_batched_tokens = cfg.decode.max_num_batched_tokens = 16
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the real cluster's server (this package's conftest `client` is a
    TestClient on a fake backend)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at every position of PROMPT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        return torch.log_softmax(model(ids, attention_mask=torch.ones_like(ids)).logits[0].float(), dim=-1)


def local_prefill(cluster, on: bool) -> None:
    """Route every request to decode's own prefill (on), or to the prefill pool (off)."""
    cluster.router.config = cluster.router.config.model_copy(update={"local_prefill_threshold": 10**6 if on else 0})


def echo(client, backend, **kwargs):
    return client.completions.create(model=backend.model_name, prompt=PROMPT, echo=True, temperature=0, **kwargs)


def token_string(backend, token_id: int) -> str:
    return backend.tokenizer.decode([token_id], skip_special_tokens=False)


def assert_prompt_entries(logprobs, backend, reference: torch.Tensor, k: int) -> None:
    """The first len(PROMPT) entries are the prompt's tokens and log-probabilities."""
    num = len(PROMPT)
    assert logprobs.tokens[:num] == [token_string(backend, t) for t in PROMPT]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:num], expected, strict=True)) < TOL
    num_full = 0
    for pos in range(1, num):
        top = logprobs.top_logprobs[pos]
        ref_values, ref_ids = torch.topk(reference[pos - 1], k)
        ids = ref_ids.tolist()
        names = [token_string(backend, t) for t in ids]
        token = token_string(backend, PROMPT[pos])
        assert token in top and len(top) <= k + 1  # the prompt token is always listed
        if len(set(names)) == k:  # tokens decoding alike share a key: only where they do not
            num_full += 1
            assert list(top)[:k] == names  # most likely first, then the prompt token if not among them
            assert max(abs(top[n] - v) for n, v in zip(names, ref_values.tolist())) < TOL
        if token not in names or (PROMPT[pos] in ids and names.index(token) == ids.index(PROMPT[pos])):
            assert abs(top[token] - expected[pos - 1]) < TOL
    assert num_full > (num - 1) // 2  # the order and values were checked at most positions


@pytest.mark.parametrize("path", ["remote-prefill", "local-prefill"])
def test_echo_logprobs_match_transformers(loop, client, backend, reference, path):
    local_prefill(backend.cluster, path == "local-prefill")
    try:
        first = echo(client, backend, logprobs=3, max_tokens=1)
        again = echo(client, backend, logprobs=3, max_tokens=1)  # the prompt is cached now
    finally:
        local_prefill(backend.cluster, False)
    choice = first.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == len(PROMPT) + 1
    assert_prompt_entries(logprobs, backend, reference, 3)
    assert choice.text.startswith(backend.tokenizer.decode(PROMPT))
    assert logprobs.token_logprobs[-1] is not None and len(logprobs.top_logprobs[-1]) >= 3
    # Each token starts where the text of the ones before it ends: prompt, then completion.
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert first.usage.prompt_tokens == len(PROMPT) and first.usage.completion_tokens == 1
    cached = again.choices[0].logprobs
    assert cached.tokens == logprobs.tokens and cached.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(cached.token_logprobs[1:], logprobs.token_logprobs[1:])) < 1e-5
    wait_for_baseline(loop, backend.cluster)


def test_streamed_echo_logprobs_come_with_the_first_chunk(loop, client, backend, reference):
    kwargs = {"logprobs": 2, "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    chunks = [c.choices[0] for c in echo(client, backend, stream=True, **kwargs) if c.choices]
    whole = echo(client, backend, **kwargs).choices[0]
    head = chunks[0]
    assert head.text.startswith(backend.tokenizer.decode(PROMPT))
    assert len(head.logprobs.tokens) > len(PROMPT)  # the prompt's entries, then the first token's
    assert_prompt_entries(head.logprobs, backend, reference, 2)
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset
    values = [v for lp in streamed for v in lp.token_logprobs]
    assert len(values) == len(PROMPT) + 4 and values[0] is None
    assert max(abs(a - b) for a, b in zip(values[1:], whole.logprobs.token_logprobs[1:])) < 1e-5
    assert "".join(c.text for c in chunks) == whole.text
    wait_for_baseline(loop, backend.cluster)


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(loop, client, backend, reference):
    """As vLLM's echo without generation: the prompt's text and entries only, "length"."""
    for stream in (False, True):
        response = echo(client, backend, logprobs=1, max_tokens=0, stream=stream)
        choices = [c.choices[0] for c in response if c.choices] if stream else [response.choices[0]]
        assert "".join(c.text for c in choices) == backend.tokenizer.decode(PROMPT)
        assert choices[-1].finish_reason == "length"
        logprobs = [c.logprobs for c in choices if c.logprobs is not None and c.logprobs.tokens]
        assert len(logprobs) == 1 and len(logprobs[0].tokens) == len(PROMPT)
        assert_prompt_entries(logprobs[0], backend, reference, 1)
    plain = echo(client, backend, max_tokens=0)
    assert plain.choices[0].text == backend.tokenizer.decode(PROMPT) and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=backend.model_name, prompt=PROMPT, max_tokens=0)
    wait_for_baseline(loop, backend.cluster)


def test_vllm_prompt_logprobs_field(loop, client, backend, reference):
    """vLLM's prompt_logprobs request field: the response's prompt_logprobs per position, the
    prompt token's {logprob, rank, decoded_token} first, then the alternatives ranked 1, 2, ..."""
    response = client.completions.create(
        model=backend.model_name, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    field = response.choices[0].model_extra["prompt_logprobs"]
    assert len(field) == len(PROMPT) and field[0] is None and response.choices[0].logprobs is None
    for pos in range(1, len(PROMPT)):
        entry, row = field[pos], reference[pos - 1]
        mine = entry[str(PROMPT[pos])]
        assert list(entry)[0] == str(PROMPT[pos]) and mine["decoded_token"] == token_string(backend, PROMPT[pos])
        assert abs(mine["logprob"] - row[PROMPT[pos]].item()) < TOL
        assert (
            int((row > mine["logprob"] + TOL).sum()) + 1 <= mine["rank"] <= int((row > mine["logprob"] - TOL).sum()) + 1
        )
        alternatives = [(int(t), e) for t, e in entry.items()][1:]
        ranks = [e["rank"] for _, e in alternatives]  # the top 2 but the prompt token, most likely first
        assert ranks == sorted(ranks) and set(ranks) | ({mine["rank"]} & {1, 2}) == {1, 2}
        for token, e in alternatives:
            assert abs(e["logprob"] - row[token].item()) < TOL and e["rank"] <= 2
    messages = [{"role": "user", "content": "Say hello"}]
    chat = client.chat.completions.create(
        model=backend.model_name, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    chat_ids = backend.render_chat(messages)
    field = chat.model_extra["prompt_logprobs"]
    assert len(field) == len(chat_ids) and field[0] is None
    assert all(list(entry) == [str(token)] for entry, token in zip(field[1:], chat_ids[1:]))
    wait_for_baseline(loop, backend.cluster)
