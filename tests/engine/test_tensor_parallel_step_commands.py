"""What a tensor-parallel step sends its follower rank and which collectives it runs
(engine/parallel/tp_model.py, shard_plan.py): a step's logits go out with its forward command
(the follower computes its vocabulary rows' logits from its own final hidden states), so a
decode step is one command (over shared memory, where the forward and its batch go through the
step mailbox, no collective; over gloo the logits stay a command of their own, and the batch a
broadcast); a small untied embedding is held whole by every rank, so its step
runs 1 + 2 x layers collectives, a tied or large one 2 + 2 x layers (the embedding's all-reduce);
prompt log-probabilities still take a logits command of their own; and a forward whose announced
logits no compute_logits took (its step failed in between) leaves the ranks paired, the next
call's results equal to TP 1's. Two real ranks over shared memory."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel.shard_plan import REPLICATED_EMBEDDING_MAX_PARAMS, ShardPlan
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import contiguous_metadata, make_checkpoint

LOGIT_TOL = 1e-4  # fp32; the row-parallel sums add partial dot products in another order
PROMPT = [5, 17, 33, 2, 9, 41, 77, 100, 3, 8, 12, 60, 61, 62, 63, 64, 65, 66, 67]


def _engine(model: str, tp: int, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=tp, **kwargs))


def _count_headers(engine: LLMEngine, monkeypatch) -> Counter:
    """The commands the driver sends its follower, by kind (the real ones, counted on the way):
    over its pipe, and a CPU group's forwards through the step mailbox (step_mailbox.py)."""
    ranks, sent = engine.tensor_parallel, Counter()
    send, post = ranks._send, ranks._post

    def counted(header) -> None:
        sent[header[0]] += 1
        send(header)

    def counted_post(*args) -> bool:
        posted = post(*args)
        sent["forward" if posted else "forward too large for the mailbox"] += 1
        return posted

    monkeypatch.setattr(ranks, "_send", counted)
    monkeypatch.setattr(ranks, "_post", counted_post)
    return sent


@pytest.fixture(scope="module")
def tiny(models_root) -> str:
    return str(make_checkpoint(models_root, "tiny", "llama"))


@pytest.mark.parametrize(
    ("arch", "replicated", "per_step"),
    [
        ("llama", True, lambda layers: 1 + 2 * layers),  # o and down per layer, the logits gather
        ("qwen2", False, lambda layers: 2 + 2 * layers),  # tied: the vocabulary-parallel embedding's all-reduce too
    ],
)
def test_a_step_is_one_command_and_its_collectives(models_root, monkeypatch, arch, replicated, per_step):
    engine = _engine(str(make_checkpoint(models_root, "tiny", arch)), 2)
    try:
        assert engine.tensor_parallel.group.plan.replicated_embedding is replicated
        shm = engine.tensor_parallel.group.shm
        assert shm is not None  # Linux on x86-64: the collectives are counted over shared memory
        sent = _count_headers(engine, monkeypatch)
        before = shm.collectives
        params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
        engine.generate([PROMPT], params)  # a prefill step and 8 decode steps
        assert dict(sent) == {"forward": 9}  # no logits command: each went out with its forward
        assert shm.collectives - before == 9 * per_step(engine.model_config.num_hidden_layers)
        sent.clear()
        with_prompt_logprobs = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
        engine.generate([[p + 1 for p in PROMPT]], with_prompt_logprobs)
        # The prompt's logits are taken first (its own command), so its step's forward
        # announces none: the sampled row's logits are a logits command too.
        assert dict(sent) == {"forward": 2, "logits": 2}
    finally:
        engine.close()


def test_over_gloo_the_logits_stay_a_command_of_their_own(tiny, monkeypatch):
    """A gloo gather could hold the follower until the driver's part: no logits ride on a forward."""
    engine = _engine(tiny, 2, tensor_parallel_shm_collectives=False)
    try:
        assert engine.tensor_parallel.group.shm is None
        sent = _count_headers(engine, monkeypatch)
        engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert dict(sent) == {"forward": 3, "logits": 3}
    finally:
        engine.close()


def test_announced_logits_that_no_call_takes_leave_the_ranks_paired(tiny):
    """The follower gathers its share of a forward's announced logits at once; when the driver
    never asks for them (a step failed between forward and sampling), its next call takes them
    first. Without that every later collective would pair with the wrong one and hang."""
    reference_engine = _engine(tiny, 1)
    engine = _engine(tiny, 2)
    try:
        n, block_size = len(PROMPT), engine.config.block_size
        meta = contiguous_metadata([n], [n], block_size, -(-n // block_size))
        ids, positions = torch.tensor(PROMPT), torch.arange(n)

        def forward(model, kv_cache, **announce) -> torch.Tensor:
            return model(ids, positions, kv_cache, meta, **announce)

        reference = reference_engine.model.compute_logits(forward(reference_engine.model, reference_engine.kv_cache))
        model, kv_cache, last = engine.model, engine.kv_cache, [n - 1]
        forward(model, kv_cache, logits_rows=last)  # announced, never taken
        taken = model.compute_logits(forward(model, kv_cache, logits_rows=last)[-1:])
        other_rows = model.compute_logits(forward(model, kv_cache, logits_rows=last)[-3:])  # not the rows announced
        forward(model, kv_cache, logits_rows=last)
        unannounced = model.compute_logits(forward(model, kv_cache)[-4:])
        torch.testing.assert_close(taken, reference[-1:], rtol=0, atol=LOGIT_TOL)
        torch.testing.assert_close(other_rows, reference[-3:], rtol=0, atol=LOGIT_TOL)
        torch.testing.assert_close(unannounced, reference[-4:], rtol=0, atol=LOGIT_TOL)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        assert (
            engine.generate([PROMPT], params)[0].token_ids == reference_engine.generate([PROMPT], params)[0].token_ids
        )
    finally:
        engine.close()
        reference_engine.close()


def test_only_a_small_untied_embedding_is_replicated():
    def plan(vocab: int, hidden: int, tied: bool = False, size: int = 2) -> ShardPlan:
        config = ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=1,
            head_dim=hidden // 4,
            intermediate_size=2 * hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
        )
        return ShardPlan(config, size, size - 1)

    at_bound = plan(REPLICATED_EMBEDDING_MAX_PARAMS // 512, 512)
    assert at_bound.replicated_embedding
    assert at_bound.checkpoint_slice("model.embed_tokens.weight") is None  # the whole table on every rank
    assert at_bound.checkpoint_slice("lm_head.weight") == (0, at_bound.vocab_start, at_bound.config.vocab_size)
    assert not plan(REPLICATED_EMBEDDING_MAX_PARAMS // 512 + 1, 512).replicated_embedding  # larger: split
    split = plan(2048, 256, tied=True)  # tied: the table is also lm_head, which stays split
    assert not split.replicated_embedding
    assert split.checkpoint_slice("model.embed_tokens.weight") == (0, 1024, 2048)
    assert not plan(2048, 256, size=1).replicated_embedding  # TP 1: nothing to replicate
