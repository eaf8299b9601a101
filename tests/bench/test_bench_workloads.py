"""Tests of `splitserve bench`'s request generation: the synthetic workloads, Mooncake trace replay,
arrival offsets and load points, and prompts rendered as text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from splitserve.bench.loadgen.arrivals import (
    apply_load,
    build_load_points,
    parse_concurrencies,
    parse_rates,
    poisson_arrival_offsets,
)
from splitserve.bench.loadgen.client import PromptTextRenderer, token_id_to_word
from splitserve.bench.loadgen.records import (
    BenchRequest,
    LoadPoint,
    WorkloadError,
)
from splitserve.bench.loadgen.trace_workload import TraceWorkload, load_mooncake_trace
from splitserve.bench.loadgen.workloads import (
    MixedLengthWorkload,
    MultiTurnWorkload,
    PrefixRepetitionWorkload,
    VocabRange,
)

VOCAB = VocabRange(100, 5000)


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prefix_repetition_groups_share_exactly_the_prefix():
    workload = PrefixRepetitionWorkload(
        num_prefixes=3, prefix_len=20, suffixes_per_prefix=5, suffix_len=7, max_tokens=4, vocab=VOCAB
    )
    requests = workload.generate(seed=11)
    assert requests == workload.generate(seed=11)
    assert requests != workload.generate(seed=12)
    assert len(requests) == 15 and len({r.request_id for r in requests}) == 15
    groups: dict[str, list[BenchRequest]] = {}
    for request in requests:
        assert request.num_prompt_tokens == 27 and request.max_tokens == 4
        assert all(VOCAB.low <= t < VOCAB.high for t in request.prompt_token_ids)
        groups.setdefault(request.group_id, []).append(request)
    assert sorted(len(members) for members in groups.values()) == [5, 5, 5]
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                assert _common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) == 20
    firsts = [members[0].prompt_token_ids[0] for members in groups.values()]
    assert len(set(firsts)) == 3  # different groups diverge at the first token
    # shuffled: not grouped in generation order
    assert [r.group_id for r in requests] != sorted(r.group_id for r in requests)


def test_multi_turn_history_grows_and_chains():
    workload = MultiTurnWorkload(
        num_conversations=3, num_turns=4, first_turn_len=10, user_turn_len=5, max_tokens=6, vocab=VOCAB
    )
    requests = workload.generate(seed=3)
    assert requests == workload.generate(seed=3)
    assert [r.turn_index for r in requests] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    by_id = {r.request_id: r for r in requests}
    for request in requests:
        assert request.num_prompt_tokens == 10 + request.turn_index * (6 + 5)
        if request.turn_index == 0:
            assert request.depends_on is None
        else:
            previous = by_id[request.depends_on]
            assert previous.conversation_id == request.conversation_id
            assert previous.turn_index == request.turn_index - 1
            assert request.prompt_token_ids[: previous.num_prompt_tokens] == previous.prompt_token_ids


def test_mixed_lengths_follow_the_stated_distribution():
    workload = MixedLengthWorkload(
        num_requests=40, short_len=20, long_len=400, long_fraction=0.1, length_jitter=0.25, max_tokens=3, vocab=VOCAB
    )
    requests = workload.generate(seed=5)
    assert requests == workload.generate(seed=5)
    longs = [r for r in requests if r.group_id == "long"]
    shorts = [r for r in requests if r.group_id == "short"]
    assert len(longs) == 4 and len(shorts) == 36
    assert all(300 <= r.num_prompt_tokens <= 500 for r in longs)
    assert all(15 <= r.num_prompt_tokens <= 25 for r in shorts)
    assert len({r.num_prompt_tokens for r in shorts}) > 3  # lengths are drawn, not constant
    assert MixedLengthWorkload(num_requests=10, long_fraction=0.01).num_long == 1
    with pytest.raises(WorkloadError):
        MixedLengthWorkload(long_fraction=1.5)


def test_trace_hash_ids_give_shared_prefixes(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1536, "output_length": 9, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2, 4]},
        {"timestamp": 3000, "input_length": 700, "output_length": 2, "hash_ids": [5]},
    ]
    trace.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    records = load_mooncake_trace(trace)
    workload = TraceWorkload(tuple(records), block_size=4, trace_block_size=512, speedup=2.0, vocab=VOCAB)
    first, second, third = workload.generate(seed=0)
    assert first.prompt_token_ids == workload.generate(seed=0)[0].prompt_token_ids
    assert first.num_prompt_tokens == second.num_prompt_tokens == 12  # 1536 * 4 / 512
    assert _common_prefix_len(first.prompt_token_ids, second.prompt_token_ids) >= 8
    assert first.prompt_token_ids[8:] != second.prompt_token_ids[8:]
    assert first.prompt_token_ids[:4] == tuple(workload.block_tokens(0, 1))
    assert third.num_prompt_tokens == 6  # ceil(700 * 4 / 512): one block + 2 padding tokens
    assert third.prompt_token_ids[:4] == tuple(workload.block_tokens(0, 5))
    assert [r.arrival_offset_s for r in (first, second, third)] == [0.0, 0.25, 1.0]
    assert [r.max_tokens for r in (first, second, third)] == [9, 4, 2]
    capped = TraceWorkload(
        tuple(records), block_size=4, max_prompt_tokens=5, max_output_tokens=3, vocab=VOCAB
    ).generate(seed=0)
    assert [r.num_prompt_tokens for r in capped] == [5, 5, 5]
    assert [r.max_tokens for r in capped] == [3, 3, 2]
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "output_length": 3}\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:1"):
        load_mooncake_trace(tmp_path / "bad.jsonl")


def test_arrivals_and_load_points():
    offsets = poisson_arrival_offsets(4000, rate=50.0, seed=1)
    assert offsets == poisson_arrival_offsets(4000, rate=50.0, seed=1)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert np.mean(np.diff(offsets)) == pytest.approx(1 / 50.0, rel=0.1)
    assert poisson_arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert parse_rates(["4,1", "inf", "1"]) == [1.0, 4.0, math.inf]
    assert parse_concurrencies(["8", "2,4"]) == [2, 4, 8]
    with pytest.raises(WorkloadError):
        parse_rates(["0"])
    loads = build_load_points([1.0, 2.0], [3], LoadPoint(concurrency=8))
    assert loads == [LoadPoint(rate=1.0, concurrency=3), LoadPoint(rate=2.0, concurrency=3)]
    assert build_load_points([], [], LoadPoint()) == [LoadPoint()]
    requests = PrefixRepetitionWorkload(2, 4, 2, 2, 2, VOCAB).generate(0)
    assert [r.arrival_offset_s for r in apply_load(requests, LoadPoint(concurrency=2), 0)] == [0.0] * 4
    assert apply_load(requests, LoadPoint(rate=5.0), 0)[-1].arrival_offset_s > 0


def test_text_rendering_keeps_prefixes(tmp_path: Path):
    renderer = PromptTextRenderer()
    assert token_id_to_word(0) != token_id_to_word(70)
    assert renderer.render([5, 6, 7]).startswith(renderer.render([5, 6]))
    assert len(renderer.render([5, 6, 7]).split()) == 3
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert PromptTextRenderer(tmp_path).render([1, 2, 1]) == "hello world hello"
    with pytest.raises(FileNotFoundError):
        PromptTextRenderer(tmp_path / "missing")
