"""A step's prefill attention in few 4-D SDPA calls (engine/ops/batched_prefill.py): the
padded groups and the in-place runs of fresh prompts attend exactly as each sequence alone
would, and an engine batch of mixed prompt lengths with prefix-cache hits and a chunked prompt
still generates transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.ops import attention as attention_module
from splitserve.engine.ops.batched_prefill import (
    PrefillRow,
    batched_prefill_attention,
    group_prefills,
    split_fresh_runs,
    uniform_prefill_attention,
)
from splitserve.engine.ops.prefill_attention import prefill_attention
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_engine import assert_baseline, engine_for, hf_greedy

BOTH_SCHEDULINGS = True  # the engine test runs with async scheduling and without (conftest.py)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # grouped-query: two query heads per K/V head


def _rows(shapes: list[tuple[int, int]]) -> list[PrefillRow]:
    """(num_queries, context_len) per sequence -> rows of a flattened batch, in that order."""
    rows, start = [], 0
    for seq, (num_queries, context_len) in enumerate(shapes):
        rows.append(PrefillRow(seq, start, start + num_queries, context_len))
        start += num_queries
    return rows


def _alone(q, contexts_k, contexts_v, rows, scale) -> torch.Tensor:
    """Each sequence's attention by itself (prefill_attention), the path before batching."""
    out = torch.zeros_like(q)
    for row, keys, values in zip(rows, contexts_k, contexts_v):
        out[row.start : row.end] = prefill_attention(q[row.start : row.end], keys, values, scale)
    return out


