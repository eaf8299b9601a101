"""Speculative decoding in the colocated engine: n-gram drafts verified inside the continuous
batch give token-for-token the output of plain decoding (greedy and seeded), next to
non-speculating sequences, with prefix-cache hits and preemption; stops inside an accepted
run stream nothing past the stop; only accepted blocks are cached; the pool returns to
baseline; per-request opt-out."""

from __future__ import annotations

import pytest

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.speculative.ngram_proposer import NgramProposer
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import make_checkpoint

BOTH_SCHEDULINGS = True  # every engine test runs with async scheduling and without (conftest.py)

FIXED_NGRAM = {"method": "ngram", "policy": "fixed", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
# Mixed lengths: one block, several blocks, a repetitive one the n-gram proposer matches at once.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, list(range(3, 40)), [9] * 5, [100, 200], list(range(50, 70)) * 2]


def engine_for(model_dir, speculative=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), speculative=speculative, **kw))


def assert_baseline(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert all(c == 0 for c in engine.kv.pool.ref_counts)
    assert not engine.scheduler.has_unfinished()


class OracleProposer:
    """Drafts the reference continuation (plain decoding's output), wrong at every position p
    with p % 7 == 3, so steps accept long runs and reject at known places."""

    def __init__(self, references: list[list[int]], vocab_size: int):
        self.references = references
        self.vocab_size = vocab_size

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == tokens:
                draft = ref[len(tokens) : len(tokens) + k]
                return [(t + 1) % self.vocab_size if (len(tokens) + j) % 7 == 3 else t for j, t in enumerate(draft)]
        return []


def with_oracle(engine: LLMEngine, prompts, outputs) -> LLMEngine:
    refs = [list(p) + list(o.token_ids) for p, o in zip(prompts, outputs)]
    engine.speculator.proposer = OracleProposer(refs, engine.model_config.vocab_size)
    return engine


def test_ngram_proposer_takes_the_longest_most_recent_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    # [1, 2] occurs at 0 (then 3 4) and at 4 (then 9 5): the newest wins; k caps the draft.
    assert proposer.propose([1, 2, 3, 4, 1, 2, 9, 5, 1, 2], 3) == [9, 5, 1]
    assert proposer.propose([1, 2, 3, 4, 1, 2, 9, 5, 1, 2], 1) == [9]
    # The 3-gram [5, 1, 2] beats the newer 2-gram match.
    assert proposer.propose([5, 1, 2, 8, 1, 2, 9, 5, 1, 2], 2) == [8, 1]
    assert proposer.propose([1, 2, 3], 4) == []
    assert NgramProposer(min_n=2, max_n=3).propose([2, 4, 6, 2], 2) == []
    assert proposer.propose([1, 2, 3, 1, 2], 0) == []
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_bad_speculative_config_is_a_clear_error(tiny_model):
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        engine_for(tiny_model, {"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="method"):
        engine_for(tiny_model, {"method": "medusa"})
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        engine_for(tiny_model, {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(InvalidRequestError, match="speculative_decoding"):
        SamplingParams(speculative_decoding="yes")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_ngram_greedy_output_is_identical(models_root, arch):
    model_dir = make_checkpoint(models_root, "tiny", arch)
    plain = engine_for(model_dir).generate(PROMPTS, GREEDY)
    # A small token budget: verify rows compete with the prompts' chunks for it.
    engine = engine_for(model_dir, FIXED_NGRAM, max_num_batched_tokens=48)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.text for o in outs] == [o.text for o in plain]
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_proposed_tokens > stats.spec_accepted_tokens
    assert stats.spec_emitted_tokens == stats.spec_accepted_tokens + stats.spec_num_drafts
    assert_baseline(engine)


def test_oracle_drafts_with_prefix_hits_and_preemption_are_identical(tiny_model):
    shared = list(range(10, 10 + 48))  # three full blocks, cached after the first round
    prompts = [shared + [200 + i] for i in range(3)] + [list(range(5 + i, 25 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = engine_for(tiny_model).generate(prompts, params)
    roomy = with_oracle(engine_for(tiny_model, FIXED_NGRAM), prompts, plain)
    first = roomy.generate(prompts, params)
    again = roomy.generate(prompts, params)  # prefix-cache hits, then speculation from there
    assert again[0].num_cached_tokens >= 48
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [o.token_ids for o in plain]
    stats = roomy.stats()
    assert stats.spec_accepted_tokens > 0.6 * stats.spec_proposed_tokens  # long accepted runs ...
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens  # ... and rejections
    assert_baseline(roomy)
    # 10 blocks for 7 sequences of up to 5 blocks each: sequences are preempted and recomputed.
    tight = with_oracle(engine_for(tiny_model, FIXED_NGRAM, num_kv_blocks=10, block_size=16), prompts, plain)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert tight.stats().spec_accepted_tokens > 0
    assert_baseline(tight)


def test_only_accepted_blocks_are_cached_and_announced(tiny_model):
    prompts = [list(range(5, 40)), [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    plain_engine = engine_for(tiny_model)
    plain = plain_engine.generate(prompts, params)
    spec = with_oracle(engine_for(tiny_model, FIXED_NGRAM), prompts, plain)
    spec.generate(prompts, params)
    assert spec.stats().spec_accepted_tokens < spec.stats().spec_proposed_tokens  # drafts were rejected

    def stored(engine):
        return sorted(h for e in engine.take_events() if e.kind == "stored" for h in e.block_hashes)

    assert stored(spec) == stored(plain_engine)
    assert sorted(spec.snapshot()[1]) == sorted(plain_engine.snapshot()[1])
    assert_baseline(spec)


def outputs_streamed(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request(prompt_token_ids=prompt, params=params)
    chunks = []
    while engine.has_unfinished():
        chunks.extend(engine.step())
    return chunks


@pytest.mark.parametrize("stop_kind", ["stop_token", "stop_string", "max_tokens", "eos"])
def test_stops_inside_an_accepted_run_stream_nothing_past_the_stop(tiny_model, stop_kind):
    prompt = [5, 6, 7]
    base_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True)
    base = engine_for(tiny_model).generate([prompt], base_params)[0]
    stop_at = 9  # the stop lands inside a run: drafts are right except at positions p % 7 == 3
    kwargs = dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True)
    if stop_kind == "stop_token":
        kwargs["stop_token_ids"] = [base.token_ids[stop_at]]
    elif stop_kind == "stop_string":
        kwargs["stop"] = [base.text[len(base.text) // 2 :][:3]]
    elif stop_kind == "max_tokens":
        kwargs["max_tokens"] = stop_at + 1
    params = SamplingParams(**kwargs)
    plain_engine = engine_for(tiny_model)
    spec = engine_for(tiny_model, FIXED_NGRAM)
    if stop_kind == "eos":
        # The model's own output token stands in for EOS (ignore_eos off).
        eos = base.token_ids[stop_at]
        params = SamplingParams(temperature=0, max_tokens=40, logprobs=True)
        for engine in (plain_engine, spec):
            engine.scheduler.eos_token_ids = {eos}
    with_oracle(spec, [prompt], [base])
    plain_chunks = outputs_streamed(plain_engine, prompt, params)
    spec_chunks = outputs_streamed(spec, prompt, params)
    assert any(len(c.new_token_ids) > 1 for c in spec_chunks)  # runs of accepted tokens were streamed
    final, plain_final = spec_chunks[-1], plain_chunks[-1]
    assert final.finished and (final.finish_reason, final.stop_reason) == (
        plain_final.finish_reason,
        plain_final.stop_reason,
    )
    assert final.token_ids == plain_final.token_ids and final.text == plain_final.text
    assert [t for c in spec_chunks for t in c.new_token_ids] == plain_final.token_ids
    assert "".join(c.new_text for c in spec_chunks) == plain_final.text
    assert [lp for c in spec_chunks for lp in c.new_logprobs] == pytest.approx(plain_final.logprobs, abs=1e-4)
    assert_baseline(spec)


def test_seeded_sampling_is_reproducible_under_speculation(tiny_model):
    prompts = [[5, 6, 7], [9, 9, 9, 9, 9], list(range(30, 60))]
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234 + i, max_tokens=50, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = engine_for(tiny_model).generate(prompts, params)
    spec = with_oracle(engine_for(tiny_model, FIXED_NGRAM), prompts, plain)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.stats().spec_accepted_tokens > 0
    assert_baseline(spec)


def test_opt_out_and_penalties_next_to_speculating_rows(tiny_model):
    prompts = [list(range(50, 70)) * 2, [5, 6, 7], [8, 8, 8]]
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, speculative_decoding=False),
        # Penalties and min_tokens depend on the output so far: every verify row sees its own.
        SamplingParams(temperature=0, max_tokens=120, repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=50),
    ]
    plain = engine_for(tiny_model).generate(prompts, params)
    spec = with_oracle(engine_for(tiny_model, FIXED_NGRAM), prompts, plain)
    proposed = []
    original = spec.speculator.proposer.propose
    spec.speculator.proposer.propose = lambda tokens, k: proposed.append(tokens[:3]) or original(tokens, k)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert proposed and [5, 6, 7] not in proposed  # the opted-out request was never drafted for
    assert_baseline(spec)


def test_abort_mid_speculation_returns_every_block(tiny_model):
    prompts = [list(range(5, 40)), [7, 8, 9], [9] * 20]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    plain = engine_for(tiny_model).generate(prompts, params)
    spec = with_oracle(engine_for(tiny_model, FIXED_NGRAM), prompts, plain)
    ids = [spec.add_request(prompt_token_ids=p, params=params) for p in prompts]
    block_size = spec.config.block_size
    for _ in range(6):
        spec.step()
        # Slots reserved for rejected drafts went back: each holds only its tokens' blocks.
        for seq in spec.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_tokens // block_size)
    assert spec.stats().spec_num_drafts > 0
    spec.abort(ids[0])
    for _ in range(3):
        spec.step()
    spec.abort_all()
    assert_baseline(spec)


def test_constrained_requests_verify_each_draft_row_under_its_own_mask(tiny_model):
    import json

    from splitserve.bench.serving.json_schemas import MAX_INSTANCE_TOKENS, SCHEMAS
    from splitserve.proto.messages.grammar_spec import GrammarSpec

    names = list(SCHEMAS)[:3]
    prompts = [f"Give me a {name} as JSON:" for name in names] + ["plain text next to them"]
    params = [
        SamplingParams(
            structured_output=GrammarSpec.json_schema(SCHEMAS[name]),
            max_tokens=MAX_INSTANCE_TOKENS,
            **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}),
        )
        for i, name in enumerate(names)
    ] + [GREEDY]
    plain_engine = engine_for(tiny_model, num_kv_blocks=512)
    plain = plain_engine.generate(prompts, params)
    spec = engine_for(tiny_model, FIXED_NGRAM, num_kv_blocks=512)
    token_prompts = [spec.tokenizer.encode(p) for p in prompts]
    with_oracle(spec, token_prompts, plain)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for out in outs[:3]:
        assert out.finish_reason == "stop"
        json.loads(out.text)
    assert spec.stats().spec_accepted_tokens > 0
    assert_baseline(spec)


def with_step_costs(engine: LLMEngine, fixed_s: float = 0.010, per_token_s: float = 0.0005) -> LLMEngine:
    """Feed the policy a fixed, memory-bound-like step cost instead of this busy machine's
    timings, so its decisions depend only on the acceptance it measures (the cost model's own
    fitting is tested in test_speculation_policy.py)."""
    policy = engine.speculator.policy
    original = policy.record_step
    policy.record_step = lambda num_tokens, seconds, verifies=False: original(
        num_tokens, fixed_s + per_token_s * num_tokens, verifies
    )
    return engine


def test_adaptive_policy_speculates_on_good_drafts_and_turns_off_on_bad_ones(tiny_model):
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = engine_for(tiny_model).generate([prompt], params)
    good = with_oracle(with_step_costs(engine_for(tiny_model, {"method": "ngram"})), [prompt], plain)  # adaptive
    assert good.generate([prompt], params)[0].token_ids == plain[0].token_ids
    hist = good.stats().spec_k_histogram
    assert sum(hist[2:]) > 3 * (hist[0] + hist[1]), hist  # batch 1, ~6 in 7 drafts right: long drafts

    # A random model's output barely repeats: n-gram drafts fail and speculation switches off.
    prompts = [list(range(3 + 7 * i, 40 + 7 * i)) for i in range(6)]
    bad = with_step_costs(engine_for(tiny_model, {"method": "ngram", "prompt_lookup_min": 1}))
    unconditional = engine_for(tiny_model).generate(prompts, params)
    assert [o.token_ids for o in bad.generate(prompts, params)] == [o.token_ids for o in unconditional]
    stats = bad.stats()
    assert stats.spec_k_histogram[0] > 0.9 * sum(stats.spec_k_histogram), stats.spec_k_histogram
    assert stats.spec_accepted_tokens < 0.3 * max(stats.spec_proposed_tokens, 1)
    assert_baseline(bad)


def test_generate_cli_takes_serves_speculative_flags(tiny_model, capsys):
    import json

    from splitserve.cluster.cli.serve_flags import flag_for, leaf_fields
    from tests.helpers.cli import run_cli

    def run(*args):
        return run_cli(capsys, "generate", "--model", tiny_model, *args)

    help_text = run("--help").stdout
    serve_flags = [flag_for(path) for path in leaf_fields() if path.startswith("speculative.")]
    assert len(serve_flags) == 6 and all(flag in help_text for flag in serve_flags)
    prompt = ",".join(str(t) for t in PROMPTS[0])
    common = ("--prompt-token-ids", prompt, "--max-tokens", "40", "--temperature", "0", "--ignore-eos", "--json")
    spec = run(*common, "--speculative.method", "ngram", "--speculative.num-speculative-tokens", "3")
    assert spec.returncode == 0, spec.stderr
    expected = engine_for(tiny_model).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    assert json.loads(spec.stdout.strip().splitlines()[-1])["token_ids"] == expected[0].token_ids
    bad = run(*common, "--speculative.method", "ngram", "--speculative.num-speculative-tokens", "0")
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_context_end_and_top_logprobs_inside_accepted_runs(tiny_model):
    prompts = [list(range(5, 45)), [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=3)
    plain = engine_for(tiny_model, max_model_len=64).generate(prompts, params)
    assert plain[0].finish_reason == "length" and len(plain[0].token_ids) == 64 - 40  # up to the context end
    spec = with_oracle(engine_for(tiny_model, FIXED_NGRAM, max_model_len=64), prompts, plain)
    outs = spec.generate(prompts, params)
    for out, ref in zip(outs, plain):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in out.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]
    assert spec.stats().spec_accepted_tokens > 0
    assert_baseline(spec)
