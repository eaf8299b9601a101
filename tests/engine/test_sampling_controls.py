"""Penalties, logit_bias, min_tokens, top logprobs and stop tokens: the batched math against a
per-row reference, and their effect on the colocated engine (what the frontends compare with)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sample.logits_processing import LogitsProcessing, flat_keys
from splitserve.engine.sample.sampler import Sampler
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=128))


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.scheduler.has_unfinished()


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0, **kwargs)


# ---- the batched math against a per-row reference ----------------------------------------------


def reference_row(logits: list[float], seq: Sequence, eos: tuple[int, ...]) -> list[float]:
    """vLLM's semantics, one row at a time, in plain Python."""
    p = seq.params
    out = list(logits)
    if seq.num_output_tokens < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)):
            out[t] = float("-inf")
    for t, bias in p.logit_bias.items():
        out[t] += bias
    outputs = seq.output_token_ids
    seen = set(outputs) | set(seq.prompt_token_ids)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = outputs.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def random_seq(rng: random.Random, i: int, vocab: int, params: SamplingParams) -> Sequence:
    seq = Sequence(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(1, 12))], params, 16)
    for _ in range(rng.randint(0, 15)):
        seq.append_token(rng.randrange(vocab))
    return seq


def test_batched_processing_equals_a_per_row_reference():
    rng = random.Random(0)
    vocab, eos = 40, (3,)
    seqs = []
    for i in range(24):
        kind = i % 4
        params = SamplingParams(
            max_tokens=64,
            presence_penalty=rng.uniform(-2, 2) if kind in (1, 3) else 0.0,
            frequency_penalty=rng.uniform(-2, 2) if kind in (1, 3) else 0.0,
            repetition_penalty=rng.uniform(0.5, 2.0) if kind in (2, 3) else 1.0,
            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)} if kind == 3 else {},
            min_tokens=rng.randint(0, 20) if kind == 3 else 0,
            stop_token_ids=[7] if i % 5 == 0 else [],
            ignore_eos=i % 6 == 0,
        )
        seqs.append(random_seq(rng, i, vocab, params))
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(1)) * 3
    expected = torch.tensor([reference_row(row, s, eos) for row, s in zip(logits.tolist(), seqs)])
    got = LogitsProcessing(eos).apply(logits.clone(), seqs)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    untouched = [i for i, s in enumerate(seqs) if not s.params.processes_logits]
    assert untouched and torch.equal(got[untouched], logits[untouched])  # plain rows are left alone


def test_flat_keys_and_a_crafted_penalty_row():
    assert flat_keys([[1, 1, 2], [], [0]], 4).tolist() == [1, 1, 2, 8]
    seq = Sequence("r", [0], SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1), 16)
    seq.append_token(1)
    seq.append_token(1)
    got = LogitsProcessing().apply(torch.tensor([[4.0, -4.0, 4.0, -4.0]]), [seq])
    # token 0 (prompt): 4 / 2; token 1 (output x2): -4 * 2 - 0.5 * 2 - 1; tokens 2, 3 unseen
    assert got.tolist() == [[2.0, -10.0, 4.0, -4.0]]


# ---- effects on the engine --------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens(engine):
    base = engine.generate([PROMPT], greedy())[0]
    banned = base.token_ids[0]
    out = engine.generate([PROMPT], greedy(logit_bias={banned: -100}))[0]
    assert banned not in out.token_ids and out.token_ids != base.token_ids
    forced = engine.generate([PROMPT], greedy(logit_bias={str(banned): 100}, ignore_eos=True, max_tokens=5))[0]
    assert forced.token_ids == [banned] * 5
    assert_baseline(engine)


def test_min_tokens_holds_eos_off(engine):
    eos = engine.tokenizer.eos_token_ids[0]
    eager = greedy(logit_bias={eos: 100})  # EOS is certain at every step
    assert engine.generate([PROMPT], eager)[0].token_ids == [eos]
    out = engine.generate([PROMPT], greedy(logit_bias={eos: 100}, min_tokens=6))[0]
    assert len(out.token_ids) == 7 and eos not in out.token_ids[:6] and out.token_ids[6] == eos
    assert out.finish_reason == "stop"
    # min_tokens masks stop_token_ids too, and stop strings only count once they are out
    base = engine.generate([PROMPT], greedy(ignore_eos=True, max_tokens=12))[0]
    stop_tok = base.token_ids[0]
    held = engine.generate([PROMPT], greedy(ignore_eos=True, stop_token_ids=[stop_tok], min_tokens=4))[0]
    assert stop_tok not in held.token_ids[:4] and len(held.token_ids) > 4
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert_baseline(engine)