def test_padded_group_attends_as_each_sequence_alone():
    torch.manual_seed(0)
    # Fresh prompts, chunks after a cached prefix, a single token after a long prefix.
    rows = _rows([(9, 9), (30, 30), (5, 21), (16, 64), (1, 40), (30, 45)])
    q = torch.randn(rows[-1].end, HEADS, HEAD_DIM)
    contexts_k = [torch.randn(r.context_len, KV_HEADS, HEAD_DIM) for r in rows]
    contexts_v = [torch.randn(r.context_len, KV_HEADS, HEAD_DIM) for r in rows]
    expected = _alone(q, contexts_k, contexts_v, rows, 0.25)
    # One group of every row: the widest padding, keys beyond each context filled with noise.
    width = max(r.context_len for r in rows)
    keys = torch.randn(len(rows), width, KV_HEADS, HEAD_DIM)
    values = torch.randn(len(rows), width, KV_HEADS, HEAD_DIM)
    for b, (k, v) in enumerate(zip(contexts_k, contexts_v)):
        keys[b, : len(k)], values[b, : len(v)] = k, v
    out = torch.full_like(q, float("nan"))
    batched_prefill_attention(q, keys, values, rows, 0.25, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fresh_runs_attend_in_place_as_each_sequence_alone():
    torch.manual_seed(1)
    rows = _rows([(12, 12), (12, 12), (12, 12), (7, 7), (12, 12), (4, 20), (12, 12), (12, 12)])
    runs, rest = split_fresh_runs(rows)
    # Runs are consecutive fresh prompts of one length; the prefix chunk is left for a group.
    assert [[r.seq for r in run] for run in runs] == [[0, 1, 2], [3], [4], [6, 7]]
    assert [r.seq for r in rest] == [5]
    q = torch.randn(rows[-1].end, HEADS, HEAD_DIM)
    new_k, new_v = torch.randn(rows[-1].end, KV_HEADS, HEAD_DIM), torch.randn(rows[-1].end, KV_HEADS, HEAD_DIM)
    fresh = [r for run in runs for r in run]
    expected = _alone(q, [new_k[r.start : r.end] for r in fresh], [new_v[r.start : r.end] for r in fresh], fresh, 0.3)
    out = torch.zeros_like(q)
    for run in runs:
        uniform_prefill_attention(q, new_k, new_v, run, 0.3, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not out[rest[0].start : rest[0].end].any()  # a run writes only its own rows


def test_groups_cover_every_row_once_within_the_padding_budget():
    rows = _rows([(200, 200), (190, 190), (8, 8), (1, 300), (1, 90), (64, 128), (60, 128), (200, 260)])
    groups = group_prefills(rows, budget=1.5)
    assert sorted(r.seq for g in groups for r in g) == list(range(len(rows)))
    for group in groups:
        real = sum(r.num_queries * r.context_len for r in group)
        padded = len(group) * max(r.num_queries for r in group) * max(r.context_len for r in group)
        assert len(group) == 1 or padded <= 1.5 * real
    assert any(len(g) > 1 for g in groups)  # similar shapes do share a call
    assert len(group_prefills(rows, budget=1.0)) > len(groups)  # no padding allowed: more calls


def test_mixed_lengths_and_prefix_hits_match_transformers(tiny_model, monkeypatch):
    """One engine batch: fresh prompts of one length (an in-place run), fresh prompts of other
    lengths, prompts whose first 48 tokens are cached (chunks behind a prefix, padded groups
    under a mask) and a prompt longer than the step's token budget (chunked)."""
    calls: dict[str, list[int]] = {"uniform": [], "grouped": []}
    uniform, grouped = attention_module.uniform_prefill_attention, attention_module.batched_prefill_attention

    def spy_uniform(q, k, v, run, *args):
        calls["uniform"].append(len(run))
        return uniform(q, k, v, run, *args)

    def spy_grouped(q, k, v, group, *args):
        calls["grouped"].append(len(group))
        return grouped(q, k, v, group, *args)

    monkeypatch.setattr(attention_module, "uniform_prefill_attention", spy_uniform)
    monkeypatch.setattr(attention_module, "batched_prefill_attention", spy_grouped)
    engine = engine_for(tiny_model, max_num_batched_tokens=128, max_num_seqs=16)
    shared = list(range(10, 58))  # three full blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate([shared + [300]], params)
    prompts = [list(range(100 + 10 * i, 110 + 10 * i)) for i in range(4)]  # fresh, one length
    prompts += [list(range(150, 153)), list(range(160, 193))]  # fresh, other lengths
    prompts += [
        shared + list(range(200 + 20 * i, 200 + 20 * i + n)) for i, n in enumerate((1, 5, 18, 2))
    ]  # prefix hits
    prompts += [list(range(300, 450))]  # longer than the step's token budget
    outputs = engine.generate(prompts, params)
    assert [o.num_cached_tokens for o in outputs[6:10]] == [48] * 4
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, 12), prompt[:3]
    assert max(calls["uniform"]) > 1 and max(calls["grouped"]) > 1
    assert_baseline(engine)


@pytest.mark.parametrize("budget", [1.0, 1.5, 4.0])
def test_padding_budget_changes_no_output(budget):
    torch.manual_seed(2)
    rows = _rows([(3, 3), (17, 50), (16, 16), (1, 33), (20, 20), (2, 70)])
    q = torch.randn(rows[-1].end, HEADS, HEAD_DIM)
    contexts_k = [torch.randn(r.context_len, KV_HEADS, HEAD_DIM) for r in rows]
    contexts_v = [torch.randn(r.context_len, KV_HEADS, HEAD_DIM) for r in rows]
    out = torch.zeros_like(q)
    for group in group_prefills(rows, budget):
        width = max(r.context_len for r in group)
        keys = torch.zeros(len(group), width, KV_HEADS, HEAD_DIM)
        values = torch.zeros(len(group), width, KV_HEADS, HEAD_DIM)
        for b, r in enumerate(group):
            keys[b, : r.context_len], values[b, : r.context_len] = contexts_k[r.seq], contexts_v[r.seq]
        batched_prefill_attention(q, keys, values, group, 0.25, out)
    torch.testing.assert_close(out, _alone(q, contexts_k, contexts_v, rows, 0.25), atol=1e-5, rtol=1e-5)
