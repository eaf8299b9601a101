"""What a tensor-parallel step sends its follower rank (engine/parallel/tp_model.py): a step's
logits go out with its forward command (the follower computes its vocabulary rows' logits from
its own final hidden states), so a decode step is one command and 3 + 2 x layers collectives;
prompt log-probabilities still take a logits command of their own; and a forward whose
announced logits no compute_logits took (its step failed in between) leaves the ranks paired,
the next call's results equal to TP 1's. Two real ranks over shared memory."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import contiguous_metadata, make_checkpoint

LOGIT_TOL = 1e-4  # fp32; the row-parallel sums add partial dot products in another order
PROMPT = [5, 17, 33, 2, 9, 41, 77, 100, 3, 8, 12, 60, 61, 62, 63, 64, 65, 66, 67]


def _engine(model: str, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=tp))


def _count_headers(engine: LLMEngine, monkeypatch) -> Counter:
    """The commands the driver sends its follower, by kind (the real ones, counted on the way)."""
    ranks, sent = engine.tensor_parallel, Counter()
    send = ranks._send

    def counted(header) -> None:
        sent[header[0]] += 1
        send(header)

    monkeypatch.setattr(ranks, "_send", counted)
    return sent


@pytest.fixture(scope="module")
def tiny(models_root) -> str:
    return str(make_checkpoint(models_root, "tiny", "llama"))


def test_a_step_is_one_command_and_its_logits_one_gather(tiny, monkeypatch):
    engine = _engine(tiny, 2)
    try:
        shm = engine.tensor_parallel.group.shm
        assert shm is not None  # Linux on x86-64: the collectives are counted over shared memory
        sent = _count_headers(engine, monkeypatch)
        before = shm.collectives
        params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
        engine.generate([PROMPT], params)  # a prefill step and 8 decode steps
        assert dict(sent) == {"forward": 9}  # no logits command: each went out with its forward
        layers = engine.model_config.num_hidden_layers
        # The batch, the embedding, two per layer (o and down), and the logits gather.
        assert shm.collectives - before == 9 * (3 + 2 * layers)
        sent.clear()
        with_prompt_logprobs = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
        engine.generate([[p + 1 for p in PROMPT]], with_prompt_logprobs)
        # The prompt's logits are taken first (its own command), so its step's forward
        # announces none: the sampled row's logits are a logits command too.
        assert dict(sent) == {"forward": 2, "logits": 2}
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