def test_penalties_push_away_from_repeats(engine):
    """Crafted: a +8 bias makes prompt token 20 the greedy choice most of the time."""
    prompt = [20, 21, 20, 21, 20, 21, 20, 21]

    def run(**kwargs) -> list[int]:
        params = greedy(ignore_eos=True, max_tokens=20, logit_bias={20: 8.0}, **kwargs)
        return engine.generate([prompt], params)[0].token_ids

    plain = run()
    assert plain.count(20) >= 8
    assert run(frequency_penalty=1.0).count(20) < plain.count(20) / 2
    assert run(presence_penalty=2.0).count(20) < plain.count(20)  # a one-off penalty: weaker
    # repetition covers the prompt: token 20 is penalized before it was ever generated
    assert run(repetition_penalty=5.0).count(20) == 0
    # a repetition penalty < 1 rewards repeats
    assert run(repetition_penalty=0.5).count(20) > plain.count(20)
    assert_baseline(engine)


def test_top_logprobs_sorted_and_consistent(engine):
    out = engine.generate([PROMPT], greedy(max_tokens=8, ignore_eos=True, top_logprobs=5))[0]
    assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs) == 8
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        values = [v for _, v in top]
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert top[0] == (token, pytest.approx(lp))  # greedy: the chosen token is the most likely
    sampled = engine.generate([PROMPT], SamplingParams(max_tokens=8, seed=3, top_logprobs=2, ignore_eos=True))[0]
    assert all(len(t) == 2 for t in sampled.top_logprobs)
    assert_baseline(engine)


def test_stop_token_text_is_left_out(engine):
    base = engine.generate([PROMPT], greedy(ignore_eos=True, max_tokens=16))[0]
    decode = engine.tokenizer.decode
    idx = next(i for i, t in enumerate(base.token_ids) if decode([t]).strip() and i >= 2)
    stop_tok = base.token_ids[idx]
    first = base.token_ids.index(stop_tok)
    out = engine.generate([PROMPT], greedy(ignore_eos=True, max_tokens=16, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.stop_reason == stop_tok
    assert out.text == decode(base.token_ids[:first])
    kept = engine.generate(
        [PROMPT], greedy(ignore_eos=True, max_tokens=16, stop_token_ids=[stop_tok], include_stop_str_in_output=True)
    )[0]
    assert kept.text == decode(base.token_ids[: first + 1])
    stop_str = decode([stop_tok]).strip()
    cut = engine.generate([PROMPT], greedy(ignore_eos=True, max_tokens=16, stop=[stop_str]))[0]
    with_stop = engine.generate(
        [PROMPT], greedy(ignore_eos=True, max_tokens=16, stop=[stop_str], include_stop_str_in_output=True)
    )[0]
    assert cut.stop_reason == stop_str and with_stop.text == cut.text + stop_str
    assert_baseline(engine)


def test_all_greedy_fast_path_skips_processing(monkeypatch):
    sampler = Sampler()
    calls = []
    monkeypatch.setattr(sampler.logits_processing, "apply", lambda logits, seqs: calls.append(1) or logits)
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=0), 16) for i in range(4)]
    out = sampler.sample(torch.randn(4, 30), seqs)
    assert calls == [] and all(lp is None and top is None for _, lp, top in out)
    seqs[2].params = SamplingParams(temperature=0, presence_penalty=1.0)
    sampler.sample(torch.randn(4, 30), seqs)
    assert calls == [1]


def test_extreme_penalties_never_unmask_a_banned_token():
    """A masked (-inf) logit stays -inf and nothing becomes NaN, whatever the penalty: 5e-324
    underflows to 0 in float32, and -inf * 0 would be a NaN that argmax picks."""
    for repetition in (5e-324, 1e-300, 1e300):
        seq = Sequence("r", [0, 1, 2], SamplingParams(repetition_penalty=repetition, frequency_penalty=2.0), 16)
        seq.append_token(1)
        logits = torch.tensor([[float("-inf"), 3.0, -2.0, 1.0]])
        got = LogitsProcessing().apply(logits, [seq])
        assert not torch.isnan(got).any() and got[0, 0] == float("-inf"), (repetition, got)
        assert Sampler().sample(got.clone(), [seq])[0][0] != 0
